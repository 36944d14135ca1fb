"""Fused Triton MoE router: scores, expert bias, group-limited top-k, renormalisation and scaling in one kernel
(CUDA only; import-guarded like ``divergence_triton``).

Megatron-Core's router, and :func:`megatron_opd.moe.routing.topk_routing` in torch, launch about a dozen kernels
for DeepSeek-V3's routing (sigmoid, bias add, per-group top-2 and sum, group top-k, mask, masked fill, top-k,
gather, sum, divide, scale). Here one program routes one token: the row of ``E`` logits in registers, each top-k an
argmax whose ties go to the lowest expert id (as the torch path's stable sort), groups chosen the same way.
The backward is one kernel too (:func:`route_backward`): a program per token recomputes the scores from the logits
and sends the probabilities' gradient back through the renormalisation and the score function to the chosen
experts' logits. ``megatron_opd.moe.routing.fused_topk_routing`` runs both as one operator each on CUDA.

Legend: ``T`` tokens, ``E`` experts, ``K`` experts per token, ``G`` groups.
"""

from __future__ import annotations

import torch

from .divergence_triton import tl, triton, triton_usable_on  # one import guard for the package

MAX_EXPERTS = 1024  # a token's logits are one block in registers


def supports(logits_TE: torch.Tensor, spec) -> bool:
    """Whether :func:`route` runs the kernel for these logits and this ``RouterSpec``."""
    experts = logits_TE.shape[-1]
    groups = spec.num_groups or 1
    return (
        triton_usable_on(logits_TE.device)
        and logits_TE.dim() == 2
        and logits_TE.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and experts <= MAX_EXPERTS
        and experts % groups == 0
        and spec.score_function in ("softmax", "sigmoid")
    )


if triton is not None:

    @triton.jit
    def _logits_row(logits_ptr, stride_t, E, BLOCK_E: tl.constexpr):
        """This program's token, the expert ids, which of them exist, and the token's logits in float32 (-inf past
        ``E``)."""
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        return t, e, valid, tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)

    @triton.jit
    def _argmax_lowest(values, ids, BLOCK: tl.constexpr):
        """The largest of ``values`` and the lowest id holding it."""
        best = tl.max(values, axis=0)
        return best, tl.min(tl.where(values == best, ids, BLOCK), axis=0)

    @triton.jit
    def _route_kernel(
        logits_ptr, bias_ptr, probs_ptr, experts_ptr, E, stride_t, scale,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
        PRE_SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr, GROUP_TOPK: tl.constexpr,
        PER_GROUP: tl.constexpr,
    ):  # fmt: skip
        t, e, valid, x = _logits_row(logits_ptr, stride_t, E, BLOCK_E)
        if SIGMOID:
            scores = tl.sigmoid(x)
            sel = scores
            if HAS_BIAS:
                sel = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        elif PRE_SOFTMAX:
            z = tl.exp(x - tl.max(x, axis=0))
            scores = z / tl.sum(z, axis=0)
            sel = scores
        else:
            scores = x
            sel = x
        sel = tl.where(valid, sel, float("-inf"))
        if G > 1:  # group score: the sum of its PER_GROUP best; keep the GROUP_TOPK best groups
            group_of = e // (E // G)
            g = tl.arange(0, G)
            group_scores = tl.zeros([G], dtype=tl.float32)
            for gi in tl.static_range(G):
                rest = tl.where(group_of == gi, sel, float("-inf"))
                total = 0.0
                for _ in tl.static_range(PER_GROUP):
                    best, at = _argmax_lowest(rest, e, BLOCK_E)
                    total += best
                    rest = tl.where(e == at, float("-inf"), rest)
                group_scores = tl.where(g == gi, total, group_scores)
            kept = tl.zeros([BLOCK_E], dtype=tl.int1)
            for _ in tl.static_range(GROUP_TOPK):
                best, at = _argmax_lowest(group_scores, g, G)
                kept = kept | (group_of == at)
                group_scores = tl.where(g == at, float("-inf"), group_scores)
            sel = tl.where(kept & valid, sel, float("-inf"))
        k = tl.arange(0, BLOCK_K)
        chosen = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        for ki in tl.static_range(K):
            best, at = _argmax_lowest(sel, e, BLOCK_E)
            value = tl.sum(tl.where(e == at, scores, 0.0), axis=0)
            chosen = tl.where(k == ki, value, chosen)
            ids = tl.where(k == ki, at.to(tl.int64), ids)
            sel = tl.where(e == at, float("-inf"), sel)
        if SIGMOID:
            probs = tl.where(k < K, chosen, 0.0)
            if K > 1:
                probs = probs / (tl.sum(probs, axis=0) + 1e-20)
        elif PRE_SOFTMAX:
            probs = chosen
        else:
            z = tl.exp(chosen - tl.max(chosen, axis=0))
            probs = z / tl.sum(z, axis=0)
        probs = probs * scale
        tl.store(probs_ptr + t * K + k, probs.to(probs_ptr.dtype.element_ty), mask=k < K)
        tl.store(experts_ptr + t * K + k, ids, mask=k < K)

    @triton.jit
    def _route_backward_kernel(
        logits_ptr, experts_ptr, grad_ptr, out_ptr, E, stride_t, scale,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
        PRE_SOFTMAX: tl.constexpr,
    ):  # fmt: skip
        t, e, valid, x = _logits_row(logits_ptr, stride_t, E, BLOCK_E)
        k = tl.arange(0, BLOCK_K)
        chosen_k = k < K
        ids = tl.load(experts_ptr + t * K + k, mask=chosen_k, other=-1)
        g = tl.load(grad_ptr + t * K + k, mask=chosen_k, other=0.0).to(tl.float32) * scale
        onehot = ids[:, None] == e[None, :]  # [BLOCK_K, BLOCK_E]: chosen expert k is expert e
        if SIGMOID:
            s = tl.where(valid, tl.sigmoid(x), 0.0)
            p = tl.sum(tl.where(onehot, s[None, :], 0.0), axis=1)
            if K > 1:  # p / (sum p + 1e-20)
                total = tl.sum(p, axis=0) + 1e-20
                g = g / total - tl.sum(g * p, axis=0) / (total * total)
            d_k = g * p * (1.0 - p)
            d = tl.sum(tl.where(onehot, d_k[:, None], 0.0), axis=0)
        elif PRE_SOFTMAX:  # softmax over every expert, then the chosen ones
            z = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
            s = z / tl.sum(z, axis=0)
            ds = tl.sum(tl.where(onehot, g[:, None], 0.0), axis=0)
            d = s * (ds - tl.sum(ds * s, axis=0))
        else:  # softmax over the chosen logits
            c = tl.sum(tl.where(onehot, x[None, :], 0.0), axis=1)
            c = tl.where(chosen_k, c, float("-inf"))
            z = tl.exp(c - tl.max(c, axis=0))
            p = z / tl.sum(z, axis=0)
            d_k = p * (g - tl.sum(g * p, axis=0))
            d = tl.sum(tl.where(onehot, d_k[:, None], 0.0), axis=0)
        tl.store(out_ptr + t * E + e, d.to(out_ptr.dtype.element_ty), mask=valid)


def _launch_shape(logits_TE: torch.Tensor, spec) -> dict:
    return dict(K=spec.topk, BLOCK_K=triton.next_power_of_2(spec.topk), BLOCK_E=triton.next_power_of_2(logits_TE.shape[1]),
                SIGMOID=spec.score_function == "sigmoid", PRE_SOFTMAX=bool(spec.pre_softmax))  # fmt: skip


def route_forward(logits_TE: torch.Tensor, spec, bias_E: torch.Tensor | None = None):
    """``(probs_TK, experts_TK)`` as :func:`megatron_opd.moe.routing.topk_routing` computes them, in one kernel
    (probabilities in the logits' dtype; check :func:`supports` first)."""
    tokens, experts = logits_TE.shape
    logits_TE = logits_TE.contiguous()
    probs_TK = torch.empty(tokens, spec.topk, dtype=logits_TE.dtype, device=logits_TE.device)
    experts_TK = torch.empty(tokens, spec.topk, dtype=torch.int64, device=logits_TE.device)
    groups = spec.num_groups if spec.group_topk else 1
    _route_kernel[(tokens,)](
        logits_TE, bias_E if bias_E is not None else logits_TE, probs_TK, experts_TK, experts, logits_TE.stride(0),
        float(spec.scaling_factor or 1.0), HAS_BIAS=bias_E is not None, G=groups, GROUP_TOPK=spec.group_topk or 1,
        PER_GROUP=spec.topk // (spec.group_topk or 1), **_launch_shape(logits_TE, spec),
    )  # fmt: skip
    return probs_TK, experts_TK


def route_backward(grad_probs_TK: torch.Tensor, logits_TE: torch.Tensor, experts_TK: torch.Tensor, spec):
    """The logits' gradient of :func:`route_forward`'s probabilities (the chosen experts held), in one kernel: as
    :func:`megatron_opd.moe.routing.topk_routing_backward` computes it."""
    tokens, experts = logits_TE.shape
    logits_TE = logits_TE.contiguous()
    grad_TE = torch.empty_like(logits_TE)
    _route_backward_kernel[(tokens,)](
        logits_TE, experts_TK.contiguous(), grad_probs_TK.contiguous(), grad_TE, experts, logits_TE.stride(0),
        float(spec.scaling_factor or 1.0), **_launch_shape(logits_TE, spec),
    )  # fmt: skip
    return grad_TE
