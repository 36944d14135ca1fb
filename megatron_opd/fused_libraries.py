"""Which fused-kernel library runs each part of training: TransformerEngine, NVIDIA apex, or plain torch.

Megatron-Core picks them itself from what is importable. Layers (linear, core attention, norms) come from the
TransformerEngine layer spec when TE is usable (``build.use_transformer_engine`` can turn it off); without it the
core attention is ours on torch's SDPA, or Megatron's local one (``build.attention``). Megatron's
optimizer (Adam) and its multi-tensor ops (gradient norm, clipping, scaling) use TE's, else NVIDIA apex's
(``apex`` with its ``amp_C`` CUDA extension, built from NVIDIA's sources; the PyPI package named ``apex`` is an
unrelated project), else torch's. Nothing here changes that choice: the trainer logs it once at start-up, so a run
that is slow because the fused kernels are missing says so. The probe is a parameter so tests can fake a GPU
machine (TE cannot be installed on CPU).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TE, APEX, TORCH = "TransformerEngine", "apex", "torch"
SDPA, LOCAL = "torch SDPA", "Megatron local (keeps s x s scores)"
"""Core attention without TE: ``build.attention=sdpa`` (megatron_opd.models.attention) or ``local``."""

PARTS = {
    "layers": "layers (linear, norms)",
    "attention": "core attention",
    "optimizer": "optimizer (Adam)",
    "multi_tensor": "gradient norm / clipping / scaling (multi-tensor ops)",
}
"""The parts whose implementation depends on the libraries, with the names the start-up line uses."""


@dataclass(frozen=True)
class Libraries:
    """Which fused-kernel libraries this process can use."""

    transformer_engine: bool
    """``transformer_engine.pytorch`` imports and CUDA is available."""
    apex: bool
    """NVIDIA apex with its CUDA extension ``amp_C``."""


def nvidia_apex_available() -> bool:
    """True for NVIDIA apex built with its CUDA extensions (what Megatron-Core imports), never for PyPI's ``apex``."""
    if importlib.util.find_spec("apex") is None or importlib.util.find_spec("amp_C") is None:
        return False
    try:
        import amp_C  # noqa: F401
        from apex.multi_tensor_apply import multi_tensor_applier  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken or unrelated apex means "not available", never a crash
        return False
    return True


def probe_libraries() -> Libraries:
    """The libraries of this machine (the default probe)."""
    from megatron_opd.distributed.device import has_transformer_engine

    return Libraries(transformer_engine=has_transformer_engine(), apex=nvidia_apex_available())


def fused_parts(
    libraries: Libraries, use_transformer_engine: bool | None = None, attention: str = "sdpa"
) -> dict[str, str]:
    """For each part of :data:`PARTS`, the library it runs on, in Megatron-Core's order of preference."""
    te_layers = libraries.transformer_engine and use_transformer_engine is not False
    kernels = TE if libraries.transformer_engine else APEX if libraries.apex else TORCH
    core = TE if te_layers else SDPA if attention == "sdpa" else LOCAL
    return {"layers": TE if te_layers else TORCH, "attention": core, "optimizer": kernels, "multi_tensor": kernels}


_logged = False


def log_fused_libraries(
    use_transformer_engine: bool | None = None,
    probe: Callable[[], Libraries] = probe_libraries,
    attention: str = "sdpa",
) -> dict[str, str]:
    """Log once per process which library runs each part; returns the mapping (every call)."""
    global _logged
    libraries = probe()
    parts = fused_parts(libraries, use_transformer_engine, attention)
    if not _logged:
        _logged = True
        missing = [
            name
            for name, present in (("TransformerEngine", libraries.transformer_engine), ("NVIDIA apex", libraries.apex))
            if not present
        ]
        logger.info(
            "fused kernels: %s%s",
            "; ".join(f"{PARTS[part]}: {library}" for part, library in parts.items()),
            f" ({' and '.join(missing)} not available)" if missing else "",
        )
    return parts
