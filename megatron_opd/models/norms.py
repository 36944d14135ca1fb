"""RMSNorm for Megatron-Core's local (non-TransformerEngine) layer spec that allows sequence parallelism.

Megatron's torch fallback norm refuses ``sequence_parallel=True`` because it does not tag its
parameters; TE and apex norms do. This one takes Megatron's norm constructor arguments and tags
its weight ``sequence_parallel`` so ``finalize_model_grads`` all-reduces its gradient over the
tensor-parallel group, as it does for the fused norms.

``TritonRMSNorm`` (``build.norm=triton``) runs the fused kernels of ``kernels.rmsnorm_triton`` on CUDA (torch's
backward is slow at reducing the weight gradient, above all for Qwen3's QK-norm); elsewhere, and under
``torch.compile`` (which fuses the norm itself), it is exactly ``torch.nn.RMSNorm``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_opd.kernels import rmsnorm_triton


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's ``(config, hidden_size, eps)`` constructor."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.sequence_parallel:
            for param in self.parameters():
                param.sequence_parallel = True


class TritonRMSNorm(RMSNorm):
    """``RMSNorm`` through the fused Triton kernels where they apply (``build.norm=triton``), else torch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.compiler.is_compiling() and rmsnorm_triton.supports(x, self.weight):
            return rmsnorm_triton.rms_norm(x, self.weight, self.eps)
        return super().forward(x)
