"""The model families megatron-opd builds, one module each, and the registry by Hugging Face ``model_type``.

Adding a family: write ``families/<name>.py`` with a ``FAMILY = ModelFamily(...)`` and list it in ``_MODULES``
below (``docs/models.md``, "Adding a model family").
"""

from __future__ import annotations

from megatron_opd.models.families import (
    deepseek_v2,
    deepseek_v3,
    ernie4_5_moe,
    gemma2,
    gemma3,
    gemma4,
    glm4_moe,
    glm4_moe_lite,
    gpt_oss,
    granite,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    olmo2,
    olmo3,
    olmoe,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    seed_oss,
    smollm3,
)
from megatron_opd.models.families.base import ModelFamily, SpecOptions

_MODULES = (
    llama, qwen2, qwen3, mistral, olmo2, phi3, gemma3, qwen3_moe, qwen2_moe, mixtral, deepseek_v3,
    olmo3, smollm3, seed_oss, granite, gemma2, glm4_moe, glm4_moe_lite, deepseek_v2,
    minimax_m2, ernie4_5_moe, olmoe,
    qwen3_next, qwen3_5, gpt_oss, gemma4,
)  # fmt: skip

FAMILIES: dict[str, ModelFamily] = {module.FAMILY.name: module.FAMILY for module in _MODULES}
"""Family name -> its declarations, in registry order (shape and memory tables follow it)."""

BY_MODEL_TYPE: dict[str, ModelFamily] = {t: f for f in FAMILIES.values() for t in f.model_types}
"""Hugging Face ``model_type`` -> the family that reads it."""

DEFERRED: dict[str, str] = {}
"""Hugging Face ``model_type`` -> why it is refused (the error names the reason, not just the list)."""


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` (``ModelArchitecture.family``); a ValueError lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {name!r}") from None


__all__ = ["BY_MODEL_TYPE", "DEFERRED", "FAMILIES", "ModelFamily", "SpecOptions", "family_named"]
