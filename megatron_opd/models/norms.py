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

import functools
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


class AllHeadsRMSNorm(torch.nn.Module):
    """RMSNorm of queries (or keys) over all heads together, as OLMo-2 norms the whole projection (Megatron's
    QK-norm is per head). Under tensor parallelism each rank holds some heads: the sum of squares is all-reduced
    over the TP group (its backward all-reduces too: every rank's heads depend on the total), and the weight is
    this rank's slice (``Split.COLUMN``).

    Built by Megatron's attention as ``q_layernorm``/``k_layernorm`` with ``hidden_size`` = head dim; ``heads``
    (``"query"`` or ``"key"``) comes from the layer spec's params."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, heads: str = "query", **_: Any) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        total = config.num_attention_heads if heads == "query" else config.num_query_groups
        self.full_width = total * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(total // tp * hidden_size, dtype=config.params_dtype))
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., heads on this rank, head dim]`` -> the same shape."""
        flat = x.reshape(*x.shape[:-2], -1).float()
        square_sum = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            from megatron.core import parallel_state
            from torch.distributed.nn.functional import all_reduce

            square_sum = all_reduce(square_sum, group=parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(square_sum / self.full_width + self.eps)
        return (normed.to(x.dtype) * self.weight).reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The weight is split over tensor-parallel ranks along its only axis (as a column-parallel bias)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``w`` and the norm scales by ``1 + w``, in float32."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(config, hidden_size, eps=eps, **kwargs)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


@functools.cache
def post_normed(linear: type, norm: type = RMSNorm) -> type:
    """``linear`` (Megatron's row-parallel output projection of attention or MLP) followed by an RMSNorm of its
    output: the post-sublayer ("sandwich") norm of OLMo-2 and Gemma 3, before the residual add. The norm is
    ``post_norm`` inside the projection (its weight ``linear_proj.post_norm.weight``); with sequence parallelism
    it norms this rank's tokens."""

    class PostNormed(linear):
        def __init__(self, *args: Any, config: Any, **kwargs: Any) -> None:
            super().__init__(*args, config=config, **kwargs)
            self.post_norm = norm(config, config.hidden_size, eps=config.layernorm_epsilon)

        def forward(self, *args: Any, **kwargs: Any):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out, bias = out + bias, None
            return self.post_norm(out), bias

    PostNormed.__name__ = PostNormed.__qualname__ = f"{norm.__name__}Normed{linear.__name__}"
    return PostNormed
