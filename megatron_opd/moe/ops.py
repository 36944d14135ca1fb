"""The fused MoE layer's steps as custom operators: each one launch on CUDA (a Triton kernel,
``kernels/moe_dispatch_triton.py``), torch elsewhere (the reference the kernels are tested against).

Megatron-Core's permutation, activation and combine are a dozen small torch operators per layer and forward, and as
many in the backward; a small MoE layer's GPU time is their launches (issue #57). Each function here is a
``torch.library.custom_op`` whose backward (``register_autograd``) is another one, so a layer's forward and backward
each launch one kernel per step. To an operator counter (``megatron_opd.testing.op_count``) a custom operator is one
operator, as it is one launch on CUDA; its torch implementation here launches several.

- :func:`moe_permute`: each permuted row's token row and probability, and the inverse map slot -> row
  (backward: :func:`moe_token_sum` with the probabilities' gather);
- :func:`moe_silu_glu`: Megatron's SwiGLU (or SiLU) of the fc1 output times each row's probability
  (backward: :func:`moe_silu_glu_backward`);
- :func:`moe_combine`: each token's ``K`` rows summed through the inverse map, deterministic (no zero fill, no
  ``index_add``), plus the shared expert's output, times its gate ``sigmoid(x . w)`` where given (Qwen2-MoE: the
  gate's GEMV in the same kernel) (backward: :func:`moe_token_scatter`, and one GEMM for the gate weight's
  gradient).

Rows at or after ``offsets_L[-1]`` (routed to another expert-parallel rank's experts, unwritten by the grouped
GEMMs) read as zero and get zero gradients.

Legend: ``T`` tokens, ``K`` experts per token, ``R = T * K`` permuted rows, ``H`` hidden, ``F`` expert FFN width,
``W`` fc1 width (``2F`` gated, else ``F``), ``L`` local experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_opd.kernels import moe_dispatch_triton

Tensor = torch.Tensor


def plain_silu_glu(config) -> bool:
    """Whether ``config``'s MLP activation is what :func:`moe_silu_glu` computes: SiLU, or SwiGLU where gated (not
    TransformerEngine's activation, gpt-oss's clamp or linear offset). Biases are the caller's to check."""
    return (
        config.activation_func is F.silu
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0)
    )


def _local_R(rows: int, offsets_L: Tensor) -> Tensor:
    """Which of ``rows`` permuted rows belong to a local expert (before the last one's end)."""
    return torch.arange(rows, device=offsets_L.device) < offsets_L[-1]


def _on_cuda(op, kernel):
    """Registers ``kernel`` (a Triton launch) as ``op``'s CUDA implementation where triton imports."""
    if moe_dispatch_triton.triton is not None:
        op.register_kernel("cuda")(kernel)


# -- permute -----------------------------------------------------------------------------------------------------


@torch.library.custom_op("megatron_opd::moe_permute", mutates_args=())
def moe_permute(
    hidden_TH: Tensor, probs_TK: Tensor, slots_R: Tensor, offsets_L: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows_RH, probs_R, inverse_TK)``: row ``r`` is token ``slots_R[r] // K``'s hidden row and probability
    ``probs_TK.flatten()[slots_R[r]]`` (zero after ``offsets_L[-1]``); ``inverse_TK`` maps each slot to its row."""
    k = probs_TK.shape[1]
    local_R = _local_R(slots_R.shape[0], offsets_L)
    rows_RH = torch.where(local_R[:, None], hidden_TH.index_select(0, torch.div(slots_R, k, rounding_mode="floor")), 0)
    probs_R = torch.where(local_R, probs_TK.reshape(-1).index_select(0, slots_R), 0)
    inverse = torch.empty_like(slots_R).scatter_(0, slots_R, torch.arange(slots_R.shape[0], device=slots_R.device))
    return rows_RH, probs_R, inverse.view(probs_TK.shape)


@moe_permute.register_fake
def _(hidden_TH, probs_TK, slots_R, offsets_L):
    rows = slots_R.shape[0]
    return hidden_TH.new_empty(rows, hidden_TH.shape[1]), probs_TK.new_empty(rows), slots_R.new_empty(probs_TK.shape)


def _permute_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the inverse map
    ctx.save_for_backward(output[2], inputs[3])
    ctx.hidden, ctx.dtype = inputs[0].shape[1], inputs[0].dtype


def _permute_backward(ctx, grad_rows_RH, grad_probs_R, _grad_inverse):
    inverse_TK, offsets_L = ctx.saved_tensors
    if grad_rows_RH is None:  # only the probabilities are used (not in the layer)
        grad_rows_RH = inverse_TK.new_zeros(inverse_TK.numel(), ctx.hidden, dtype=ctx.dtype)
    grad_hidden_TH, grad_probs_TK = moe_token_sum(grad_rows_RH, inverse_TK, offsets_L, None, None, None, grad_probs_R)
    return grad_hidden_TH, grad_probs_TK if grad_probs_R is not None else None, None, None


moe_permute.register_autograd(_permute_backward, setup_context=_permute_setup)
_on_cuda(moe_permute, moe_dispatch_triton.permute)


# -- token sum (the combine's forward, the permutation's backward) ----------------------------------------------------


def _gate_T(gate_x_TH: Tensor, gate_w_H: Tensor) -> Tensor:
    """The shared expert's gate ``sigmoid(x . w)`` per token (Megatron's ``SharedExpertMLP``)."""
    return torch.sigmoid(gate_x_TH @ gate_w_H.reshape(-1))


@torch.library.custom_op("megatron_opd::moe_token_sum", mutates_args=())
def moe_token_sum(
    rows_RH: Tensor,
    inverse_TK: Tensor,
    offsets_L: Tensor,
    shared_TH: Tensor | None,
    gate_x_TH: Tensor | None,
    gate_w_H: Tensor | None,
    row_probs_R: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(out_TH, probs_TK)``: each token's local rows summed in ``k`` order (plus ``shared_TH``, times its gate
    ``sigmoid(gate_x_TH @ gate_w_H)`` where given) and ``row_probs_R`` gathered back to ``[T, K]`` (zero for other
    ranks' rows; an empty tensor without ``row_probs_R``)."""
    tokens, k = inverse_TK.shape
    local_TK = inverse_TK < offsets_L[-1]
    rows_TKH = rows_RH.index_select(0, inverse_TK.reshape(-1)).view(tokens, k, -1)
    out_TH = torch.where(local_TK[..., None], rows_TKH, 0).sum(1)
    if shared_TH is not None:
        gated = gate_w_H is not None
        out_TH = out_TH + (shared_TH * _gate_T(gate_x_TH, gate_w_H)[:, None] if gated else shared_TH)
    if row_probs_R is None:
        return out_TH, rows_RH.new_empty(0)
    return out_TH, torch.where(local_TK, row_probs_R[inverse_TK], 0)


@moe_token_sum.register_fake
def _(rows_RH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H, row_probs_R):
    probs = row_probs_R.new_empty(inverse_TK.shape) if row_probs_R is not None else rows_RH.new_empty(0)
    return rows_RH.new_empty(inverse_TK.shape[0], rows_RH.shape[1]), probs


def _token_sum_cuda(rows_RH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H, row_probs_R):
    out_TH, probs_TK = moe_dispatch_triton.token_sum(
        rows_RH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H, row_probs_R
    )
    return out_TH, probs_TK if probs_TK is not None else rows_RH.new_empty(0)


def _token_sum_setup(ctx, inputs, output):
    _rows, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H, _probs = inputs
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the unused probabilities output
    ctx.has_shared = shared_TH is not None
    ctx.save_for_backward(inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H)


def _token_sum_backward(ctx, grad_TH, grad_probs_TK):
    if grad_probs_TK is not None:
        raise NotImplementedError("moe_token_sum's probabilities are a backward's output: no double backward")
    if grad_TH is None:
        return (None,) * 7
    inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H = ctx.saved_tensors
    grad_rows_RH, grad_shared_TH, grad_x_TH, grad_logit_T = moe_token_scatter(
        grad_TH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H
    )
    if gate_w_H is None:  # out = sum + shared: the shared expert's gradient is the output's
        grad_shared_TH = grad_TH if ctx.has_shared else None
        return grad_rows_RH, None, None, grad_shared_TH, None, None, None
    grad_w_H = (grad_logit_T.unsqueeze(0) @ gate_x_TH).view(gate_w_H.shape)  # the gate weight's: one GEMM
    return grad_rows_RH, None, None, grad_shared_TH, grad_x_TH, grad_w_H, None


moe_token_sum.register_autograd(_token_sum_backward, setup_context=_token_sum_setup)
_on_cuda(moe_token_sum, _token_sum_cuda)


def moe_combine(
    rows_RH: Tensor,
    inverse_TK: Tensor,
    offsets_L: Tensor,
    shared_TH: Tensor | None = None,
    gate_x_TH: Tensor | None = None,
    gate_w_H: Tensor | None = None,
) -> Tensor:
    """``[T, H]``: each token's expert rows summed (Megatron's ``unpermute``), plus the shared expert's output
    (times its gate ``sigmoid(gate_x_TH @ gate_w_H)``, Qwen2-MoE's, where given)."""
    return moe_token_sum(rows_RH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H, None)[0]


# -- token scatter (the combine's backward) --------------------------------------------------------------------------


@torch.library.custom_op("megatron_opd::moe_token_scatter", mutates_args=())
def moe_token_scatter(
    grad_TH: Tensor,
    inverse_TK: Tensor,
    offsets_L: Tensor,
    shared_TH: Tensor | None,
    gate_x_TH: Tensor | None,
    gate_w_H: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_rows_RH, grad_shared_TH, grad_gate_x_TH, grad_logit_T)`` of :func:`moe_token_sum`'s ``out_TH``:
    each token's gradient to its local rows (zero to other ranks' rows); with a gate, the shared expert's, the gate
    input's and the gate logit's gradients (else empty tensors)."""
    tokens, k = inverse_TK.shape
    local_RK = (inverse_TK < offsets_L[-1]).reshape(-1, 1)
    values_RH = torch.where(local_RK, grad_TH.repeat_interleave(k, 0), 0)
    grad_rows_RH = torch.empty_like(values_RH).index_copy_(0, inverse_TK.reshape(-1), values_RH)
    if gate_w_H is None:
        return grad_rows_RH, grad_TH.new_empty(0), grad_TH.new_empty(0), grad_TH.new_empty(0)
    gate_T = _gate_T(gate_x_TH, gate_w_H)
    grad_logit_T = (grad_TH * shared_TH).sum(-1) * gate_T * (1 - gate_T)
    grad_x_TH = grad_logit_T[:, None] * gate_w_H.reshape(1, -1)
    return grad_rows_RH, grad_TH * gate_T[:, None], grad_x_TH, grad_logit_T


@moe_token_scatter.register_fake
def _(grad_TH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H):
    rows = grad_TH.new_empty(inverse_TK.numel(), grad_TH.shape[1])
    if gate_w_H is None:
        return rows, grad_TH.new_empty(0), grad_TH.new_empty(0), grad_TH.new_empty(0)
    return rows, torch.empty_like(shared_TH), torch.empty_like(gate_x_TH), gate_x_TH.new_empty(gate_x_TH.shape[0])


def _token_scatter_cuda(grad_TH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H):
    grads = moe_dispatch_triton.token_scatter(grad_TH, inverse_TK, offsets_L, shared_TH, gate_x_TH, gate_w_H)
    if gate_w_H is None:
        return grads[0], grad_TH.new_empty(0), grad_TH.new_empty(0), grad_TH.new_empty(0)
    return grads


_on_cuda(moe_token_scatter, _token_scatter_cuda)


# -- SiLU / SwiGLU times the routing probability ---------------------------------------------------------------------


@torch.library.custom_op("megatron_opd::moe_silu_glu", mutates_args=())
def moe_silu_glu(fc1_RW: Tensor, probs_R: Tensor | None, offsets_L: Tensor | None, gated: bool) -> Tensor:
    """``silu(gate) * linear`` of ``fc1_RW = [gate | linear]`` (``gated``; else ``silu(fc1_RW)``), times each row's
    probability where given (Megatron's ``MLP`` with ``activation_func=F.silu``), zero after ``offsets_L[-1]``."""
    if gated:
        gate, linear = torch.chunk(fc1_RW, 2, dim=-1)
        out_RF = F.silu(gate) * linear
    else:
        out_RF = F.silu(fc1_RW)
    if probs_R is not None:
        out_RF = (out_RF * probs_R.unsqueeze(-1)).to(out_RF.dtype)
    if offsets_L is not None:
        out_RF = torch.where(_local_R(out_RF.shape[0], offsets_L)[:, None], out_RF, 0)
    return out_RF


@moe_silu_glu.register_fake
def _(fc1_RW, probs_R, offsets_L, gated):
    return fc1_RW.new_empty(fc1_RW.shape[0], fc1_RW.shape[1] // 2 if gated else fc1_RW.shape[1])


def _silu_glu_setup(ctx, inputs, output):
    fc1_RW, probs_R, offsets_L, ctx.gated = inputs
    ctx.save_for_backward(fc1_RW, probs_R, offsets_L)


def _silu_glu_grad(ctx, grad_RF):
    fc1_RW, probs_R, offsets_L = ctx.saved_tensors
    grad_fc1_RW, grad_probs_R = moe_silu_glu_backward(grad_RF, fc1_RW, probs_R, offsets_L, ctx.gated)
    return grad_fc1_RW, grad_probs_R if probs_R is not None else None, None, None


moe_silu_glu.register_autograd(_silu_glu_grad, setup_context=_silu_glu_setup)
_on_cuda(moe_silu_glu, moe_dispatch_triton.silu_glu)


@torch.library.custom_op("megatron_opd::moe_silu_glu_backward", mutates_args=())
def moe_silu_glu_backward(
    grad_RF: Tensor, fc1_RW: Tensor, probs_R: Tensor | None, offsets_L: Tensor | None, gated: bool
) -> tuple[Tensor, Tensor]:
    """``(grad_fc1_RW, grad_probs_R)`` of :func:`moe_silu_glu` (an empty tensor without probabilities), by the
    operators autograd runs for Megatron's ``MLP`` (the same bits on CPU)."""
    gate, linear = torch.chunk(fc1_RW, 2, dim=-1) if gated else (fc1_RW, None)
    act = F.silu(gate)
    value_RF = act * linear if gated else act
    grad_value_RF, grad_probs_R = grad_RF, fc1_RW.new_empty(0)
    if probs_R is not None:  # the product ran in the promoted dtype, then was cast back
        grad_RF = grad_RF.to(torch.promote_types(value_RF.dtype, probs_R.dtype))
        grad_probs_R = (grad_RF * value_RF).sum(-1).to(probs_R.dtype)
        grad_value_RF = (grad_RF * probs_R.unsqueeze(-1)).to(value_RF.dtype)
    if gated:
        grad_gate = torch.ops.aten.silu_backward(grad_value_RF * linear, gate)
        grad_fc1_RW = torch.cat([grad_gate, grad_value_RF * act], dim=-1)
    else:
        grad_fc1_RW = torch.ops.aten.silu_backward(grad_value_RF, gate)
    grad_fc1_RW = grad_fc1_RW.to(fc1_RW.dtype)
    if offsets_L is not None:
        local_R = _local_R(fc1_RW.shape[0], offsets_L)
        grad_fc1_RW = torch.where(local_R[:, None], grad_fc1_RW, 0)
        grad_probs_R = torch.where(local_R, grad_probs_R, 0) if probs_R is not None else grad_probs_R
    return grad_fc1_RW, grad_probs_R


@moe_silu_glu_backward.register_fake
def _(grad_RF, fc1_RW, probs_R, offsets_L, gated):
    return torch.empty_like(fc1_RW), torch.empty_like(probs_R) if probs_R is not None else fc1_RW.new_empty(0)


def _silu_glu_backward_cuda(grad_RF, fc1_RW, probs_R, offsets_L, gated):
    grad_fc1_RW, grad_probs_R = moe_dispatch_triton.silu_glu_backward(grad_RF, fc1_RW, probs_R, offsets_L, gated)
    return grad_fc1_RW, grad_probs_R if grad_probs_R is not None else fc1_RW.new_empty(0)


_on_cuda(moe_silu_glu_backward, _silu_glu_backward_cuda)


def reference(op):
    """``op``'s torch implementation (what runs off CUDA), to test its kernel against."""
    return op._init_fn
