"""A Mixture-of-Experts layer's experts as two grouped GEMMs (``torch._grouped_mm``), without TransformerEngine.

Megatron-Core runs experts as one grouped GEMM only through TransformerEngine (``TEGroupedMLP``) or, before 0.19,
the ``grouped_gemm`` package; otherwise ``SequentialMLP`` loops over the experts: two small GEMMs per expert and a
host sync per layer (``tokens_per_expert.tolist()``). On an H100 that loop held a Qwen3-30B-A3B teacher at 1.5%
MFU (``benchmarks/RESULTS.md``). :class:`GroupedExperts` is ``SequentialMLP`` — the same experts, parameters,
names, checkpoints and tensor/expert-parallel shards — whose forward stacks the local experts' weights and runs
each projection for every expert in one ``torch._grouped_mm`` call (CUTLASS on Hopper, a reference loop on CPU),
with the arithmetic of Megatron's ``MLP`` in between (expert biases, gpt-oss's clamped SwiGLU and its linear offset
included; a plain SiLU or SwiGLU times the routing probability is one operator, ``megatron_opd.moe.ops``), and no
host sync. The stacked weights are a view, not a copy per forward, where the experts' weights share one storage
(:meth:`GroupedExperts.share_one_storage`, done by ``build.moe_fused_routing``).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_opd.moe.ops import moe_silu_glu, plain_silu_glu


@functools.cache
def grouped_mm_unavailable(device_type: str, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` cannot run for ``dtype`` on ``device_type`` here, or None where it can (probed
    once with a two-group product checked against a loop)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    x = torch.randn(24, 16, device=device_type).to(dtype)
    w = torch.randn(2, 16, 16, device=device_type).to(dtype)
    offs = torch.tensor([8, 24], dtype=torch.int32, device=device_type)
    try:
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError) as err:
        return f"torch._grouped_mm does not run {dtype} on {device_type}: {str(err).splitlines()[0]}"
    ref = torch.cat([x[:8] @ w[0].T, x[8:] @ w[1].T])
    if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
        return f"torch._grouped_mm gave wrong results for {dtype} on {device_type}"
    return None


def equal_spacing(weights: list[torch.Tensor]) -> int | None:
    """The elements between consecutive ``weights`` where they are equally shaped, contiguous slices of one storage
    at equal, non-overlapping, ascending spacing (read on the host: no device operator), else None."""
    first = weights[0]
    same = all(
        w.shape == first.shape and w.dtype == first.dtype and w.device == first.device and w.is_contiguous()
        and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for w in weights
    )  # fmt: skip
    if not same:
        return None
    offsets = [w.storage_offset() for w in weights]
    spacing = offsets[1] - offsets[0] if len(offsets) > 1 else first.numel()
    if spacing < first.numel() or any(b - a != spacing for a, b in zip(offsets, offsets[1:])):
        return None
    return spacing


class _StackedView(torch.autograd.Function):
    """``[E, ...]``: equally spaced weights of one storage viewed as a stack (backward: the gradient unbound)."""

    @staticmethod
    def forward(ctx, spacing: int, *weights: torch.Tensor) -> torch.Tensor:
        first = weights[0]
        return first.as_strided((len(weights), *first.shape), (spacing, *first.stride()), first.storage_offset())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *grad.unbind(0))


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(weights)``, as a view (no operator) where they lie equally spaced in one storage
    (:meth:`GroupedExperts.share_one_storage`; the distributed optimizer moves them into its buffer: then a copy)."""
    spacing = equal_spacing(weights)
    return torch.stack(weights) if spacing is None else _StackedView.apply(spacing, *weights)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` computed as grouped GEMMs: fc1 for every local expert, the gated activation and the
    router's probabilities exactly as Megatron's ``MLP`` applies them, then fc2 — partial sums under expert tensor
    parallelism, reduced by the token dispatcher as for ``SequentialMLP``."""

    def _grouped_ok(self, hidden: torch.Tensor) -> bool:
        c = self.config
        plain = not (c.fp8 or c.fp4 or c.moe_apply_probs_on_input or c.bias_activation_fusion)
        plain = plain and not getattr(c, "use_te_activation_func", 0)
        return plain and self.num_local_experts > 1 and grouped_mm_unavailable(hidden.device.type, hidden.dtype) is None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        hidden = permuted_local_hidden_states
        if not self._grouped_ok(hidden):
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        offs = torch.cumsum(tokens_per_expert.to(device=hidden.device), 0).to(torch.int32)
        return self.grouped_forward(hidden, offs, permuted_probs), None

    def grouped_forward(self, hidden: torch.Tensor, offs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The experts' output for ``hidden`` whose rows are grouped by expert, ``offs`` (int32) each group's end
        row (rows after the last are left unwritten) and ``probs`` each row's routing probability."""
        c, experts = self.config, self.local_experts
        fc1 = stacked([expert.linear_fc1.weight for expert in experts])  # [E, 2F or F, H]
        fc2 = stacked([expert.linear_fc2.weight for expert in experts])  # [E, H, F]
        intermediate = torch._grouped_mm(hidden, fc1.transpose(1, 2), offs=offs)
        if c.add_bias_linear:  # each row gets its expert's bias
            intermediate = intermediate + self._per_row([e.linear_fc1.bias for e in experts], offs, hidden.shape[0])
        if self._silu_glu_ok():  # one operator (one kernel on CUDA)
            intermediate = moe_silu_glu(intermediate, probs, offs, bool(c.gated_linear_unit))
        else:
            intermediate = self._activation(intermediate, probs)
        output = torch._grouped_mm(intermediate, fc2.transpose(1, 2), offs=offs)
        if c.add_bias_linear:  # Megatron's expert MLP: output += bias * prob
            output = (
                output + self._per_row([e.linear_fc2.bias for e in experts], offs, hidden.shape[0]) * probs[:, None]
            )
        return output

    def _silu_glu_ok(self) -> bool:
        """Whether the activation is plain SiLU or SwiGLU without expert biases (not gpt-oss's)."""
        return plain_silu_glu(self.config) and not self.config.add_bias_linear

    def _activation(self, intermediate: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Megatron's ``MLP`` activation (gated, clamped, offset) times each row's probability, in torch."""
        c = self.config
        if c.gated_linear_unit:
            gate, linear = torch.chunk(intermediate, 2, dim=-1)
            if (limit := getattr(c, "activation_func_clamp_value", None)) is not None:  # gpt-oss's clamped SwiGLU
                gate, linear = gate.clamp(min=None, max=limit), linear.clamp(min=-limit, max=limit)
            if offset := getattr(c, "glu_linear_offset", 0.0):
                linear = linear + offset
            intermediate = c.activation_func(gate) * linear
        else:
            intermediate = c.activation_func(intermediate)
        return (intermediate * probs.unsqueeze(-1)).to(intermediate.dtype)

    def share_one_storage(self) -> None:
        """Re-home each projection's local expert weights into one ``[E, ...]`` storage (``param.data`` becomes a
        slice of it: names, state dicts and checkpoints unchanged), so that :func:`stacked` is a view, not a copy."""
        for name in ("linear_fc1", "linear_fc2"):
            weights = [getattr(expert, name).weight for expert in self.local_experts]
            if len(weights) > 1 and equal_spacing(weights) is None:
                storage = torch.stack([w.detach() for w in weights])
                for weight, row in zip(weights, storage, strict=True):
                    weight.data = row

    @staticmethod
    def _per_row(biases: list[torch.Tensor], offs: torch.Tensor, rows: int) -> torch.Tensor:
        """``[rows, n]``: each expert's bias for the rows routed to it (rows grouped by expert, ``offs`` each group's
        end; rows past the last group, which the grouped GEMMs leave unwritten, get the last expert's: no host
        sync)."""
        stacked = torch.stack(biases)
        expert = torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)
        return stacked[expert.clamp(max=len(biases) - 1)]
