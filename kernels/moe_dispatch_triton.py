"""Triton kernels of the fused MoE layer's token movement and expert activation, one launch each (CUDA only;
import-guarded like ``divergence_triton``).

Each function here is the CUDA implementation of one custom operator of :mod:`megatron_opd.moe.ops`, whose torch
implementation is the reference (``tests/test_kernels_moe_dispatch.py`` compares them under the interpreter):

- :func:`permute`: each permuted row's token row and routing probability, and the inverse map slot -> row;
- :func:`token_sum`: each token's ``K`` expert rows summed through the inverse map (the combine, plus the shared
  expert's output, optionally times its gate ``sigmoid(x . w)``, the GEMV in the kernel), or the permutation's
  backward (plus the gather of the probabilities' gradient);
- :func:`token_scatter`: the combine's backward (each token's gradient to its ``K`` rows, the shared expert's
  and its gate's gradients: of the gate input ``x`` and of the logit, from which the gate weight's is one GEMM);
- :func:`silu_glu` / :func:`silu_glu_backward`: ``silu(gate) * linear * prob`` per row (or ``silu(x) * prob``)
  and its gradients of the fc1 output and of the probability.

Rows at or after the last local expert's end (``offsets_L[-1]``: rows routed to other expert-parallel ranks, which
the grouped GEMMs leave unwritten) read as zero and get zero gradients. Sums accumulate in float32.

Legend: ``T`` tokens, ``K`` experts per token, ``R = T * K`` permuted rows, ``H`` hidden, ``F`` expert FFN width,
``L`` local experts.
"""

from __future__ import annotations

import torch

from .divergence_triton import tl, triton

_BLOCK_H = 1024  # columns per step of a row loop

if triton is not None:

    @triton.jit
    def _permute_kernel(
        hidden_ptr, probs_ptr, slots_ptr, offsets_ptr, rows_ptr, probs_out_ptr, inverse_ptr, H, L,
        K: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        local = r < tl.load(offsets_ptr + L - 1)
        slot = tl.load(slots_ptr + r)
        token = slot // K
        tl.store(inverse_ptr + slot, r)
        prob = tl.load(probs_ptr + slot)
        tl.store(probs_out_ptr + r, tl.where(local, prob, 0.0))
        width = tl.where(local, H, 0)  # columns read: none for another rank's row
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(hidden_ptr + token * H + h, mask=h < width, other=0.0)
            tl.store(rows_ptr + r * H + h, x, mask=h < H)

    @triton.jit
    def _gate(x_ptr, w_ptr, t, H, BLOCK_H: tl.constexpr):
        """``sigmoid(x[t] . w)`` in float32: the shared expert's gate of token ``t``."""
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(x_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32)
            dot += x * tl.load(w_ptr + h, mask=h < H, other=0.0).to(tl.float32)
        return tl.sigmoid(tl.sum(dot, axis=0))

    @triton.jit
    def _token_sum_kernel(
        rows_ptr, inverse_ptr, offsets_ptr, out_ptr, shared_ptr, x_ptr, w_ptr, row_probs_ptr, token_probs_ptr, H, L,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr,
        HAS_GATE: tl.constexpr, HAS_PROBS: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        n_local = tl.load(offsets_ptr + L - 1)
        if HAS_PROBS:  # the probabilities' gradient back to [T, K]
            k = tl.arange(0, BLOCK_K)
            inv = tl.load(inverse_ptr + t * K + k, mask=k < K, other=0)
            grad = tl.load(row_probs_ptr + inv, mask=(k < K) & (inv < n_local), other=0.0)
            tl.store(token_probs_ptr + t * K + k, grad, mask=k < K)
        if HAS_GATE:
            gate = _gate(x_ptr, w_ptr, t, H, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for ki in tl.static_range(K):
                r = tl.load(inverse_ptr + t * K + ki)
                width = tl.where(r < n_local, H, 0)
                acc += tl.load(rows_ptr + r * H + h, mask=h < width, other=0.0).to(tl.float32)
            if HAS_SHARED:
                shared = tl.load(shared_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32)
                if HAS_GATE:
                    shared = shared * gate
                acc += shared
            tl.store(out_ptr + t * H + h, acc, mask=h < H)

    @triton.jit
    def _token_scatter_kernel(
        grad_ptr, inverse_ptr, offsets_ptr, grad_rows_ptr, shared_ptr, x_ptr, w_ptr, grad_shared_ptr, grad_x_ptr,
        grad_logit_ptr, H, L, K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_GATE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        n_local = tl.load(offsets_ptr + L - 1)
        if HAS_GATE:
            gate = _gate(x_ptr, w_ptr, t, H, BLOCK_H)
            dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            grad = tl.load(grad_ptr + t * H + h, mask=h < H, other=0.0)
            for ki in tl.static_range(K):
                r = tl.load(inverse_ptr + t * K + ki)
                tl.store(grad_rows_ptr + r * H + h, tl.where(r < n_local, grad, 0.0), mask=h < H)
            if HAS_GATE:
                shared = tl.load(shared_ptr + t * H + h, mask=h < H, other=0.0).to(tl.float32)
                tl.store(grad_shared_ptr + t * H + h, grad.to(tl.float32) * gate, mask=h < H)
                dot += grad.to(tl.float32) * shared
        if HAS_GATE:  # the gate logit's gradient, and the gate input's: logit gradient times the gate weight
            grad_logit = tl.sum(dot, axis=0) * gate * (1.0 - gate)
            tl.store(grad_logit_ptr + t, grad_logit)
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                w = tl.load(w_ptr + h, mask=h < H, other=0.0).to(tl.float32)
                tl.store(grad_x_ptr + t * H + h, grad_logit * w, mask=h < H)

    @triton.jit
    def _row_keep_and_prob(r, probs_ptr, offsets_ptr, L, HAS_PROBS: tl.constexpr, MASKED: tl.constexpr):
        """Whether row ``r`` is a local expert's, and its probability (1 without probabilities)."""
        keep = True
        if MASKED:
            keep = r < tl.load(offsets_ptr + L - 1)
        prob = 1.0
        if HAS_PROBS:
            prob = tl.load(probs_ptr + r).to(tl.float32)
        return keep, prob

    @triton.jit
    def _silu_glu_kernel(
        fc1_ptr, probs_ptr, offsets_ptr, out_ptr, F, L,
        GATED: tl.constexpr, HAS_PROBS: tl.constexpr, MASKED: tl.constexpr, BLOCK_F: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        width = 2 * F if GATED else F
        keep, prob = _row_keep_and_prob(r, probs_ptr, offsets_ptr, L, HAS_PROBS, MASKED)
        for f0 in range(0, F, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            gate = tl.load(fc1_ptr + r * width + f, mask=f < F, other=0.0).to(tl.float32)
            y = gate * tl.sigmoid(gate)
            if GATED:
                y = y * tl.load(fc1_ptr + r * width + F + f, mask=f < F, other=0.0).to(tl.float32)
            tl.store(out_ptr + r * F + f, tl.where(keep, y * prob, 0.0), mask=f < F)

    @triton.jit
    def _silu_glu_backward_kernel(
        grad_ptr, fc1_ptr, probs_ptr, offsets_ptr, grad_fc1_ptr, grad_probs_ptr, F, L,
        GATED: tl.constexpr, HAS_PROBS: tl.constexpr, MASKED: tl.constexpr, BLOCK_F: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        width = 2 * F if GATED else F
        keep, prob = _row_keep_and_prob(r, probs_ptr, offsets_ptr, L, HAS_PROBS, MASKED)
        dot = tl.zeros([BLOCK_F], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            grad = tl.load(grad_ptr + r * F + f, mask=f < F, other=0.0).to(tl.float32)
            gate = tl.load(fc1_ptr + r * width + f, mask=f < F, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            act = gate * sig
            d_act = sig * (1.0 + gate * (1.0 - sig))
            if GATED:
                linear = tl.load(fc1_ptr + r * width + F + f, mask=f < F, other=0.0).to(tl.float32)
                dot += grad * act * linear
                tl.store(grad_fc1_ptr + r * width + F + f, tl.where(keep, grad * prob * act, 0.0), mask=f < F)
                d_gate = grad * prob * linear * d_act
            else:
                dot += grad * act
                d_gate = grad * prob * d_act
            tl.store(grad_fc1_ptr + r * width + f, tl.where(keep, d_gate, 0.0), mask=f < F)
        if HAS_PROBS:
            tl.store(grad_probs_ptr + r, tl.where(keep, tl.sum(dot, axis=0), 0.0))


def _block(n: int) -> int:
    return min(_BLOCK_H, triton.next_power_of_2(max(n, 1)))


def permute(hidden_TH, probs_TK, slots_R, offsets_L):
    """``(rows_RH, probs_R, inverse_TK)`` (:func:`megatron_opd.moe.ops.moe_permute`)."""
    hidden_TH, probs_TK = hidden_TH.contiguous(), probs_TK.contiguous()
    (tokens, k), rows = probs_TK.shape, slots_R.shape[0]
    rows_RH = hidden_TH.new_empty(rows, hidden_TH.shape[1])
    probs_R = probs_TK.new_empty(rows)
    inverse_TK = slots_R.new_empty(tokens, k)
    if rows:
        _permute_kernel[(rows,)](
            hidden_TH, probs_TK, slots_R, offsets_L, rows_RH, probs_R, inverse_TK, hidden_TH.shape[1],
            offsets_L.shape[0], K=k, BLOCK_H=_block(hidden_TH.shape[1]),
        )  # fmt: skip
    return rows_RH, probs_R, inverse_TK


def token_sum(rows_RH, inverse_TK, offsets_L, shared_TH=None, gate_x_TH=None, gate_w_H=None, row_probs_R=None):
    """``(out_TH, token_probs_TK)``: each token's local rows summed (plus ``shared_TH``, times
    ``sigmoid(gate_x_TH @ gate_w_H)`` where given) and, where ``row_probs_R`` is given, its rows' values gathered
    back to ``[T, K]``."""
    rows_RH = rows_RH.contiguous()
    (tokens, k), width = inverse_TK.shape, rows_RH.shape[1]
    out_TH = rows_RH.new_empty(tokens, width)
    token_probs_TK = row_probs_R.new_empty(tokens, k) if row_probs_R is not None else None
    gated = gate_w_H is not None
    if tokens:
        _token_sum_kernel[(tokens,)](
            rows_RH, inverse_TK, offsets_L, out_TH, shared_TH.contiguous() if shared_TH is not None else rows_RH,
            gate_x_TH.contiguous() if gated else rows_RH, gate_w_H.contiguous() if gated else rows_RH,
            row_probs_R.contiguous() if row_probs_R is not None else rows_RH,
            token_probs_TK if token_probs_TK is not None else out_TH, width, offsets_L.shape[0], K=k,
            BLOCK_K=triton.next_power_of_2(k), BLOCK_H=_block(width), HAS_SHARED=shared_TH is not None,
            HAS_GATE=gated, HAS_PROBS=row_probs_R is not None,
        )  # fmt: skip
    return out_TH, token_probs_TK


def token_scatter(grad_TH, inverse_TK, offsets_L, shared_TH=None, gate_x_TH=None, gate_w_H=None):
    """``(grad_rows_RH, grad_shared_TH, grad_gate_x_TH, grad_logit_T)``: the combine's backward; the last three
    only with a gate (else None)."""
    grad_TH = grad_TH.contiguous()
    (tokens, k), width = inverse_TK.shape, grad_TH.shape[1]
    grad_rows_RH = grad_TH.new_empty(tokens * k, width)
    gated = gate_w_H is not None
    grad_shared_TH = shared_TH.new_empty(tokens, width) if gated else None
    grad_x_TH = gate_x_TH.new_empty(tokens, width) if gated else None
    grad_logit_T = gate_x_TH.new_empty(tokens) if gated else None
    if tokens:
        _token_scatter_kernel[(tokens,)](
            grad_TH, inverse_TK, offsets_L, grad_rows_RH, shared_TH.contiguous() if gated else grad_TH,
            gate_x_TH.contiguous() if gated else grad_TH, gate_w_H.contiguous() if gated else grad_TH,
            grad_shared_TH if gated else grad_TH, grad_x_TH if gated else grad_TH,
            grad_logit_T if gated else grad_TH, width, offsets_L.shape[0], K=k, BLOCK_H=_block(width), HAS_GATE=gated,
        )  # fmt: skip
    return grad_rows_RH, grad_shared_TH, grad_x_TH, grad_logit_T


def silu_glu(fc1_RW, probs_R, offsets_L, gated: bool):
    """``silu(gate) * linear * prob`` per row (``gated``: ``fc1_RW = [gate | linear]``), else ``silu(x) * prob``."""
    fc1_RW = fc1_RW.contiguous()
    rows, width = fc1_RW.shape
    ffn = width // 2 if gated else width
    out_RF = fc1_RW.new_empty(rows, ffn)
    if rows:
        _silu_glu_kernel[(rows,)](
            fc1_RW, probs_R if probs_R is not None else fc1_RW, offsets_L if offsets_L is not None else fc1_RW,
            out_RF, ffn, offsets_L.shape[0] if offsets_L is not None else 1, GATED=gated,
            HAS_PROBS=probs_R is not None, MASKED=offsets_L is not None, BLOCK_F=_block(ffn),
        )  # fmt: skip
    return out_RF


def silu_glu_backward(grad_RF, fc1_RW, probs_R, offsets_L, gated: bool):
    """``(grad_fc1_RW, grad_probs_R)`` of :func:`silu_glu` (the second None without probabilities)."""
    grad_RF, fc1_RW = grad_RF.contiguous(), fc1_RW.contiguous()
    rows, ffn = grad_RF.shape
    grad_fc1_RW = torch.empty_like(fc1_RW)
    grad_probs_R = torch.empty_like(probs_R) if probs_R is not None else None
    if rows:
        _silu_glu_backward_kernel[(rows,)](
            grad_RF, fc1_RW, probs_R if probs_R is not None else fc1_RW,
            offsets_L if offsets_L is not None else fc1_RW, grad_fc1_RW,
            grad_probs_R if grad_probs_R is not None else fc1_RW, ffn,
            offsets_L.shape[0] if offsets_L is not None else 1, GATED=gated, HAS_PROBS=probs_R is not None,
            MASKED=offsets_L is not None, BLOCK_F=_block(ffn),
        )  # fmt: skip
    return grad_fc1_RW, grad_probs_R
