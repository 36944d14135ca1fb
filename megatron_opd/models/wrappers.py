"""Multimodal wrappers whose text tower megatron-opd builds (Qwen3.5's ``qwen3_5`` / ``qwen3_5_moe`` folders).

A wrapper's ``config.json`` nests the text model's fields under ``text_config`` and its safetensors hold the text
tower as ``model.language_model.*`` beside the vision tower (``model.visual.*``) and multi-token-prediction layers
(``mtp.*``). Read through here, the folder is the text model: its config is ``text_config``, its tensors are named
as the text model's (``model.*``, ``lm_head.*``), and the rest is skipped, named in one log line. A family lists the
wrappers it reads in ``ModelFamily.wrapper_types``.

An export of a model read from a wrapper is the text model it built (:func:`exported_config`): the vision tower and
MTP layers were never loaded or trained, so a folder under the wrapper's names would hold a vision tower of nothing.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TEXT_PREFIX = "model.language_model."
"""Where a wrapper keeps the text tower's ``model.*`` tensors."""


def wrapper_types() -> frozenset[str]:
    """Every ``model_type`` some family reads the text tower of."""
    from megatron_opd.models.families import FAMILIES

    return frozenset(t for family in FAMILIES.values() for t in family.wrapper_types)


def is_wrapper(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in wrapper_types() and isinstance(cfg.get("text_config"), dict)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's ``config.json`` fields: a wrapper's ``text_config`` (tied embeddings and dtype from the
    wrapper where the text config leaves them out), else ``cfg`` itself."""
    if not is_wrapper(cfg):
        return cfg
    text = dict(cfg["text_config"])
    for name in ("tie_word_embeddings", "torch_dtype", "dtype"):
        if name in cfg and name not in text:
            text[name] = cfg[name]
    return text


def text_tensor_names(cfg: dict[str, Any], names: list[str], source: str) -> dict[str, str]:
    """Text-model name -> stored name of every tensor a wrapper's text tower holds (all of ``names``, unchanged,
    for a plain text model); the skipped tensors are named, by prefix, in one log line."""
    if not is_wrapper(cfg):
        return {name: name for name in names}
    kept, skipped = {}, {}
    for name in names:
        if name.startswith(TEXT_PREFIX):
            kept["model." + name[len(TEXT_PREFIX) :]] = name
        elif name.startswith("lm_head."):
            kept[name] = name
        else:
            prefix = ".".join(name.split(".")[:2]) if name.startswith("model.") else name.split(".")[0]
            skipped[prefix] = skipped.get(prefix, 0) + 1
    if skipped:
        listed = ", ".join(f"{prefix}.* ({count} tensors)" for prefix, count in sorted(skipped.items()))
        logger.info("%s is a %s wrapper: loading its text tower (%s*), skipping %s", source, cfg["model_type"],
                    TEXT_PREFIX, listed)  # fmt: skip
    return kept


def exported_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``config.json`` of an export from the model whose ``config.json`` is ``cfg``: a wrapper's text model
    (:func:`text_config`, with the wrapper's architecture as the text model's: ``...ForConditionalGeneration`` ->
    ``...ForCausalLM``), said in one log line; any other ``cfg`` unchanged."""
    if not is_wrapper(cfg):
        return cfg
    text = text_config(cfg)
    if "architectures" not in text and cfg.get("architectures"):
        text["architectures"] = [a.replace("ForConditionalGeneration", "ForCausalLM") for a in cfg["architectures"]]
    logger.info("%s is a %s wrapper: exporting its text tower as a %s model (the vision tower and MTP layers were "
                "not loaded)", source, cfg["model_type"], text.get("model_type"))  # fmt: skip
    return text
