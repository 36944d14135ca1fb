"""Top-k routing on ``[tokens, k]`` indices: Megatron-Core's ``topk_routing_with_score_function`` arithmetic without
its dense ``[tokens, experts]`` maps, and with ties broken by the lowest expert id.

Megatron's router scatters each token's k probabilities into a dense ``[tokens, experts]`` map and a boolean routing
map (two zero fills, two scatters and dtype casts) that the dispatcher then reads back with ``masked_select``. The
k indices and probabilities are all a permutation needs. The selection is a stable descending sort, so of equal
scores the lowest expert id wins on every device (``torch.topk`` leaves ties to the kernel: on CPU it returns
``[6, 5, 1]`` for eight equal scores).

Legend: ``T`` tokens, ``E`` experts, ``K`` experts per token, ``G`` expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterSpec:
    """What a ``TopKRouter``'s config asks of its top-k routing (Megatron's field names)."""

    topk: int
    score_function: str = "softmax"  # "softmax" or "sigmoid"
    pre_softmax: bool = False  # softmax over all experts before the top-k (else over the top-k logits)
    num_groups: int | None = None  # group-limited routing: experts in this many groups ...
    group_topk: int | None = None  # ... of which each token may use this many
    scaling_factor: float | None = None  # the chosen probabilities times this

    @classmethod
    def of(cls, config) -> RouterSpec:
        """The spec of a ``TransformerConfig``."""
        return cls(
            topk=config.moe_router_topk,
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
        )


def stable_topk(scores_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` whose ties go to the lowest index (a stable descending sort)."""
    values, indices = torch.sort(scores_TE, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def group_limited_topk(scores_TE: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``group_limited_topk``: the top-k experts within the ``group_topk`` groups whose best
    ``topk / group_topk`` scores sum highest (ties: the lowest group, then the lowest expert)."""
    tokens, experts = scores_TE.shape
    groups = spec.num_groups
    per_group = torch.sort(scores_TE.view(tokens, groups, experts // groups), dim=-1, descending=True).values
    group_scores_TG = per_group[..., : spec.topk // spec.group_topk].sum(dim=-1)
    _, chosen_groups = stable_topk(group_scores_TG, spec.group_topk)
    kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter(1, chosen_groups, True)
    kept_TE = kept_TG.unsqueeze(-1).expand(tokens, groups, experts // groups).reshape(tokens, experts)
    return stable_topk(scores_TE.masked_fill(~kept_TE, float("-inf")), spec.topk)


def select(scores_TE: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values_TK, experts_TK)``: the best ``spec.topk`` scores of each row, group-limited where asked."""
    if spec.group_topk:
        return group_limited_topk(scores_TE, spec)
    return stable_topk(scores_TE, spec.topk)


def topk_routing(
    logits_TE: torch.Tensor, spec: RouterSpec, expert_bias_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs_TK, experts_TK)``: each token's experts and the weights its expert outputs are summed with, as
    Megatron's ``topk_routing_with_score_function`` computes them (in ``logits_TE``'s dtype)."""
    if spec.score_function == "softmax":
        if spec.pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).type_as(logits_TE)
            probs_TK, experts_TK = select(scores_TE, spec)
        else:
            chosen_TK, experts_TK = select(logits_TE, spec)
            probs_TK = torch.softmax(chosen_TK, dim=-1, dtype=torch.float32).type_as(logits_TE)
    elif spec.score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE.float()).type_as(logits_TE)
        if expert_bias_E is not None:
            _, experts_TK = select(scores_TE + expert_bias_E, spec)
            probs_TK = scores_TE.gather(1, experts_TK)
        else:
            probs_TK, experts_TK = select(scores_TE, spec)
        if spec.topk > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {spec.score_function!r}")
    if spec.scaling_factor:
        probs_TK = probs_TK * spec.scaling_factor
    return probs_TK, experts_TK


def topk_routing_backward(
    grad_probs_TK: torch.Tensor, logits_TE: torch.Tensor, experts_TK: torch.Tensor, spec: RouterSpec
) -> torch.Tensor:
    """The logits' gradient of :func:`topk_routing`'s probabilities, the chosen experts held fixed, in closed form
    (float32 or wider, returned in the logits' dtype): the backward of :func:`fused_topk_routing`, and on CUDA its
    kernel's arithmetic (``kernels/moe_router_triton.py``)."""
    x = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    g = grad_probs_TK.to(x.dtype) * (spec.scaling_factor or 1.0)
    if spec.score_function == "sigmoid":
        p = torch.sigmoid(x).gather(1, experts_TK)
        if spec.topk > 1:  # through p / (sum p + 1e-20)
            total = p.sum(dim=-1, keepdim=True) + 1e-20
            g = g / total - (g * p).sum(dim=-1, keepdim=True) / total.square()
        grad_TE = torch.zeros_like(x).scatter(1, experts_TK, g * p * (1 - p))
    elif spec.pre_softmax:
        s = torch.softmax(x, dim=-1)
        ds = torch.zeros_like(x).scatter(1, experts_TK, g)
        grad_TE = s * (ds - (ds * s).sum(dim=-1, keepdim=True))
    else:
        p = torch.softmax(x.gather(1, experts_TK), dim=-1)
        grad_TE = torch.zeros_like(x).scatter(1, experts_TK, p * (g - (g * p).sum(dim=-1, keepdim=True)))
    return grad_TE.to(logits_TE.dtype)


def _spec(topk: int, score_function: str, pre_softmax: bool, num_groups: int, group_topk: int, scaling: float):
    """A ``RouterSpec`` from the custom operators' plain arguments (0: unset)."""
    return RouterSpec(topk, score_function, pre_softmax, num_groups or None, group_topk or None, scaling or None)


@torch.library.custom_op("megatron_opd::moe_topk_routing", mutates_args=())
def _routing_op(
    logits_TE: torch.Tensor, expert_bias_E: torch.Tensor | None, topk: int, score_function: str,
    pre_softmax: bool, num_groups: int, group_topk: int, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    spec = _spec(topk, score_function, pre_softmax, num_groups, group_topk, scaling)
    if logits_TE.is_cuda:
        from megatron_opd.kernels import moe_router_triton

        if moe_router_triton.supports(logits_TE, spec):
            return moe_router_triton.route_forward(logits_TE, spec, expert_bias_E)
    probs_TK, experts_TK = topk_routing(logits_TE, spec, expert_bias_E)
    return probs_TK.contiguous(), experts_TK.contiguous()


@_routing_op.register_fake
def _(logits_TE, expert_bias_E, topk, score_function, pre_softmax, num_groups, group_topk, scaling):
    shape = (logits_TE.shape[0], topk)
    return logits_TE.new_empty(shape), logits_TE.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("megatron_opd::moe_topk_routing_backward", mutates_args=())
def _routing_backward_op(
    grad_probs_TK: torch.Tensor, logits_TE: torch.Tensor, experts_TK: torch.Tensor, topk: int, score_function: str,
    pre_softmax: bool, scaling: float,
) -> torch.Tensor:  # fmt: skip
    spec = _spec(topk, score_function, pre_softmax, 0, 0, scaling)
    if logits_TE.is_cuda:
        from megatron_opd.kernels import moe_router_triton

        if moe_router_triton.supports(logits_TE, spec):
            return moe_router_triton.route_backward(grad_probs_TK, logits_TE, experts_TK, spec)
    return topk_routing_backward(grad_probs_TK, logits_TE, experts_TK, spec)


@_routing_backward_op.register_fake
def _(grad_probs_TK, logits_TE, experts_TK, topk, score_function, pre_softmax, scaling):
    return torch.empty_like(logits_TE)


def _setup_routing_backward(ctx, inputs, output) -> None:
    logits_TE, _, topk, score_function, pre_softmax, _, _, scaling = inputs
    ctx.save_for_backward(logits_TE, output[1])
    ctx.set_materialize_grads(False)  # the experts' (integer) gradient stays None: no zero fill in the backward
    ctx.args = (topk, score_function, pre_softmax, scaling)


def _routing_backward(ctx, grad_probs_TK, _grad_experts):
    logits_TE, experts_TK = ctx.saved_tensors
    if grad_probs_TK is None:
        return (None,) * 8
    grad_TE = _routing_backward_op(grad_probs_TK, logits_TE, experts_TK, *ctx.args)
    return grad_TE, None, None, None, None, None, None, None


_routing_op.register_autograd(_routing_backward, setup_context=_setup_routing_backward)


def fused_topk_routing(
    logits_TE: torch.Tensor, spec: RouterSpec, expert_bias_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_routing` as one operator, forward and backward: on CUDA one Triton kernel each
    (``kernels/moe_router_triton.py``, where it supports the shape), elsewhere :func:`topk_routing` and
    :func:`topk_routing_backward` inside the operator. The expert bias takes no gradient (Megatron's is a buffer)."""
    if spec.score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown router score function {spec.score_function!r}")
    bias = expert_bias_E.detach() if expert_bias_E is not None else None
    return _routing_op(logits_TE, bias, spec.topk, spec.score_function, bool(spec.pre_softmax), spec.num_groups or 0,
                       spec.group_topk or 0, float(spec.scaling_factor or 0.0))  # fmt: skip
