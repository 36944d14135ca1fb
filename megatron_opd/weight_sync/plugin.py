"""Registers megatron-opd's weight-transfer back end with vLLM (idempotent).

vLLM loads ``vllm.general_plugins`` entry points in every process it starts (engine core, workers), so
``setup.py`` names :func:`register` there; the engine process also calls it before building the engine, which is
enough in vLLM's in-process mode. A second registration of a name raises inside vLLM, hence the check.
"""

from __future__ import annotations


def register() -> None:
    """Add the gloo engines to vLLM's worker-side and trainer-side factories, once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from megatron_opd.weight_sync.gloo_engine import BACKEND

    module = "megatron_opd.weight_sync.gloo_engine"
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, module, "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, module, "GlooTrainerWeightTransferEngine")


def has_weight_transfer_api() -> bool:
    """Whether the installed vLLM has ``vllm.distributed.weight_transfer`` (vLLM >= 0.16)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer.factory") is not None
    except ModuleNotFoundError:
        return False
