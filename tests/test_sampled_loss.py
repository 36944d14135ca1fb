"""The sampled reverse and forward KL (``loss.mode=sampled``) and their per-group form across tokenizers, against
float64.

The surrogate ``sg(w) * log q`` per token (or per aligned group), ``w = log q - log p`` (reverse KL) or ``1 - p/q``
(forward KL): its value, its gradient (which must be ``w grad log q``, not the zero-mean gradient of an estimate),
and, summed over every token the student could sample weighted by its probability, the exact gradient of the
divergence (the estimator is unbiased) and the exact divergence; vocab-parallel at TP=2 (in
tests/test_aligned_loss.py's spawn, one for both losses), through the trainer's loss function with and without the
fused output layer, and the group form with 1:1 groups equal to the per-token one.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.losses.sampled import SAMPLED_KINDS, group_sums, label_logprobs, reward_to_go, sampled_divergence
from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.objective import fused_output_applies, make_loss_fn

T, V, VOCAB = 11, 24, 21  # V - VOCAB padded columns never enter
TEMPERATURES = (1.0, 1.7)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, VOCAB, (T,), generator=g)
    teacher = -torch.rand(T, generator=g, dtype=torch.float64) * 4
    return logits, labels, teacher


def _reference(logits, labels, teacher, temperature, offset=None, kind="reverse_kl", ratio_clip=0.0):
    """float64: the loss sum and its gradient, from ``log_softmax`` and the defining formula."""
    x = logits.detach().clone().requires_grad_()
    logq = torch.log_softmax(x[:, :VOCAB] / temperature, dim=-1).gather(-1, labels[:, None])[:, 0]
    logq_group = logq if offset is None else torch.stack([logq[i + int(offset[i]) : i + 1].sum() for i in range(T)])
    if offset is not None:  # each token's group: its first token and every later token with the same first
        first = torch.arange(T) + offset
        logq_group = torch.stack([logq[first == first[i]].sum() for i in range(T)])
    log_ratio = (logq_group - teacher).detach()
    ratio = (-log_ratio).exp()
    weight = log_ratio if kind == "reverse_kl" else 1 - (ratio.clamp(max=ratio_clip) if ratio_clip else ratio)
    loss = (weight * logq).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), grad


@pytest.mark.parametrize("kind", SAMPLED_KINDS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_value_and_gradient_against_float64(temperature, kind):
    logits, labels, teacher = _inputs()
    x = logits.clone().requires_grad_()
    logq = label_logprobs(x, labels, vocab_size=VOCAB, temperature=temperature)
    surrogate, divergence = sampled_divergence(logq, teacher, kind)
    surrogate.sum().backward()
    ref_loss, ref_grad = _reference(logits, labels, teacher, temperature, kind=kind)
    assert float(surrogate.sum().detach()) == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert x.grad[:, VOCAB:].abs().max() == 0  # padded columns get nothing
    log_ratio = logq.detach() - teacher
    r = (-log_ratio).exp()
    want = log_ratio if kind == "reverse_kl" else r * -log_ratio - r + 1
    torch.testing.assert_close(divergence, want)
    if kind != "reverse_kl":  # the rest does not depend on the kind
        return
    # Not the gradient of log q - log p, whose expectation under q is zero: the student would not learn.
    naive = logits.clone().requires_grad_()
    (label_logprobs(naive, labels, vocab_size=VOCAB, temperature=temperature) - teacher).sum().backward()
    assert (naive.grad - x.grad).abs().max() > 1e-3
    assert torch.autograd.gradcheck(
        lambda z: label_logprobs(z, labels, vocab_size=VOCAB, temperature=temperature),
        (logits.clone().requires_grad_(),),
    )


@pytest.mark.parametrize("kind", SAMPLED_KINDS)
def test_unbiased_over_what_the_student_samples(kind):
    """At each position, the surrogate's gradient and the divergence estimate, averaged over every token the
    student could sample (weighted by its probability), are the exact divergence's gradient and value (float64,
    full distributions); the ratio cap (forward KL) biases it only where the cap bites."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=g, dtype=torch.float64) * 2
    logp = torch.log_softmax(torch.randn(4, VOCAB, generator=g, dtype=torch.float64) * 3, -1)
    x = logits.clone().requires_grad_()
    logq = torch.log_softmax(x, -1)
    q, p = logq.exp(), logp.exp()
    exact = (q * (logq - logp)).sum() if kind == "reverse_kl" else (p * (logp - logq)).sum()
    (exact_grad,) = torch.autograd.grad(exact, x)
    for ratio_clip in (0.0, 1e6):  # a cap above every p/q here changes nothing
        expected_grad, expected_value = torch.zeros_like(logits), 0.0
        for y in range(VOCAB):  # the label every row samples, weighted by its probability under q
            z = logits.clone().requires_grad_()
            labels = torch.full((4,), y)
            logq_y = label_logprobs(z, labels, vocab_size=VOCAB)
            surrogate, divergence = sampled_divergence(logq_y, logp[:, y], kind, ratio_clip=ratio_clip)
            surrogate.sum().backward()
            expected_grad += q.detach()[:, y : y + 1] * z.grad
            expected_value += float((q.detach()[:, y] * divergence).sum())
        torch.testing.assert_close(expected_grad, exact_grad, rtol=1e-9, atol=1e-12)
        assert expected_value == pytest.approx(float(exact), rel=1e-9)
    if kind == "forward_kl":  # a binding cap: the weight of a token the student under-samples stops at 1 - cap
        logq_T, logp_T = torch.tensor([-6.0, -0.1]), torch.tensor([-0.5, -0.2])
        surrogate, _ = sampled_divergence(logq_T.clone().requires_grad_(), logp_T, kind, ratio_clip=10.0)
        want = torch.tensor([1 - 10.0, 1 - math.exp(-0.1)])  # p/q: e^5.5 (capped), e^-0.1
        torch.testing.assert_close((surrogate / logq_T).detach(), want)


@pytest.mark.parametrize("kind", SAMPLED_KINDS)
def test_groups_sum_log_q_over_their_tokens(kind):
    logits, labels, teacher = _inputs(1)
    offset = torch.tensor([0, -1, -2, 0, 0, -1, 0, -1, -2, -3, 0])  # groups {0,1,2} {3} {4,5} {6..9} {10}
    assert group_sums(torch.ones(T), offset).tolist() == [3, 3, 3, 1, 2, 2, 4, 4, 4, 4, 1]
    teacher = teacher[torch.arange(T) + offset]  # a group's log p at each of its tokens
    x = logits.clone().requires_grad_()
    logq = label_logprobs(x, labels, vocab_size=VOCAB)
    surrogate, divergence = sampled_divergence(logq, teacher, kind, offset)
    surrogate.sum().backward()
    ref_loss, ref_grad = _reference(logits, labels, teacher, 1.0, offset, kind=kind)
    assert float(surrogate.sum().detach()) == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-10, atol=1e-12)
    # The divergence of a group is spread over its tokens: they sum to the group's estimate.
    log_ratio = float(logq.detach()[:3].sum() - teacher[0])
    want = log_ratio if kind == "reverse_kl" else math.exp(-log_ratio) * (-log_ratio - 1) + 1
    assert float(divergence[:3].sum()) == pytest.approx(want, rel=1e-12)


class _Switch:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


@pytest.mark.parametrize("kind", SAMPLED_KINDS)
@pytest.mark.parametrize("fused", [False, True])
def test_the_trainers_loss_with_tokens_and_with_one_to_one_groups(fused, kind):
    """``loss.mode=sampled`` through ``make_loss_fn`` (fp32, with and without the fused output layer) against the
    float64 formula; the cross-tokenizer form with every group 1:1 gives the same loss and gradients (≤ 1e-6)."""
    g = torch.Generator().manual_seed(5)
    b, s, h = 2, 6, 8
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = torch.randn(V, h, generator=g, requires_grad=True)
    mask = torch.ones(b, s)
    mask[1, :2] = 0
    mb = {"loss_mask": mask, "labels": torch.randint(0, VOCAB, (b, s), generator=g), "seq_weights": torch.ones(b),
          "teacher_label_logprobs": -torch.rand(b, s, generator=g) * 3}  # fmt: skip
    common = dict(vocab_size=VOCAB, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0)
    results = []
    for cross in ("off", "sampled"):
        hidden.grad = weight.grad = None
        cfg = LossConfig(kind=kind, mode="sampled", cross_tokenizer=cross, chunk_size=4)
        cols = dict(mb, group_offset=torch.zeros(b, s, dtype=torch.int64)) if cross == "sampled" else mb
        if fused:
            loss, stats = make_loss_fn(cfg, output=_Switch(weight), **common)(hidden, cols)
        else:
            loss, stats = make_loss_fn(cfg, **common)(hidden @ weight.t(), cols)
        loss.backward()
        results.append((float(loss.detach()), hidden.grad.clone(), weight.grad.clone(), stats))
    (loss, gh, gw, stats), (loss_x, gh_x, gw_x, stats_x) = results
    # No teacher top-1 here: the agreement has no denominator (the metrics row leaves top1_agreement out).
    assert stats.top1_tokens == stats_x.top1_tokens == 0 and stats.tokens == stats_x.tokens == float(mask.sum())
    assert loss_x == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(gh_x, gh, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gw_x, gw, rtol=1e-6, atol=1e-7)
    # float64 reference of the token-mean surrogate and its hidden-state gradient
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double()
    logq = torch.log_softmax((h64 @ w64.t())[..., :VOCAB], -1).gather(-1, mb["labels"][..., None])[..., 0]
    log_ratio = (logq - mb["teacher_label_logprobs"].double()).detach()
    r = (-log_ratio).exp()
    assert (r > cfg.sampled_ratio_clip).any()  # the default cap bites on some tokens here
    weight = log_ratio if kind == "reverse_kl" else 1 - r.clamp(max=cfg.sampled_ratio_clip)
    ref = ((weight * logq) * mask).sum() / mask.sum()
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(gh.double(), h64.grad, rtol=1e-4, atol=1e-6)
    estimate = log_ratio if kind == "reverse_kl" else r * -log_ratio - r + 1
    divergence = float((estimate * mask).sum())
    assert stats.divergence_sum == pytest.approx(divergence, rel=1e-5)  # the estimate, not the surrogate


def test_config_refusals():
    with pytest.raises(ValueError, match="loss.mode=sampled estimates the reverse or forward KL"):
        LossConfig(kind="jsd", mode="sampled")
    with pytest.raises(ValueError, match="set loss.mode=sampled and loss.kind=forward_kl or reverse_kl"):
        LossConfig(mode="topk", cross_tokenizer="sampled")
    with pytest.raises(ValueError, match="loss.sampled_ratio_clip must be a finite number >= 0"):
        LossConfig(mode="sampled", kind="forward_kl", sampled_ratio_clip=-1.0)
    with pytest.raises(ValueError, match="the sampled loss estimates reverse_kl or forward_kl, not 'jsd'"):
        sampled_divergence(torch.zeros(2), torch.zeros(2), "jsd")
    LossConfig(mode="sampled", kind="forward_kl", cross_tokenizer="sampled")  # accepted
    with pytest.raises(ValueError, match="loss.fused_output=on cannot be used with loss.cross_tokenizer"):
        LossConfig(mode="sampled", cross_tokenizer="sampled", fused_output="on")
    with pytest.raises(ValueError, match="loss.weighting=teacher_confidence averages the teacher's per-token"):
        LossConfig(mode="sampled", cross_tokenizer="sampled", weighting="teacher_confidence")
    cfg = LossConfig(mode="sampled")
    assert (cfg.teacher_mode, cfg.teacher_topk) == ("topk", 1)


def _to_go_loop(values, mask, offset=None, segments=None):
    """Per token, the sum of ``values`` over its sample's trained positions from its group's first one (a loop)."""
    out = torch.zeros(values.shape, dtype=torch.float64)
    for row in range(values.shape[0]):
        for t in range(values.shape[1]):
            first = t + (0 if offset is None else int(offset[row, t]))
            same = [
                s for s in range(first, values.shape[1]) if segments is None or segments[row, s] == segments[row, t]
            ]
            out[row, t] = sum(float(values[row, s]) for s in same if mask[row, s] != 0)
    return out


def test_reward_to_go_stays_in_its_sample_and_starts_at_its_group():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(2, 9, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.float32)
    offset = torch.tensor([[0, 0, -1, 0, 0, -1, -2, 0, 0], [0, 0, 0, -1, 0, 0, 0, -1, 0]])
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1, 1]])
    for kwargs in ({}, {"group_offset_T": offset}, {"segment_ids_T": segments},
                   {"group_offset_T": offset, "segment_ids_T": segments}):  # fmt: skip
        want = _to_go_loop(values, mask, kwargs.get("group_offset_T"), kwargs.get("segment_ids_T"))
        torch.testing.assert_close(reward_to_go(values, mask, **kwargs), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cross", ["off", "sampled"])
def test_the_trainers_loss_with_the_reward_to_go(cross):
    """``loss.sampled_credit=to_go`` through ``make_loss_fn`` (the output layer kept: ``fused_output=auto``)
    against the float64 formula: each trained token weighted by the sum of its sample's later trained log-ratios
    (with 1:1 groups the same); the reported divergence is ``token``'s."""
    g = torch.Generator().manual_seed(7)
    b, s, h = 2, 6, 8
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    weight = torch.randn(V, h, generator=g)
    mask = torch.ones(b, s)
    mask[1, :2] = 0
    mask[0, 5] = 0
    mb = {"loss_mask": mask, "labels": torch.randint(0, VOCAB, (b, s), generator=g), "seq_weights": torch.ones(b),
          "teacher_label_logprobs": -torch.rand(b, s, generator=g) * 3}  # fmt: skip
    if cross == "sampled":
        mb["group_offset"] = torch.zeros(b, s, dtype=torch.int64)
    common = dict(vocab_size=VOCAB, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0)
    cfg = LossConfig(mode="sampled", cross_tokenizer=cross, sampled_credit="to_go")
    loss, stats = make_loss_fn(cfg, output=None, **common)(hidden @ weight.t(), mb)
    loss.backward()
    h64 = hidden.detach().double().requires_grad_()
    logq = torch.log_softmax((h64 @ weight.double().t())[..., :VOCAB], -1).gather(-1, mb["labels"][..., None])[..., 0]
    log_ratio = (logq - mb["teacher_label_logprobs"].double()).detach() * mask
    to_go = log_ratio.flip(-1).cumsum(-1).flip(-1)
    ref = (to_go * logq * mask).sum() / mask.sum()
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    assert stats.divergence_sum == pytest.approx(float(log_ratio.sum()), rel=1e-5)


def test_reward_to_go_refusals():
    for kwargs in (dict(mode="sampled", kind="forward_kl"), dict(mode="topk"),
                   dict(mode="topk", cross_tokenizer="aligned")):  # fmt: skip
        with pytest.raises(ValueError, match="loss.sampled_credit=to_go weighs each sampled token"):
            LossConfig(sampled_credit="to_go", **kwargs)
    with pytest.raises(ValueError, match="loss.fused_output=on cannot be used with loss.sampled_credit=to_go"):
        LossConfig(mode="sampled", sampled_credit="to_go", fused_output="on")
    with pytest.raises(ValueError, match="loss.sampled_credit must be token or to_go"):
        LossConfig(mode="sampled", sampled_credit="sequence")
    with pytest.raises(ValueError, match="to_go is the reverse KL's and needs the loss mask"):
        sampled_divergence(torch.zeros(2), torch.zeros(2), "forward_kl", credit="to_go", loss_mask_T=torch.ones(2))
    assert not fused_output_applies(LossConfig(mode="sampled", sampled_credit="to_go"))
    assert fused_output_applies(LossConfig(mode="sampled"))
