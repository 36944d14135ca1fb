"""The worker side of a partial weight update (``weight_sync/partial.py``): a layer that received only some of its
tensors is refused by name, layers that received none or all of them pass, and vLLM's warnings are silenced for the
update only. vLLM's per-layer reload records are stood in for (importing vLLM costs seconds; the LoRA case of
``tests/test_weight_sync_vllm.py`` runs the real ones)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.weight_sync.partial import LAYERWISE_LOGGER, check_complete_layers, unsent_layers_quiet


def _info(loaded: int, total: int | None) -> SimpleNamespace:
    """vLLM's ``LayerReloadingInfo`` as far as the check reads it."""
    return SimpleNamespace(load_numel=loaded, load_numel_total=total, can_load=lambda: total is not None)


def test_a_half_loaded_layer_is_refused_by_name():
    model = torch.nn.ModuleDict({"qkv_proj": torch.nn.Linear(4, 12), "o_proj": torch.nn.Linear(4, 4),
                                 "gate": torch.nn.Linear(4, 2), "norm": torch.nn.LayerNorm(4)})  # fmt: skip
    infos = {model["o_proj"]: _info(0, 20), model["gate"]: _info(10, 10), model["norm"]: _info(0, None)}
    check_complete_layers(model, infos)  # not sent, complete, not reloading: all fine
    infos[model["qkv_proj"]] = _info(48, 60)  # the weight without its bias
    with pytest.raises(RuntimeError, match=r"\['qkv_proj'\]"):
        check_complete_layers(model, infos)


def test_warnings_are_silenced_during_a_partial_update_only():
    logger = logging.getLogger(LAYERWISE_LOGGER)
    before = logger.level
    with unsent_layers_quiet(partial=True):
        assert not logger.isEnabledFor(logging.WARNING)
    assert logger.level == before
    with unsent_layers_quiet(partial=False):
        assert logger.level == before
