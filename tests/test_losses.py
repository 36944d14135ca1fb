"""Single-process tests of the divergence losses against an independent float64 full-vocabulary reference.

The reference below is deliberately plain: log_softmax over the whole vocabulary, the divergences written out in
probability space, gradients by autograd. ``test_losses_distributed.py`` reuses it for the 1/2/4-rank checks.

Shape legend: ``T`` tokens, ``V`` vocabulary, ``K`` teacher top-k, ``R`` student top-k.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from megatron_opd.losses import dense_divergence, reduce_loss, topk_divergence, union_divergence
from megatron_opd.losses import local_ops as local_ops_module
from megatron_opd.losses import topk as topk_module
from megatron_opd.losses.vocab_parallel import resolve_group

KINDS = ("forward_kl", "reverse_kl", "jsd")
TAILS = ("bucket", "renorm", "ignore")


# ----------------------------------------------------------------------------------------------- reference


def _sum_p_log_ratio(p_TN: torch.Tensor, log_a_TN: torch.Tensor, log_b_TN: torch.Tensor) -> torch.Tensor:
    """sum_n p (log a - log b), with 0 where p == 0."""
    return torch.where(p_TN > 0, p_TN * (log_a_TN - log_b_TN), torch.zeros_like(p_TN)).sum(-1)


def reference_divergence(p_TN: torch.Tensor, q_TN: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """Divergence between explicit (sub-)distributions p (teacher) and q (student), in probability space."""
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    if kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "forward_kl":
        return _sum_p_log_ratio(p_TN, torch.log(p_TN), torch.log(q_TN))
    if kind == "reverse_kl":
        return _sum_p_log_ratio(q_TN, torch.log(q_TN), torch.log(p_TN))
    m_TN = beta * p_TN + (1.0 - beta) * q_TN
    return beta * _sum_p_log_ratio(p_TN, torch.log(p_TN), torch.log(m_TN)) + (1.0 - beta) * _sum_p_log_ratio(
        q_TN, torch.log(q_TN), torch.log(m_TN)
    )


def reference_dense(
    student_TV: torch.Tensor,
    teacher_TV: torch.Tensor,
    kind: str,
    beta: float = 0.5,
    ts: float = 1.0,
    tt: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Full-vocabulary float64 reference; columns at or above ``vocab_size`` are not part of the vocabulary."""
    vocab_size = vocab_size or student_TV.shape[-1]
    q_TV = torch.softmax(student_TV[..., :vocab_size].double() / ts, dim=-1)
    p_TV = torch.softmax(teacher_TV[..., :vocab_size].double() / tt, dim=-1)
    return reference_divergence(p_TV, q_TV, kind, beta)


def reference_topk(
    student_TV: torch.Tensor,
    ids_TK: torch.Tensor,
    logprobs_TK: torch.Tensor,
    kind: str,
    beta: float = 0.5,
    tail: str = "bucket",
    ts: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Top-k reference: student softmax over the full vocabulary, then the tail mode written out explicitly."""
    vocab_size = vocab_size or student_TV.shape[-1]
    q_TV = torch.softmax(student_TV[..., :vocab_size].double() / ts, dim=-1)
    q_TK = q_TV.gather(-1, ids_TK)
    p_TK = torch.exp(logprobs_TK.double())
    if tail == "renorm":
        p_TK = p_TK / p_TK.sum(-1, keepdim=True)
        q_TK = q_TK / q_TK.sum(-1, keepdim=True)
    elif tail == "bucket":
        outside_TV = torch.ones_like(q_TV).scatter(-1, ids_TK, 0.0)
        q_tail_T1 = (q_TV * outside_TV).sum(-1, keepdim=True)
        p_tail_T1 = (1.0 - p_TK.sum(-1, keepdim=True)).clamp(min=0.0)
        p_TK = torch.cat([p_TK, p_tail_T1], dim=-1)
        q_TK = torch.cat([q_TK, q_tail_T1], dim=-1)
    return reference_divergence(p_TK, q_TK, kind, beta)


def reference_union(
    student_TV: torch.Tensor,
    teacher_ids_TK: torch.Tensor,
    teacher_logprobs_TK: torch.Tensor,
    student_ids_TR: torch.Tensor,
    teacher_logprobs_TR: torch.Tensor,
    kind: str,
    beta: float = 0.5,
    tail: str = "bucket",
    ts: float = 1.0,
    vocab_size: int | None = None,
    coverage_weight: float = 0.0,
) -> torch.Tensor:
    """Union reference, token by token: the support is the teacher's ids plus the student's non-negative ids not
    already listed; the divergence over the support (+ the tail mode) from a full-vocabulary log_softmax, plus
    ``coverage_weight * -log(student mass on the support)``."""
    vocab_size = vocab_size or student_TV.shape[-1]
    q_TV = torch.softmax(student_TV[..., :vocab_size].double() / ts, dim=-1)
    losses = []
    for t in range(q_TV.shape[0]):
        ids, logps = teacher_ids_TK[t].tolist(), teacher_logprobs_TK[t].double().tolist()
        for i, lp in zip(student_ids_TR[t].tolist(), teacher_logprobs_TR[t].double().tolist()):
            if i >= 0 and i not in ids:
                ids.append(i)
                logps.append(lp)
        q_N = q_TV[t, ids]
        p_N = torch.tensor(logps, dtype=torch.float64).exp()
        coverage = -torch.log(q_N.sum())
        if tail == "renorm":
            p_N, q_N = p_N / p_N.sum(), q_N / q_N.sum()
        elif tail == "bucket":
            outside_V = torch.ones(q_TV.shape[1], dtype=torch.bool)
            outside_V[ids] = False
            p_N = torch.cat([p_N, (1.0 - p_N.sum()).clamp(min=0.0).reshape(1)])
            q_N = torch.cat([q_N, q_TV[t][outside_V].sum().reshape(1)])
        losses.append(reference_divergence(p_N[None], q_N[None], kind, beta)[0] + coverage_weight * coverage)
    return torch.stack(losses)


def make_union(
    student_TV: torch.Tensor, teacher_TV: torch.Tensor, k: int, r: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher top-k (true top-k on even tokens, random ids on odd ones) and the student's top-r with the teacher's
    log-probabilities at them; some student ids repeat teacher ids and some slots hold -1 (no id), one row only -1.
    ``teacher_TV`` covers the true vocabulary only."""
    n_tokens, vocab = teacher_TV.shape
    ids_top, lp_top = make_topk(teacher_TV, k, generator, low_mass=False)
    ids_rand, lp_rand = make_topk(teacher_TV, k, generator, low_mass=True)
    odd_T1 = (torch.arange(n_tokens) % 2 == 1)[:, None]
    teacher_ids_TK = torch.where(odd_T1, ids_rand, ids_top)
    student_ids_TR = student_TV[:, :vocab].topk(r, dim=-1).indices
    student_ids_TR[::3, 1] = teacher_ids_TK[::3, -1]  # repeated between the lists
    student_ids_TR[1::4, -1] = -1  # a short list
    student_ids_TR[2] = -1  # no student id at all
    logp_TV = torch.log_softmax(teacher_TV.double(), dim=-1)
    teacher_lp_TR = logp_TV.gather(-1, student_ids_TR.clamp(min=0))
    teacher_lp_TR[student_ids_TR < 0] = float("nan")  # never read
    return teacher_ids_TK, torch.where(odd_T1, lp_rand, lp_top), student_ids_TR, teacher_lp_TR


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (both upcast to float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def make_topk(teacher_TV: torch.Tensor, k: int, generator: torch.Generator, low_mass: bool) -> tuple:
    """Teacher top-k ids and log-probabilities; ``low_mass`` takes random ids instead of the top ones."""
    logp_TV = torch.log_softmax(teacher_TV.double(), dim=-1)
    if low_mass:
        ids_TK = torch.stack(
            [torch.randperm(teacher_TV.shape[-1], generator=generator)[:k] for _ in range(teacher_TV.shape[0])]
        )
    else:
        ids_TK = logp_TV.topk(k, dim=-1).indices
    return ids_TK, logp_TV.gather(-1, ids_TK)


def _grads(fn, student_TV: torch.Tensor, weights_T: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and d(sum weights * loss)/d(student) for ``fn(student, *args, **kwargs)``."""
    x = student_TV.detach().clone().requires_grad_(True)
    loss = fn(x, *args, **kwargs)
    (loss * weights_T.to(loss.dtype)).sum().backward()
    return loss.detach(), x.grad


# ----------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dense_matches_reference(kind: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    s_TV = (torch.randn(11, 57, generator=g, dtype=torch.float64) * 3).to(dtype)
    t_TV = (torch.randn(11, 57, generator=g, dtype=torch.float64) * 3).to(dtype)
    w_T = torch.randn(11, generator=g, dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float64 else 1e-4
    for ts, tt, chunk in [(1.0, 1.0, None), (1.7, 0.6, 4), (0.5, 2.0, 1)]:
        loss, grad = _grads(
            dense_divergence,
            s_TV,
            w_T,
            t_TV,
            kind,
            beta=0.3,
            student_temperature=ts,
            teacher_temperature=tt,
            chunk_size=chunk,
        )
        ref_loss, ref_grad = _grads(reference_dense, s_TV.double(), w_T, t_TV, kind, 0.3, ts, tt)
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert grad.dtype == dtype
        assert rel_err(loss, ref_loss) <= tol, (ts, tt, chunk)
        assert rel_err(grad, ref_grad) <= tol, (ts, tt, chunk)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", KINDS)
def test_topk_matches_reference_with_low_teacher_mass(kind: str, tail: str) -> None:
    g = torch.Generator().manual_seed(2)
    s_TV = torch.randn(10, 61, generator=g, dtype=torch.float64) * 2
    t_TV = torch.randn(10, 61, generator=g, dtype=torch.float64)
    w_T = torch.randn(10, generator=g, dtype=torch.float64)
    for low_mass in (False, True):
        ids_TK, lp_TK = make_topk(t_TV, 6, g, low_mass)
        if low_mass:
            assert float(lp_TK.exp().sum(-1).max()) < 0.4  # the regime where verl's gradient is wrong
        for dtype, tol in ((torch.float64, 1e-5), (torch.float32, 1e-4)):
            lp_dtype_TK = lp_TK.to(dtype)
            loss, grad = _grads(
                topk_divergence,
                s_TV.to(dtype),
                w_T,
                ids_TK,
                lp_dtype_TK,
                kind,
                beta=0.3,
                tail=tail,
                student_temperature=1.4,
                chunk_size=3,
            )
            ref_loss, ref_grad = _grads(
                reference_topk, s_TV.to(dtype).double(), w_T, ids_TK, lp_dtype_TK, kind, 0.3, tail, 1.4
            )
            assert rel_err(loss, ref_loss) <= tol, (low_mass, dtype)
            assert rel_err(grad, ref_grad) <= tol, (low_mass, dtype)


def test_topk_gradient_differs_from_verl_when_mass_below_one() -> None:
    # verl's hand-written gradient for the tail-ignoring forward KL is q - p_topk; the true one is
    # (sum p_topk) q - p_topk. Ours must be the true one.
    g = torch.Generator().manual_seed(3)
    s_TV = torch.randn(4, 30, generator=g, dtype=torch.float64)
    ids_TK, lp_TK = make_topk(torch.randn(4, 30, generator=g, dtype=torch.float64), 4, g, low_mass=True)
    _, grad = _grads(lambda x: topk_divergence(x, ids_TK, lp_TK, "forward_kl", tail="ignore"), s_TV, torch.ones(4))
    q_TV = torch.softmax(s_TV, -1)
    p_TV = torch.zeros_like(q_TV).scatter(-1, ids_TK, lp_TK.exp())
    true_TV = p_TV.sum(-1, keepdim=True) * q_TV - p_TV
    assert torch.allclose(grad, true_TV, atol=1e-12)
    assert not torch.allclose(grad, q_TV - p_TV, atol=1e-3)


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(4)
    s_TV = torch.randn(3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    t_TV = torch.randn(3, 9, generator=g, dtype=torch.float64)
    ids_TK, lp_TK = make_topk(t_TV, 3, g, low_mass=True)
    for kind in KINDS:
        assert torch.autograd.gradcheck(
            lambda x, kind=kind: dense_divergence(
                x, t_TV, kind, beta=0.35, student_temperature=1.3, teacher_temperature=0.8, chunk_size=2
            ),
            (s_TV,),
        )
        for tail in TAILS:
            assert torch.autograd.gradcheck(
                lambda x, kind=kind, tail=tail: topk_divergence(
                    x, ids_TK, lp_TK, kind, beta=0.35, tail=tail, student_temperature=0.9, chunk_size=2
                ),
                (s_TV,),
            )


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", KINDS)
def test_union_matches_reference(kind: str, tail: str) -> None:
    # Padding columns (vocabulary 57 of 61), student temperature 1.4, chunks of 3 tokens, ids repeated between the
    # lists, short and empty student lists; with and without the coverage term, in place and not.
    g = torch.Generator().manual_seed(31)
    s_TV = torch.randn(10, 61, generator=g, dtype=torch.float64) * 2
    s_TV[:, 57:] = 40.0  # junk in the padding columns must not matter
    t_TV = torch.randn(10, 57, generator=g, dtype=torch.float64) * 2
    w_T = torch.randn(10, generator=g, dtype=torch.float64)
    t_ids, t_lp, s_ids, s_lp = make_union(s_TV, t_TV, 5, 4, g)
    for dtype, tol in ((torch.float64, 1e-5), (torch.float32, 1e-4)):
        for coverage, in_place in ((0.0, False), (0.7, False), (0.7, True)):
            common = dict(beta=0.3, tail=tail, student_temperature=1.4, vocab_size=57, coverage_weight=coverage)
            base = s_TV.to(dtype).clone().requires_grad_(True)
            logits = base * 1.0 if in_place else base  # in place needs a non-leaf, as a model's logits are
            loss = union_divergence(
                logits, t_ids, t_lp.to(dtype), s_ids, s_lp.to(dtype), kind, chunk_size=3, inplace_backward=in_place,
                **common,
            )  # fmt: skip
            (loss * w_T.to(loss.dtype)).sum().backward()
            ref_loss, ref_grad = _grads(
                reference_union, s_TV.to(dtype).double(), w_T, t_ids, t_lp.to(dtype), s_ids, s_lp.to(dtype), kind,
                0.3, tail, 1.4, 57, coverage,
            )  # fmt: skip
            case = (dtype, coverage, in_place)
            assert rel_err(loss, ref_loss) <= tol, case
            assert rel_err(base.grad, ref_grad) <= tol, case
            assert torch.all(base.grad[:, 57:] == 0), case


def test_union_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(32)
    s_TV = torch.randn(5, 13, generator=g, dtype=torch.float64, requires_grad=True)
    t_ids, t_lp, s_ids, s_lp = make_union(s_TV.detach(), torch.randn(5, 11, generator=g, dtype=torch.float64), 3, 3, g)
    for kind in KINDS:
        for tail in TAILS:
            assert torch.autograd.gradcheck(
                lambda x, kind=kind, tail=tail: union_divergence(
                    x,
                    t_ids,
                    t_lp,
                    s_ids,
                    s_lp,
                    kind,
                    beta=0.35,
                    tail=tail,
                    coverage_weight=0.6,
                    student_temperature=0.9,
                    chunk_size=2,
                    vocab_size=11,
                ),  # fmt: skip
                (s_TV,),
            )


def test_union_comparison_catches_a_wrong_coverage_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference comparison must be able to fail: drop the coverage term's gradient and it does.
    g = torch.Generator().manual_seed(33)
    s_TV = torch.randn(6, 30, generator=g, dtype=torch.float64)
    t_ids, t_lp, s_ids, s_lp = make_union(s_TV, torch.randn(6, 30, generator=g, dtype=torch.float64), 4, 4, g)
    w_T = torch.ones(6, dtype=torch.float64)
    args = (t_ids, t_lp, s_ids, s_lp, "forward_kl")
    ref_loss, ref_grad = _grads(reference_union, s_TV, w_T, *args, coverage_weight=0.5)
    loss, grad = _grads(union_divergence, s_TV, w_T, *args, coverage_weight=0.5)
    assert rel_err(grad, ref_grad) < 1e-12
    real = topk_module.coverage_term
    monkeypatch.setattr(topk_module, "coverage_term", lambda logq_TK: (real(logq_TK)[0], torch.zeros_like(logq_TK)))
    wrong_loss, wrong_grad = _grads(union_divergence, s_TV, w_T, *args, coverage_weight=0.5)
    assert rel_err(wrong_loss, ref_loss) < 1e-12 and rel_err(wrong_grad, ref_grad) > 1e-2


def test_support_mask_slots_are_ignored() -> None:
    # Absent slots may hold anything (ids out of range or repeated, NaN log-probabilities): the loss and gradient
    # equal those of the present ids alone, for every kind and tail, and no NaN reaches the gradient.
    g = torch.Generator().manual_seed(34)
    s_TV = torch.randn(6, 25, generator=g, dtype=torch.float64)
    ids_TK, lp_TK = make_topk(torch.randn(6, 25, generator=g, dtype=torch.float64), 3, g, low_mass=False)
    junk_ids_TK = torch.tensor([[99, -5], [0, 0]]).repeat(3, 1)
    junk_ids_TK[:, 1] = ids_TK[:, 0]  # an absent slot repeating a present id
    padded_ids_TN = torch.cat([junk_ids_TK[:, :1], ids_TK, junk_ids_TK[:, 1:]], dim=1)
    padded_lp_TN = torch.cat([torch.full((6, 1), math.nan), lp_TK, torch.full((6, 1), 0.5)], dim=1)
    support_TN = torch.tensor([False, True, True, True, False]).expand(6, 5)
    w_T = torch.randn(6, generator=g, dtype=torch.float64)
    for kind in KINDS:
        for tail in TAILS:
            for coverage in (0.0, 0.4):
                common = dict(tail=tail, coverage_weight=coverage)
                loss, grad = _grads(topk_divergence, s_TV, w_T, ids_TK, lp_TK, kind, **common)
                m_loss, m_grad = _grads(
                    topk_divergence, s_TV, w_T, padded_ids_TN, padded_lp_TN, kind, support_mask=support_TN, **common
                )
                assert torch.isfinite(m_grad).all()
                assert rel_err(m_loss, loss) < 1e-14 and rel_err(m_grad, grad) < 1e-14, (kind, tail, coverage)


def test_coverage_term_value() -> None:
    g = torch.Generator().manual_seed(35)
    s_TV = torch.randn(4, 20, generator=g, dtype=torch.float64)
    ids_TK, lp_TK = make_topk(torch.randn(4, 20, generator=g, dtype=torch.float64), 5, g, low_mass=True)
    plain = topk_divergence(s_TV, ids_TK, lp_TK, "jsd")
    covered = topk_divergence(s_TV, ids_TK, lp_TK, "jsd", coverage_weight=2.0)
    mass_T = torch.softmax(s_TV, -1).gather(-1, ids_TK).sum(-1)
    assert rel_err(covered - plain, -2.0 * torch.log(mass_T)) < 1e-12


def test_jsd_limits_and_endpoints() -> None:
    g = torch.Generator().manual_seed(5)
    s_TV = torch.randn(5, 40, generator=g, dtype=torch.float64)
    t_TV = torch.randn(5, 40, generator=g, dtype=torch.float64)
    fkl = dense_divergence(s_TV, t_TV, "forward_kl")
    rkl = dense_divergence(s_TV, t_TV, "reverse_kl")
    # JSD_beta / beta -> KL(teacher || student) as beta -> 0, JSD_beta / (1 - beta) -> KL(student || teacher) as
    # beta -> 1, with an O(beta) error: the error must shrink ~10x when beta does.
    errors = []
    for eps in (1e-3, 1e-4):
        to_fkl = dense_divergence(s_TV, t_TV, "jsd", beta=eps) / eps
        to_rkl = dense_divergence(s_TV, t_TV, "jsd", beta=1.0 - eps) / eps
        errors.append((rel_err(to_fkl, fkl), rel_err(to_rkl, rkl)))
    assert errors[1][0] < 1e-3 and errors[1][1] < 1e-3
    assert errors[1][0] < errors[0][0] / 5 and errors[1][1] < errors[0][1] / 5
    # The endpoints select the KLs exactly (TRL's convention), for both modes.
    assert torch.equal(dense_divergence(s_TV, t_TV, "jsd", beta=0.0), fkl)
    assert torch.equal(dense_divergence(s_TV, t_TV, "jsd", beta=1.0), rkl)
    ids_TK, lp_TK = make_topk(t_TV, 5, g, low_mass=False)
    assert torch.equal(
        topk_divergence(s_TV, ids_TK, lp_TK, "jsd", beta=0.0), topk_divergence(s_TV, ids_TK, lp_TK, "forward_kl")
    )
    for beta in (0.01, 0.5, 0.99):
        assert rel_err(dense_divergence(s_TV, t_TV, "jsd", beta=beta), reference_dense(s_TV, t_TV, "jsd", beta)) < 1e-12


# ----------------------------------------------------------------------------------------------- behaviours


def test_padding_columns_are_excluded_and_get_zero_gradient() -> None:
    g = torch.Generator().manual_seed(6)
    s_TV = torch.randn(6, 32, generator=g, dtype=torch.float64)
    t_TV = torch.randn(6, 32, generator=g, dtype=torch.float64)
    s_TV[:, 29:] = 50.0  # junk in the padding columns must not matter
    t_TV[:, 29:] = -50.0
    w_T = torch.ones(6, dtype=torch.float64)
    for kind in KINDS:
        loss, grad = _grads(dense_divergence, s_TV, w_T, t_TV, kind, vocab_size=29, chunk_size=4)
        ref_loss, ref_grad = _grads(reference_dense, s_TV, w_T, t_TV, kind, vocab_size=29)
        assert rel_err(loss, ref_loss) < 1e-12 and rel_err(grad, ref_grad) < 1e-12
        assert torch.all(grad[:, 29:] == 0)
    ids_TK, lp_TK = make_topk(t_TV[:, :29], 4, g, low_mass=False)
    loss, grad = _grads(lambda x: topk_divergence(x, ids_TK, lp_TK, "forward_kl", vocab_size=29), s_TV, w_T)
    ref_loss, ref_grad = _grads(lambda x: reference_topk(x, ids_TK, lp_TK, "forward_kl", vocab_size=29), s_TV, w_T)
    assert rel_err(loss, ref_loss) < 1e-12 and rel_err(grad, ref_grad) < 1e-12
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=29\\)"):
        topk_divergence(s_TV, torch.full((6, 1), 30), torch.full((6, 1), -1.0), "forward_kl", vocab_size=29)


def test_batch_seq_shape_bf16_and_inplace_backward() -> None:
    g = torch.Generator().manual_seed(7)
    s_BSV = torch.randn(2, 5, 48, generator=g) * 2
    t_BSV = torch.randn(2, 5, 48, generator=g) * 2
    for kind in KINDS:
        x = s_BSV.clone().requires_grad_(True)
        loss_BS = dense_divergence(x, t_BSV, kind, chunk_size=3)
        assert loss_BS.shape == (2, 5)
        loss_BS.sum().backward()
        ref = reference_dense(s_BSV.double().reshape(10, 48), t_BSV.reshape(10, 48), kind).reshape(2, 5)
        assert rel_err(loss_BS, ref) < 1e-4
        # bf16 in: fp32 losses, bf16 gradients, bf16-level agreement.
        xb = s_BSV.to(torch.bfloat16).requires_grad_(True)
        loss_b = dense_divergence(xb, t_BSV.to(torch.bfloat16), kind)
        loss_b.sum().backward()
        assert loss_b.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
        assert rel_err(xb.grad, x.grad) < 3e-2
        # In-place backward: the same gradient, written into the logits' storage.
        base = s_BSV.clone().requires_grad_(True)
        logits = base * 1.0  # a non-leaf, as the output layer's logits are
        dense_divergence(logits, t_BSV, kind, inplace_backward=True, chunk_size=4).sum().backward()
        assert torch.allclose(base.grad, x.grad, atol=1e-6)
        assert torch.equal(logits.detach(), base.grad)
    ids_BSK, lp_BSK = make_topk(t_BSV.reshape(10, 48), 4, g, low_mass=False)
    ids_BSK, lp_BSK = ids_BSK.reshape(2, 5, 4), lp_BSK.reshape(2, 5, 4)
    x = s_BSV.clone().requires_grad_(True)
    topk_divergence(x, ids_BSK, lp_BSK, "reverse_kl").sum().backward()
    base = s_BSV.clone().requires_grad_(True)
    topk_divergence(base * 1.0, ids_BSK, lp_BSK, "reverse_kl", inplace_backward=True).sum().backward()
    assert torch.allclose(base.grad, x.grad, atol=1e-6)


def test_teacher_gets_no_gradient_and_minus_inf_teacher_logits() -> None:
    g = torch.Generator().manual_seed(8)
    s_TV = torch.randn(4, 20, generator=g, dtype=torch.float64, requires_grad=True)
    t_TV = torch.randn(4, 20, generator=g, dtype=torch.float64, requires_grad=True)
    dense_divergence(s_TV, t_TV, "jsd").sum().backward()
    assert t_TV.grad is None and s_TV.grad is not None
    masked_TV = t_TV.detach().clone()
    masked_TV[:, :5] = float("-inf")  # the teacher forbids some tokens
    for kind in ("forward_kl", "jsd"):
        loss = dense_divergence(s_TV, masked_TV, kind)
        assert torch.isfinite(loss).all()
        assert rel_err(loss, reference_dense(s_TV, masked_TV, kind)) < 1e-12
    assert torch.isinf(dense_divergence(s_TV, masked_TV, "reverse_kl")).all()  # KL(q||p) is infinite there


def test_chunking_bounds_the_rows_each_step_touches(monkeypatch: pytest.MonkeyPatch) -> None:
    seen_rows: list[int] = []

    class Recording(local_ops_module.TorchLocalOps):
        def chunk_elements(self, device):
            return 6 * 40

        def dense_stats(self, s_CV, *args):
            seen_rows.append(s_CV.shape[0])
            return super().dense_stats(s_CV, *args)

        def dense_grad(self, s_CV, *args):
            seen_rows.append(s_CV.shape[0])
            return super().dense_grad(s_CV, *args)

    import megatron_opd.losses.dense as dense_module

    monkeypatch.setattr(dense_module, "select_local_ops", lambda backend, device: Recording())
    s_TV = torch.randn(100, 40, requires_grad=True)
    dense_divergence(s_TV, torch.randn(100, 40), "forward_kl").sum().backward()
    assert max(seen_rows) == 6 and sum(seen_rows) == 200  # auto: 6 rows of 40 columns, every row once per pass
    seen_rows.clear()
    dense_divergence(s_TV, torch.randn(100, 40), "forward_kl", chunk_size=7).sum().backward()
    assert max(seen_rows) == 7 and sum(seen_rows) == 200


def test_group_none_falls_back_to_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "megatron.core.parallel_state"
    monkeypatch.delitem(sys.modules, key, raising=False)
    assert resolve_group(None) is None  # megatron never imported: single process
    fake = types.ModuleType(key)
    fake.model_parallel_is_initialized = lambda: False
    fake.get_tensor_model_parallel_group = lambda: pytest.fail("must not be asked when not initialised")
    monkeypatch.setitem(sys.modules, key, fake)
    assert resolve_group(None) is None
    s_TV, t_TV = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64)
    assert rel_err(dense_divergence(s_TV, t_TV, "forward_kl"), reference_dense(s_TV, t_TV, "forward_kl")) < 1e-12
    sentinel = object()
    fake.model_parallel_is_initialized = lambda: True
    fake.get_tensor_model_parallel_group = lambda: sentinel
    assert resolve_group(None) is sentinel


# ----------------------------------------------------------------------------------------------- errors


def test_argument_errors_name_the_argument() -> None:
    s_TV, t_TV = torch.randn(4, 10), torch.randn(4, 10)
    ids_TK = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    lp_TK = torch.full((4, 2), -2.0)
    cases = [
        (lambda: dense_divergence(s_TV, t_TV, "kl"), "kind must be one of"),
        (lambda: dense_divergence(s_TV, t_TV, "jsd", beta=1.5), "beta must be in \\[0, 1\\]"),
        (lambda: dense_divergence(s_TV, t_TV, "forward_kl", student_temperature=0.0), "student_temperature"),
        (lambda: dense_divergence(s_TV, t_TV[:, :5], "forward_kl"), "teacher_logits must have the student's shape"),
        (lambda: dense_divergence(s_TV, t_TV, "forward_kl", chunk_size=0), "chunk_size must be a positive int"),
        (lambda: dense_divergence(s_TV, t_TV, "forward_kl", vocab_size=11), "vocab_size=11"),
        (lambda: dense_divergence(s_TV, t_TV, "forward_kl", backend="cuda"), "backend must be"),
        (
            lambda: dense_divergence(s_TV.clone().requires_grad_(True), t_TV, "jsd", inplace_backward=True),
            "inplace_backward=True needs student_logits computed by the model",
        ),
        (lambda: topk_divergence(s_TV, ids_TK, lp_TK, "forward_kl", tail="drop"), "tail must be one of"),
        (lambda: topk_divergence(s_TV, ids_TK.float(), lp_TK, "forward_kl"), "teacher_topk_ids must be an integer"),
        (lambda: topk_divergence(s_TV, ids_TK[:3], lp_TK[:3], "forward_kl"), "must both be"),
        (
            lambda: topk_divergence(s_TV, torch.arange(11).expand(4, 11), torch.full((4, 11), -3.0), "forward_kl"),
            "k=11 ids per token, more than vocab_size=10",
        ),
        (
            lambda: topk_divergence(s_TV, torch.tensor([[0, 1], [2, 3], [4, 4], [6, 7]]), lp_TK, "forward_kl"),
            "duplicate ids at token 2; deduplicate before calling",
        ),
        (
            lambda: topk_divergence(s_TV, torch.tensor([[0, 1], [2, 3], [4, 5], [6, 10]]), lp_TK, "forward_kl"),
            "id 10 at token 3, outside",
        ),
        (
            lambda: topk_divergence(s_TV, ids_TK, lp_TK.index_fill(0, torch.tensor([1]), math.nan), "jsd"),
            "is NaN at token 1",
        ),
        (
            lambda: topk_divergence(s_TV, ids_TK, lp_TK.index_fill(0, torch.tensor([2]), 0.5), "jsd"),
            "is above 0 at token 2",
        ),
        (
            lambda: topk_divergence(s_TV, ids_TK, torch.full((4, 2), -0.5), "jsd"),
            "sum to probability 1.213061 > 1 at token 0",
        ),
        (
            lambda: topk_divergence(s_TV, ids_TK, lp_TK.index_fill(0, torch.tensor([3]), -math.inf), "reverse_kl"),
            "is -inf, where reverse_kl is infinite at token 3",
        ),
        (
            lambda: topk_divergence(
                s_TV, ids_TK, lp_TK.index_fill(0, torch.tensor([3]), -math.inf), "jsd", tail="renorm"
            ),
            "all -inf at token 3",
        ),
        (
            lambda: topk_divergence(
                s_TV.reshape(2, 2, 10), ids_TK.reshape(2, 2, 2).flip(-1).clamp(max=3), lp_TK.reshape(2, 2, 2), "jsd"
            ),
            "duplicate ids at position \\(1, 0\\)",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_union_argument_errors_name_the_list() -> None:
    s_TV = torch.randn(3, 10)
    t_ids, t_lp = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.full((3, 2), -2.0)
    s_ids, s_lp = torch.tensor([[6, 1], [7, -1], [8, 9]]), torch.full((3, 2), -3.0)
    cases = [
        (lambda: union_divergence(s_TV, t_ids, t_lp, s_ids[:, :1], s_lp, "jsd"), "must both be \\[\\*\\(3,\\), R\\]"),
        (lambda: union_divergence(s_TV, t_ids, t_lp, s_ids.float(), s_lp, "jsd"), "student_topk_ids must be a signed"),
        (lambda: union_divergence(s_TV, t_ids, t_lp, s_ids, s_lp.long(), "jsd"), "at_student_ids must be floating"),
        (lambda: union_divergence(s_TV, t_ids, t_lp, s_ids, s_lp, "jsd", tail="x"), "tail must be one of"),
        (
            lambda: union_divergence(s_TV, t_ids, t_lp, torch.tensor([[6, 1], [7, 7], [8, 9]]), s_lp, "jsd"),
            "student_topk_ids contains duplicate ids at token 1",
        ),
        (
            lambda: union_divergence(s_TV, t_ids, t_lp, torch.tensor([[6, 1], [7, -1], [8, 10]]), s_lp, "jsd"),
            "student_topk_ids has id 10 at token 2, outside",
        ),
        (
            lambda: union_divergence(s_TV, t_ids, t_lp, s_ids, s_lp.index_fill(0, torch.tensor([2]), math.nan), "jsd"),
            "teacher_logprobs_at_student_ids is NaN at token 2",
        ),
        (
            lambda: union_divergence(
                s_TV, t_ids.flip(0), t_lp, s_ids, s_lp.index_fill(1, torch.tensor([0]), -0.1), "jsd"
            ),
            "the teacher's log-probabilities sum to probability",
        ),  # fmt: skip
        (
            lambda: union_divergence(s_TV, t_ids, t_lp, s_ids, s_lp, "forward_kl", coverage_weight=-1.0),
            "coverage_weight must be a finite number >= 0",
        ),
        (
            lambda: topk_divergence(s_TV, t_ids, t_lp, "jsd", support_mask=torch.ones(3, 2)),
            "support_mask must be a bool tensor",
        ),
        (
            lambda: topk_divergence(
                s_TV, t_ids, t_lp, "jsd", support_mask=torch.tensor([[True, True], [False] * 2] * 2)[:3]
            ),
            "support_mask holds no id at token 1",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    # Repeats between the lists and negative student ids are not errors, whatever log-probability they carry.
    junk_lp = torch.tensor([[-3.0, math.nan], [-3.0, math.nan], [-3.0, -3.0]])
    assert torch.isfinite(union_divergence(s_TV, t_ids, t_lp, s_ids, junk_lp, "reverse_kl")).all()


def test_minus_inf_teacher_logprobs_mean_zero_mass() -> None:
    g = torch.Generator().manual_seed(9)
    s_TV = torch.randn(3, 12, generator=g, dtype=torch.float64)
    ids_TK = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    lp_TK = torch.log(torch.tensor([[0.5, 0.2, 0.0], [0.3, 0.0, 0.0], [0.1, 0.1, 0.1]], dtype=torch.float64))
    w_T = torch.ones(3, dtype=torch.float64)
    for kind in ("forward_kl", "jsd"):
        for tail in TAILS:
            loss, grad = _grads(topk_divergence, s_TV, w_T, ids_TK, lp_TK, kind, tail=tail)
            ref_loss, ref_grad = _grads(reference_topk, s_TV, w_T, ids_TK, lp_TK, kind, 0.5, tail)
            assert torch.isfinite(grad).all()
            assert rel_err(loss, ref_loss) < 1e-12 and rel_err(grad, ref_grad) < 1e-12


def test_bucket_tail_is_exact_for_an_overconfident_student() -> None:
    # The student puts ~1 - 1e-9 of its mass on the teacher's top-2: 1 - sum(q) in float32 would be 0 or noise,
    # the masked tail sum is exact.
    s_TV = torch.full((1, 1000), -30.0)
    s_TV[0, :2] = 0.0
    ids_TK = torch.tensor([[0, 1]])
    lp_TK = torch.log(torch.tensor([[0.45, 0.45]]))
    loss = topk_divergence(s_TV, ids_TK, lp_TK, "forward_kl")
    ref = reference_topk(s_TV.double(), ids_TK, lp_TK.double(), "forward_kl")
    assert rel_err(loss, ref) < 1e-5


# ----------------------------------------------------------------------------------------------- reduction


def test_reduce_loss_modes() -> None:
    loss_BS = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 0.0, 0.0]], requires_grad=True)
    mask_BS = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert reduce_loss(loss_BS, mask_BS, "sum").item() == 10.0
    assert reduce_loss(loss_BS, mask_BS, "token_mean").item() == 2.5
    assert reduce_loss(loss_BS, mask_BS, "sequence_mean").item() == 3.0  # (2 + 4) / 2
    assert reduce_loss(loss_BS, mask_BS, "token_mean", normalizer=8).item() == 1.25
    assert reduce_loss(loss_BS, mask_BS, "sequence_mean", normalizer=4).item() == 1.5
    reduce_loss(loss_BS, mask_BS, "token_mean").backward()
    assert torch.equal(loss_BS.grad, mask_BS.float() / 4)  # masked NaN / inf never leak into the gradient
    empty = reduce_loss(torch.ones(2, 3, requires_grad=True), torch.zeros(2, 3, dtype=torch.bool), "sequence_mean")
    assert empty.item() == 0.0
    weights = torch.tensor([0.5, 1.0, 0.0])
    assert reduce_loss(torch.tensor([2.0, 4.0, 9.0]), weights).item() == pytest.approx(5.0 / 1.5)
    assert reduce_loss(torch.tensor([1.0, 3.0])).item() == 2.0
    with pytest.raises(ValueError, match="mode must be one of"):
        reduce_loss(loss_BS, mask_BS, "mean")
    with pytest.raises(ValueError, match="mask shape"):
        reduce_loss(loss_BS, mask_BS[0])
    with pytest.raises(ValueError, match="normalizer has no meaning"):
        reduce_loss(loss_BS, mask_BS, "sum", normalizer=3)


class _NewAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the size of every tensor an op creates in fresh storage (outputs that are not views of or
    in-place writes into an existing tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        known = {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("mode", ["dense", "topk", "union"])
def test_in_place_path_allocates_nothing_the_size_of_the_logits(mode: str) -> None:
    # The trainer's path: no [tokens, V] gradient and, with the stash, at most chunk-sized scratch buffers.
    g = torch.Generator().manual_seed(21)
    n_tokens, width, chunk = 64, 500, 8
    s_TV, t_TV = torch.randn(n_tokens, width, generator=g), torch.randn(n_tokens, width, generator=g)
    ids_TK, lp_TK = make_topk(t_TV, 16, g, low_mass=True)
    t_ids, t_lp, s_ids, s_lp = make_union(s_TV, t_TV, 16, 8, g)
    union = (t_ids, t_lp.float(), s_ids, s_lp.float())
    shard_bytes = n_tokens * width * 4
    for kind in KINDS:
        for in_place in (False, True):
            base = s_TV.clone().requires_grad_(True)
            logits = base * 1.0
            with _NewAllocations() as seen:
                if mode == "dense":
                    loss = dense_divergence(logits, t_TV, kind, chunk_size=chunk, inplace_backward=in_place)
                elif mode == "topk":
                    loss = topk_divergence(logits, ids_TK, lp_TK, kind, chunk_size=chunk, inplace_backward=in_place)
                else:
                    loss = union_divergence(logits, *union, kind, chunk_size=chunk, inplace_backward=in_place)
                (grad_TV,) = torch.autograd.grad(loss.sum(), logits)  # stops at the logits, as the output layer would
            ref_x_TV = s_TV.double().requires_grad_(True)
            if mode == "dense":
                ref_T = reference_dense(ref_x_TV, t_TV.double(), kind)
            elif mode == "topk":
                ref_T = reference_topk(ref_x_TV, ids_TK, lp_TK.double(), kind, 0.5, "bucket")
            else:
                ref_T = reference_union(ref_x_TV, *union, kind, 0.5, "bucket")
            expected = torch.autograd.grad(ref_T.sum(), ref_x_TV)[0]
            assert rel_err(grad_TV, expected) < 1e-4
            if in_place:
                assert grad_TV.data_ptr() == logits.data_ptr()
                assert seen.largest <= chunk * width * 4, (kind, seen.largest)
            else:  # the default returns a fresh gradient: the one logits-sized allocation
                assert seen.largest == shard_bytes, (kind, seen.largest)


def test_an_options_object_and_keywords_are_the_same_call():
    """The losses take ``DivergenceOptions`` or its fields as keywords (keywords override the object's): the same
    loss bit for bit; a keyword that is no field, or one the loss does not take, is refused as Python would."""
    from megatron_opd.losses import DivergenceOptions, PassStatistics, topk_divergence

    gen = torch.Generator().manual_seed(5)
    student, teacher = torch.randn(4, 11, generator=gen), torch.randn(4, 11, generator=gen)
    top = torch.log_softmax(teacher, -1).topk(3, dim=-1)
    by_keywords = dense_divergence(student, teacher, "jsd", beta=0.3, teacher_temperature=2.0, vocab_size=10)
    options = DivergenceOptions(beta=0.9, teacher_temperature=2.0, vocab_size=10)
    assert torch.equal(dense_divergence(student, teacher, "jsd", options=options, beta=0.3), by_keywords)
    assert not torch.equal(dense_divergence(student, teacher, "jsd", options=options), by_keywords)
    stats = PassStatistics()
    renorm = topk_divergence(student, top.indices, top.values, "forward_kl", options=DivergenceOptions(tail="renorm",
                             outputs=stats))  # fmt: skip
    assert torch.equal(renorm, topk_divergence(student, top.indices, top.values, "forward_kl", tail="renorm"))
    torch.testing.assert_close(stats.student_lse, torch.logsumexp(student, -1))
    with pytest.raises(TypeError, match="dense_divergence.*'tail'"):
        dense_divergence(student, teacher, "jsd", tail="renorm")
    with pytest.raises(TypeError, match="topk_divergence.*'teacher_temperature'"):
        topk_divergence(student, top.indices, top.values, "forward_kl", teacher_temperature=2.0)
