"""Which back end does the per-chunk work on the local shard: the torch path or the Triton kernels.

The per-chunk interface (``LocalOps``) and both implementations live in ``kernels/`` (``divergence_torch``,
``divergence_triton``), which never import this package; the losses call whichever ``select_local_ops`` returns.
"""

from __future__ import annotations

import torch

from megatron_opd.kernels.divergence_torch import LocalOps, TorchLocalOps, compute_dtype

__all__ = ["LocalOps", "TorchLocalOps", "compute_dtype", "select_local_ops"]


def select_local_ops(backend: str, device: torch.device) -> LocalOps:
    """``"torch"``, ``"triton"`` (CUDA only), or ``"auto"``: Triton on CUDA when it imports, else torch.

    The torch path returns a fresh ``TorchLocalOps`` (its scratch buffers belong to one loss call)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return TorchLocalOps()
    from megatron_opd.kernels import divergence_triton

    if backend == "triton":
        if not divergence_triton.triton_usable_on(device):
            raise ValueError(
                "backend='triton' needs CUDA tensors and an importable triton (or TRITON_INTERPRET=1 for the "
                "interpreter); use backend='torch' or 'auto'"
            )
        return divergence_triton.TRITON_OPS
    if device.type == "cuda" and divergence_triton.triton_available():
        return divergence_triton.TRITON_OPS
    return TorchLocalOps()
