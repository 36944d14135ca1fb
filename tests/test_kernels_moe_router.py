"""The Triton MoE router's two kernels (``kernels/moe_router_triton.py``) against the torch routing
(``megatron_opd.moe.routing``, itself pinned to Megatron-Core's router in ``tests/test_moe_ops.py`` and
``tests/test_moe_routing_op.py``): the same experts, ties to the lowest expert id, probabilities and the logits'
gradient (torch's autograd of the reference) within 1e-6. On a CPU machine it runs under ``TRITON_INTERPRET=1``
(``tests/test_kernels_interpreted.py``), else it skips."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_opd.kernels import moe_router_triton
from megatron_opd.kernels.divergence_triton import triton_available
from megatron_opd.moe.routing import RouterSpec, topk_routing

if torch.cuda.is_available() and triton_available():
    DEVICE = torch.device("cuda")
elif os.environ.get("TRITON_INTERPRET") == "1" and moe_router_triton.triton is not None:
    DEVICE = torch.device("cpu")
else:
    DEVICE = None
needs_device = pytest.mark.skipif(DEVICE is None, reason="needs triton on CUDA, or TRITON_INTERPRET=1")

SPECS = {
    "softmax over the top-k (Qwen3-MoE, Mixtral)": RouterSpec(topk=4),
    "softmax then group-limited top-k, scaled (DeepSeek-V2)": RouterSpec(4, "softmax", True, 4, 2, 16.0),
    "sigmoid, bias, groups, scaling (DeepSeek-V3)": RouterSpec(4, "sigmoid", False, 4, 2, 2.5),
}  # the interpreter runs a program per token for about a second per case: the torch routing's other cases
# (softmax then plain top-k, top-1) take no branch of the kernel these do not


@needs_device
@pytest.mark.parametrize("name", list(SPECS))
def test_triton_router_equals_torch_routing(name):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, generator=gen)
    logits[0, [1, 5, 6, 9, 10, 12, 13, 15]] = 3.0  # ties
    logits[1] = 0.5
    bias = (torch.randn(16, generator=gen) * 0.1).to(DEVICE) if spec.score_function == "sigmoid" else None
    weight = torch.randn(6, spec.topk, generator=gen).to(DEVICE)
    logits = logits.to(DEVICE).requires_grad_()
    assert moe_router_triton.supports(logits, spec)
    ref_probs, ref_experts = topk_routing(logits, spec, bias)
    (ref_grad,) = torch.autograd.grad((ref_probs * weight).sum(), logits)
    probs, experts = moe_router_triton.route_forward(logits.detach(), spec, bias)
    grad = moe_router_triton.route_backward(weight, logits.detach(), experts, spec)
    assert torch.equal(experts, ref_experts)  # both in descending score order, ties to the lowest id
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.skipif(
    moe_router_triton.triton is None or os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton"
)
def test_router_kernels_compile_for_hopper_without_a_gpu():
    """Ahead-of-time compilation to sm_90 (as ``test_kernels_triton.py``) of both kernels' widest variants, bfloat16
    logits: what the interpreter cannot catch (types of loop-carried values, constexpr branches)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    shape = {"K": 8, "BLOCK_K": 8, "BLOCK_E": 256, "SIGMOID": True, "PRE_SOFTMAX": False}
    jobs = [
        (moe_router_triton._route_kernel, {**shape, "HAS_BIAS": True, "G": 8, "GROUP_TOPK": 4, "PER_GROUP": 2}),
        (moe_router_triton._route_backward_kernel, shape),
        (moe_router_triton._route_backward_kernel, {**shape, "SIGMOID": False, "PRE_SOFTMAX": True}),
        (moe_router_triton._route_backward_kernel, {**shape, "SIGMOID": False}),
    ]
    types = {"bias_ptr": "*fp32", "experts_ptr": "*i64", "E": "i32", "stride_t": "i32", "scale": "fp32"}
    for fn, constexprs in jobs:
        signature = {name: "constexpr" if name in constexprs else types.get(name, "*bf16") for name in fn.arg_names}
        compiled = moe_router_triton.triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
        )
        assert "cubin" in compiled.asm, fn.__name__
