"""Worker side of a partial weight update: a LoRA student's adapted layers alone, once vLLM holds its frozen base.

vLLM's layerwise reload processes a layer once all of its tensors have arrived. At the end it puts back the old
weights of every layer that got none (logging "Failed to load weights" for each), and processes a layer that got
only some of its tensors with the rest uninitialised (meant for padding rows). A partial update leaves most layers
out on purpose, so those warnings are silenced; it must never leave a layer half-loaded, so that is refused naming
the layers (the trainer then restarts the engine and sends the whole model).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"  # reload_weights: "weights were not loaded"


def half_loaded_layers(model: torch.nn.Module, infos: Mapping | None = None) -> list[str]:
    """Layers of ``model`` that received some but not all of their tensors in the reload under way (``infos``: each
    layer's ``LayerReloadingInfo``; default vLLM's own record of them)."""
    if infos is None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO as infos

    out = []
    for name, layer in model.named_modules():
        info = infos.get(layer)
        if info is not None and info.can_load() and 0 < info.load_numel < info.load_numel_total:
            out.append(name)
    return out


def check_complete_layers(model: torch.nn.Module, infos: Mapping | None = None) -> None:
    """Raise naming the layers a partial update left half-loaded (before vLLM would process them as they are)."""
    half = half_loaded_layers(model, infos)
    if half:
        raise RuntimeError(
            f"a partial weight update sent only some tensors of the vLLM layers {half[:5]}: the trainer must send "
            "every tensor of a Megatron module that changes (megatron_opd.weight_sync.source)"
        )


@contextmanager
def unsent_layers_quiet(partial: bool) -> Iterator[None]:
    """While a partial update is finalised: vLLM's warnings about the layers not sent silenced."""
    loggers = [logging.getLogger(name) for name in (LAYERWISE_LOGGER, INPLACE_LOGGER)] if partial else []
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
