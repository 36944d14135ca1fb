"""The fused MoE layer's Triton kernels (``kernels/moe_dispatch_triton.py``) against the custom operators' torch
implementations (``megatron_opd.moe.ops``, themselves pinned to Megatron-Core's layer in ``tests/test_moe_ops.py``),
forward and backward, for the second of two expert-parallel ranks (rows of other ranks' experts, filled with NaN as
the grouped GEMMs leave them unwritten) with an empty local expert. On a CPU machine it runs under
``TRITON_INTERPRET=1`` (``tests/test_kernels_interpreted.py``), else it skips. Tiny shapes: the interpreter runs a
program per row."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_opd.kernels import moe_dispatch_triton as kernels
from tests.conftest import triton_kernel_device

DEVICE = triton_kernel_device(kernels)
needs_device = pytest.mark.skipif(DEVICE is None, reason="needs triton on CUDA, or TRITON_INTERPRET=1")

TOKENS, K, HIDDEN, FFN = 5, 2, 8, 6


def _routing(gen):
    """``(probs_TK, slots_R, offsets_L)``: rank 1 of 2 (local experts 2 and 3 of 4), expert 3 chosen by no token."""
    from megatron_opd.moe.permutation import permutation

    experts_TK = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1], [1, 0]])
    perm = permutation(experts_TK, 2, 2, 4)
    assert perm.offsets_L.tolist() == [3, 3]  # three local rows, an empty second expert
    probs_TK = torch.rand(TOKENS, K, generator=gen)
    return probs_TK.to(DEVICE), perm.slots_R.to(DEVICE), perm.offsets_L.to(DEVICE)


def _unwritten(rows: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """``rows`` with the rows after the last local expert's end set to NaN (what the grouped GEMMs leave)."""
    return torch.where((torch.arange(rows.shape[0], device=rows.device) < offsets_L[-1])[:, None], rows, float("nan"))


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


@needs_device
def test_permute_and_its_backward():
    from megatron_opd.moe import ops

    gen = torch.Generator().manual_seed(0)
    probs_TK, slots_R, offsets_L = _routing(gen)
    hidden_TH = torch.randn(TOKENS, HIDDEN, generator=gen).to(DEVICE)
    expected = ops.reference(ops.moe_permute)(hidden_TH, probs_TK, slots_R, offsets_L)  # the torch implementation
    rows_RH, probs_R, inverse_TK = kernels.permute(hidden_TH, probs_TK, slots_R, offsets_L)
    assert torch.equal(inverse_TK, expected[2])
    _close(rows_RH, expected[0])
    _close(probs_R, expected[1])
    grad_RH = _unwritten(torch.randn(TOKENS * K, HIDDEN, generator=gen).to(DEVICE), offsets_L)
    grad_R = _unwritten(torch.randn(TOKENS * K, 1, generator=gen).to(DEVICE), offsets_L)[:, 0]
    expected = ops.reference(ops.moe_token_sum)(grad_RH, inverse_TK, offsets_L, None, None, None, grad_R)
    grad_TH, grad_TK = kernels.token_sum(grad_RH, inverse_TK, offsets_L, None, None, None, grad_R)
    _close(grad_TH, expected[0])
    _close(grad_TK, expected[1])


@needs_device
@pytest.mark.parametrize("gated", [False, True], ids=["shared", "gated shared"])
def test_combine_and_its_backward(gated):
    from megatron_opd.moe import ops

    gen = torch.Generator().manual_seed(1)
    probs_TK, slots_R, offsets_L = _routing(gen)
    inverse_TK = kernels.permute(torch.zeros(TOKENS, 1, device=DEVICE), probs_TK, slots_R, offsets_L)[2]
    rows_RH = _unwritten(torch.randn(TOKENS * K, HIDDEN, generator=gen).to(DEVICE), offsets_L)
    shared_TH = torch.randn(TOKENS, HIDDEN, generator=gen).to(DEVICE)
    gate = (torch.randn(TOKENS, HIDDEN, generator=gen).to(DEVICE), torch.randn(1, HIDDEN, generator=gen).to(DEVICE))
    gate = gate if gated else (None, None)  # the gate's input (the layer's hidden states) and weight
    expected = ops.reference(ops.moe_token_sum)(rows_RH, inverse_TK, offsets_L, shared_TH, *gate, None)[0]
    _close(kernels.token_sum(rows_RH, inverse_TK, offsets_L, shared_TH, *gate)[0], expected)
    grad_TH = torch.randn(TOKENS, HIDDEN, generator=gen).to(DEVICE)
    expected = ops.reference(ops.moe_token_scatter)(grad_TH, inverse_TK, offsets_L, shared_TH, *gate)
    found = kernels.token_scatter(grad_TH, inverse_TK, offsets_L, shared_TH, *gate)
    for i in range(4 if gated else 1):
        _close(found[i], expected[i])


@needs_device
@pytest.mark.parametrize("gated", [False, True], ids=["silu", "swiglu"])
def test_silu_glu_and_its_backward(gated):
    from megatron_opd.moe import ops

    gen = torch.Generator().manual_seed(2)
    probs_TK, slots_R, offsets_L = _routing(gen)
    rows = TOKENS * K
    fc1_RW = _unwritten(torch.randn(rows, FFN * (2 if gated else 1), generator=gen).to(DEVICE) * 3, offsets_L)
    probs_R = torch.rand(rows, generator=gen).to(DEVICE)
    grad_RF = torch.randn(rows, FFN, generator=gen).to(DEVICE)
    for probs, offsets in ((probs_R, offsets_L), (None, None)):  # a routed expert's rows; a shared expert's
        fc1 = fc1_RW if offsets is not None else torch.nan_to_num(fc1_RW)
        _close(
            kernels.silu_glu(fc1, probs, offsets, gated), ops.reference(ops.moe_silu_glu)(fc1, probs, offsets, gated)
        )
        expected = ops.reference(ops.moe_silu_glu_backward)(grad_RF, fc1, probs, offsets, gated)
        found = kernels.silu_glu_backward(grad_RF, fc1, probs, offsets, gated)
        _close(found[0], expected[0])
        if probs is not None:
            _close(found[1], expected[1])


@pytest.mark.skipif(kernels.triton is None or os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton")
def test_every_kernel_compiles_for_hopper_without_a_gpu():
    """Ahead-of-time compilation to sm_90 (as ``test_kernels_triton.py``): what the interpreter cannot catch (types
    of loop-carried values, constexpr branches), in bfloat16, each kernel's widest variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dt, ids, ints = "*bf16", "*i64", {"H": "i32", "L": "i32", "F": "i32"}
    jobs = [
        (kernels._permute_kernel, {"probs_ptr": "*fp32", "probs_out_ptr": "*fp32", "offsets_ptr": "*i32"}, {"K": 8}),
        (kernels._token_sum_kernel, {"row_probs_ptr": "*fp32", "token_probs_ptr": "*fp32", "offsets_ptr": "*i32"},
         {"K": 8, "BLOCK_K": 8, "HAS_SHARED": True, "HAS_GATE": True, "HAS_PROBS": True}),
        (kernels._token_scatter_kernel, {"grad_logit_ptr": "*fp32", "offsets_ptr": "*i32"}, {"K": 8, "HAS_GATE": True}),
        (kernels._silu_glu_kernel, {"probs_ptr": "*fp32", "offsets_ptr": "*i32"},
         {"GATED": True, "HAS_PROBS": True, "MASKED": True}),
        (kernels._silu_glu_backward_kernel, {"probs_ptr": "*fp32", "grad_probs_ptr": "*fp32", "offsets_ptr": "*i32"},
         {"GATED": True, "HAS_PROBS": True, "MASKED": True}),
    ]  # fmt: skip
    for fn, types, constexprs in jobs:
        constexprs = {**constexprs, "BLOCK_H" if "BLOCK_H" in fn.arg_names else "BLOCK_F": 1024}
        known = {**ints, **types}
        signature = {
            name: "constexpr"
            if name in constexprs
            else known.get(name, ids if "inverse" in name or "slots" in name else dt)
            for name in fn.arg_names
        }
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
        )
        assert "cubin" in compiled.asm, fn.__name__
