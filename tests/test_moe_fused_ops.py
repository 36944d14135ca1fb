"""The fused MoE layer's custom operators (``megatron_opd.moe.ops``) pass ``torch.library.opcheck`` (schema,
fake-tensor shapes, autograd registration) on their torch implementation, their gradients equal finite differences
in float64 (``gradcheck``), and the experts' weight stacks (``models.grouped_experts.stacked``) are views of one
storage after ``GroupedExperts.share_one_storage`` — equal to ``torch.stack``, gradients to every expert's weight,
through ``load_state_dict`` and a checkpoint round trip — and a ``torch.stack`` once the weights are moved apart."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.moe import ops
from megatron_opd.moe.permutation import permutation
from megatron_opd.testing.op_count import count_ops

TOKENS, K, HIDDEN, FFN = 4, 2, 3, 2
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")  # not aot_dispatch: seconds per op


def _inputs(dtype=torch.float64):
    """Rank 1 of 2 (local experts 2, 3 of 4; expert 3 chosen by no token): routing, permutation, inverse map."""
    gen = torch.Generator().manual_seed(0)
    perm = permutation(torch.tensor([[2, 0], [1, 2], [0, 1], [2, 3]]), 2, 2, 4)
    probs_TK = torch.rand(TOKENS, K, generator=gen, dtype=dtype, requires_grad=True)
    hidden_TH = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=dtype, requires_grad=True)
    inverse_TK = ops.moe_permute(hidden_TH.detach(), probs_TK.detach(), perm.slots_R, perm.offsets_L)[2]
    return gen, perm, probs_TK, hidden_TH, inverse_TK


def test_custom_ops_pass_opcheck_and_gradcheck():
    gen, perm, probs_TK, hidden_TH, inverse_TK = _inputs()
    rows = TOKENS * K
    rows_RH = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    shared_TH = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    gate_w_H = torch.randn(1, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    fc1_RW = torch.randn(rows, 2 * FFN, generator=gen, dtype=torch.float64, requires_grad=True)
    probs_R = torch.rand(rows, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = perm.offsets_L
    cases = [
        (ops.moe_permute, (hidden_TH, probs_TK, perm.slots_R, offsets)),
        (ops.moe_token_sum, (rows_RH, inverse_TK, offsets, shared_TH, hidden_TH, gate_w_H, None)),
        (ops.moe_token_sum, (rows_RH, inverse_TK, offsets, None, None, None, probs_R)),
        (ops.moe_silu_glu, (fc1_RW, probs_R, offsets, True)),
        (ops.moe_silu_glu, (fc1_RW[:, :FFN].detach().requires_grad_(), None, None, False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=OPCHECKS)
        differentiable = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

        def first_output(*values, op=op, args=args):
            it = iter(values)
            full = [next(it) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
            out = op(*full)
            return out[:2] if op is ops.moe_permute else out[0] if isinstance(out, tuple) else out  # not the inverse
            # map; moe_token_sum's probabilities are the permutation's backward (no double backward)

        assert torch.autograd.gradcheck(first_output, differentiable), op
    grad_TH = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    args = (grad_TH, inverse_TK, offsets, shared_TH.detach(), hidden_TH.detach(), gate_w_H.detach())
    torch.library.opcheck(ops.moe_token_scatter, args, test_utils=OPCHECKS)
    args = (
        torch.randn(rows, FFN, generator=gen, dtype=torch.float64),
        fc1_RW.detach(),
        probs_R.detach(),
        offsets,
        True,
    )
    torch.library.opcheck(ops.moe_silu_glu_backward, args, test_utils=OPCHECKS)


def test_other_ranks_rows_get_no_gradient_and_their_values_are_not_read():
    """Rows after the last local expert's end (unwritten by the grouped GEMMs: here NaN) change no output and
    receive zero gradients; every token's local rows are summed."""
    _, perm, probs_TK, hidden_TH, inverse_TK = _inputs(torch.float32)
    rows_RH, probs_R, _ = ops.moe_permute(hidden_TH, probs_TK, perm.slots_R, perm.offsets_L)
    local = int(perm.offsets_L[-1])
    assert torch.all(rows_RH[local:] == 0) and torch.all(probs_R[local:] == 0)
    out_RH = rows_RH * 2 + probs_R[:, None]
    out_RH = torch.cat([out_RH[:local], torch.full_like(out_RH[local:], float("nan"))])
    out_TH = ops.moe_combine(out_RH, inverse_TK, perm.offsets_L)
    experts_TK = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 3]])
    is_local_TK = (experts_TK >= 2).to(torch.float32)
    expected = (hidden_TH[:, None] * 2 + probs_TK[..., None]) * is_local_TK[..., None]
    torch.testing.assert_close(out_TH, expected.sum(1))
    out_TH.sum().backward()
    torch.testing.assert_close(probs_TK.grad, is_local_TK * HIDDEN)
    torch.testing.assert_close(hidden_TH.grad, (2 * is_local_TK.sum(1, keepdim=True)).expand(-1, HIDDEN))


def _experts(n=3):
    """Stand-ins for ``GroupedExperts``: ``local_experts`` of two ``nn.Linear`` projections each."""
    experts = torch.nn.ModuleList(
        torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(3, 4, bias=False), "linear_fc2": torch.nn.Linear(2, 3)})
        for _ in range(n)
    )
    return SimpleNamespace(local_experts=[SimpleNamespace(**dict(e.items())) for e in experts]), experts


def test_shared_storage_stack_is_a_view_with_gradients_for_every_expert():
    from megatron_opd.models.grouped_experts import GroupedExperts, equal_spacing, stacked

    holder, module = _experts()
    weights = [e.linear_fc1.weight for e in holder.local_experts]
    assert equal_spacing(weights) is None  # separate parameters: a copy
    with count_ops() as counts:
        copied = stacked(weights)
    assert counts["stack"] == 1
    state = {k: v.clone() for k, v in module.state_dict().items()}
    GroupedExperts.share_one_storage(holder)
    assert [n for n, _ in module.named_parameters()] == list(state)  # names unchanged
    assert equal_spacing(weights) == weights[0].numel()
    with count_ops() as counts:
        view = stacked(weights)
    assert sum(counts.values()) == 0 and torch.equal(view, copied)
    scale = torch.randn(view.shape)
    (view * scale).sum().backward()
    for e, weight in enumerate(weights):
        torch.testing.assert_close(weight.grad, scale[e])
    new = {k: torch.randn_like(v) for k, v in state.items()}
    module.load_state_dict(new)  # copies into the shared storage
    assert equal_spacing(weights) is not None and torch.equal(stacked(weights)[1], new["1.linear_fc1.weight"])
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    module.load_state_dict(torch.load(buffer))
    assert torch.equal(stacked(weights)[2], new["2.linear_fc1.weight"])
    fc2 = [e.linear_fc2.weight for e in holder.local_experts]
    assert equal_spacing(fc2) is not None
    fc2[1].data = fc2[1].data.clone()  # moved apart (as Megatron's DDP buffers do): a copy again
    assert equal_spacing(fc2) is None
    assert torch.equal(stacked(fc2), torch.stack([w.detach() for w in fc2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_custom_ops_keep_the_dtype(dtype):
    _, perm, probs_TK, hidden_TH, inverse_TK = _inputs(dtype)
    rows_RH, probs_R, _ = ops.moe_permute(hidden_TH, probs_TK, perm.slots_R, perm.offsets_L)
    act_RF = ops.moe_silu_glu(torch.cat([rows_RH, rows_RH], -1), probs_R, perm.offsets_L, True)
    out_TH = ops.moe_combine(act_RF, inverse_TK, perm.offsets_L, hidden_TH, hidden_TH, hidden_TH[:1])
    out_TH.float().sum().backward()
    assert {t.dtype for t in (rows_RH, probs_R, act_RF, out_TH, hidden_TH.grad, probs_TK.grad)} == {dtype}


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16, torch.float32)], ids=["fp32", "bf16"])
def test_silu_glu_is_megatron_s_activation_bit_for_bit_on_cpu(dtypes):
    """Forward and backward of Megatron's expert ``MLP`` activation (``silu(gate) * linear`` times the probability,
    cast back), as autograd computes it, in fp32 and in bf16 with fp32 probabilities."""
    import torch.nn.functional as F

    dtype, probs_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(7, 8, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(7, generator=gen).to(probs_dtype).requires_grad_()
    grad = torch.randn(7, 4, generator=gen).to(dtype)
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    expected = ((F.silu(gate) * linear) * probs.unsqueeze(-1)).to(dtype)
    found = ops.moe_silu_glu(fc1, probs, None, True)
    assert torch.equal(found, expected)
    for a, b in zip(torch.autograd.grad(found, (fc1, probs), grad), torch.autograd.grad(expected, (fc1, probs), grad)):
        assert a.dtype == b.dtype and torch.equal(a, b)
