"""``megatron_opd.moe.routing.fused_topk_routing``, the fused MoE layer's router as one operator forward and one
backward (issue #57), against Megatron-Core's ``topk_routing_with_score_function`` on every top-k router
configuration of the MoE families: the same experts and probabilities, the logits' gradient within 1e-6, and torch's
custom-operator checks (schema, fake tensor, autograd registration)."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.moe.routing import RouterSpec, fused_topk_routing
from megatron_opd.testing.op_count import count_ops
from tests.test_moe_ops import ROUTERS


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("topk", [1, 4])
def test_fused_topk_routing_equals_megatron_s_router(router, topk):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    score, pre, groups, group_topk, scaling, bias = ROUTERS[router]
    group_topk = group_topk if topk % (group_topk or 1) == 0 and topk >= (group_topk or 1) else None
    groups = groups if group_topk else None
    spec = RouterSpec(topk, score, pre, groups, group_topk, scaling)
    gen = torch.Generator().manual_seed(topk)
    logits = torch.randn(48, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    bias_E = torch.randn(16, generator=gen, dtype=torch.float64) * 0.1 if bias else None
    weight = torch.randn(48, 16, generator=gen, dtype=torch.float64)
    probs, routing_map = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre, num_groups=groups, group_topk=group_topk, scaling_factor=scaling,
        score_function=score, expert_bias=bias_E,
    )  # fmt: skip
    (grad,) = torch.autograd.grad((probs * weight).sum(), logits)
    with count_ops() as ops:
        probs_TK, experts_TK = fused_topk_routing(logits, spec, bias_E)
    weight_TK = weight.gather(1, experts_TK)
    with count_ops() as backward_ops:
        (fused_grad,) = torch.autograd.grad(probs_TK, logits, weight_TK)
    assert dict(ops) == {"megatron_opd::moe_topk_routing": 1}
    assert dict(backward_ops) == {"megatron_opd::moe_topk_routing_backward": 1}
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, experts_TK, True), routing_map)
    torch.testing.assert_close(torch.zeros_like(probs).scatter(1, experts_TK, probs_TK), probs, atol=1e-6, rtol=1e-6)
    # Megatron's softmax runs in float32 also for float64 logits (scaled by up to 16): within 1e-6 (issue #57)
    torch.testing.assert_close(fused_grad, grad, atol=1e-6, rtol=1e-6)


def test_routing_operators_pass_torch_s_custom_op_checks():
    for score, pre, groups, group_topk, scaling, bias in ROUTERS.values():
        logits = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
        bias_E = torch.randn(16, dtype=torch.float64) if bias else None
        args = (logits, bias_E, 4, score, pre, groups or 0, group_topk or 0, float(scaling or 0))
        torch.library.opcheck(torch.ops.megatron_opd.moe_topk_routing.default, args)
