"""Losses under truncated sampling (``rollout.temperature`` / ``top_k`` / ``top_p``), in one process on hand-made
logits: the sampled losses' expected gradient by enumeration over a tiny vocabulary against the documented target
(the divergence's float64 autograd gradient less the terms of the tokens the sampler cannot draw), the staleness
weights (1 on fresh batches, the closed form on stale ones), ``loss.rollout_correction``'s four modes against loops
(padded and packed), and the config's acceptance and refusals. The sampler's recorded log-probabilities are checked
in ``test_sampler`` (two shards, and the built-in sampler at TP=1/TP=2)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.losses.importance import ROLLOUT_CORRECTIONS, rollout_correction_weights
from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.objective import make_loss_fn

V = 7  # the logits' width is 8: one padded column
TRUNCATED = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)  # the settings


def reference_drawn(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float64 log-probabilities of the distribution a sampler with ``params`` draws from (sorting, not the
    sampler's bit search): temperature, then the k largest, then the smallest prefix of the sorted tokens whose
    mass reaches ``top_p`` (ties kept together)."""
    z = logits_V[:V].double() / params.temperature
    if 0 < params.top_k < V:
        z = torch.where(z >= z.topk(params.top_k).values[-1], z, -math.inf)
    if params.top_p < 1.0:
        probs = torch.softmax(z, -1)
        above = torch.stack([probs[z > z[j]].sum() for j in range(V)])  # mass strictly more probable
        z = torch.where(above < params.top_p, z, -math.inf)
    return torch.log_softmax(z, -1)


def _one_token_loss(cfg, logits_V, label, teacher_lp, params):
    """The loss function's loss and gradient at one trained position whose label is ``label``."""
    logits = logits_V.clone()[None, None].requires_grad_(True)
    mb = {"loss_mask": torch.ones(1, 1), "labels": torch.tensor([[label]]), "seq_weights": torch.ones(1),
          "teacher_label_logprobs": torch.tensor([[teacher_lp]])}  # fmt: skip
    loss_fn = make_loss_fn(cfg, vocab_size=V, teacher_temperature=1.0, normalizer=1.0, scale=1.0, sampling=params)
    loss, stats = loss_fn(logits, mb)
    loss.backward()
    return logits.grad[0, 0].double(), stats.divergence_sum


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl"])
@pytest.mark.parametrize(
    "params",
    [TRUNCATED, SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(temperature=1.3, top_p=0.6)],
    ids=["t0.7-k20-p0.8", "t0.7", "k3", "t1.3-p0.6"],
)
def test_sampled_losses_expected_gradient_is_the_documented_target(kind, params):
    """``E_{y ~ pi}[grad loss(y)]`` over the tokens the sampler can draw equals the divergence's gradient less the
    terms of the tokens it cannot: ``grad KL - sum_{y outside pi's support} q(y) a(y) grad log q(y)`` with ``a = log
    q - log p`` (reverse KL) or ``1 - p/q`` (forward KL); with temperature alone the support is the whole vocabulary
    and the target is the gradient itself. The reported divergence's expectation is the same restricted sum."""
    gen = torch.Generator().manual_seed(0)
    logits_V = torch.cat([torch.randn(V, generator=gen, dtype=torch.float64) * 0.5, torch.tensor([0.0])])
    log_p = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), -1)
    drawn = reference_drawn(logits_V, params)
    support = torch.isfinite(drawn)
    assert 1 < int(support.sum()) and (params.top_k == 0 and params.top_p == 1.0 or int(support.sum()) < V)
    cfg = LossConfig(kind=kind, mode="sampled", sampled_ratio_clip=0.0, fused_output="off")
    expected = torch.zeros(V + 1, dtype=torch.float64)
    divergence = 0.0
    for y in support.nonzero()[:, 0].tolist():
        grad, div = _one_token_loss(cfg, logits_V.float(), y, float(log_p[y]), params)
        expected += drawn[y].exp() * grad
        divergence += float(drawn[y].exp()) * div
    z = logits_V.clone().requires_grad_(True)
    log_q = torch.log_softmax(z[:V], -1)
    kl = (log_q.exp() * (log_q - log_p)).sum() if kind == "reverse_kl" else (log_p.exp() * (log_p - log_q)).sum()
    (grad_kl,) = torch.autograd.grad(kl, z, retain_graph=True)
    q = log_q.detach().exp()
    a = (log_q.detach() - log_p) if kind == "reverse_kl" else 1 - log_p.exp() / q
    outside = ~support
    (grad_outside,) = torch.autograd.grad((q * a * log_q)[outside].sum(), z)  # sum_{y outside} q a grad log q
    target = grad_kl - grad_outside
    torch.testing.assert_close(expected, target, rtol=2e-4, atol=2e-6)
    if not outside.any():
        torch.testing.assert_close(expected, grad_kl, rtol=2e-4, atol=2e-6)
    else:
        assert (expected - grad_kl).abs().max() > 1e-3, "the excluded tokens' share is not visible: vacuous check"
    estimate = a * q if kind == "reverse_kl" else q * (log_p.exp() / q * -(log_q.detach() - log_p)) - log_p.exp() + q
    assert divergence == pytest.approx(float(estimate[support].sum()), rel=1e-4, abs=1e-6)


def _stale_batch(params: SamplingParams, drift: float):
    """Three samples of six positions: the trainer's logits, the sampler's (``drift`` away) and the labels drawn
    from the sampler's truncated distribution, with its log-probabilities (float64 reference) placed as the batch
    holds them."""
    gen = torch.Generator().manual_seed(4)
    B, S = 3, 6
    logits = torch.randn(B, S, V + 1, generator=gen) * 2
    old = logits + drift * torch.randn(B, S, V + 1, generator=gen)
    labels = torch.zeros(B, S, dtype=torch.int64)
    drawn_old = torch.zeros(B, S, dtype=torch.float64)
    drawn_new = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            lp = reference_drawn(old[b, s], params)
            labels[b, s] = int(torch.multinomial(lp.exp(), 1, generator=gen))
            drawn_old[b, s] = lp[labels[b, s]]
            drawn_new[b, s] = reference_drawn(logits[b, s], params)[labels[b, s]]
    mask = torch.ones(B, S)
    mask[1, :2] = 0
    teacher = torch.randn(B, S, V + 1, generator=gen) * 2
    return logits, teacher, labels, mask, drawn_old, drawn_new


def _dense_forward_kl(logits, teacher, mask):
    log_p, log_q = torch.log_softmax(teacher[..., :V].double(), -1), torch.log_softmax(logits[..., :V].double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1) * mask


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale"])
def test_staleness_weights_under_truncation_are_one_when_fresh_and_the_closed_form_when_stale(stale):
    """``loss.staleness_correction=prefix`` at temperature 0.7, top-k 20, top-p 0.8: each token's weight is
    ``min(prod_{s<t} pi_new(y_s) / pi_old(y_s), clip)`` with ``pi`` the truncated distributions (float64
    reference); a fresh batch (``pi_old = pi_new``) weighs 1 per token."""
    logits, teacher, labels, mask, drawn_old, drawn_new = _stale_batch(TRUNCATED, drift=0.5 if stale else 0.0)
    # The model's own log-probabilities at temperature 1 (what the fidelity monitor compares) stay as they are.
    raw = torch.log_softmax(logits[..., :V].double(), -1).gather(-1, labels[..., None])[..., 0].float()
    mb = {"loss_mask": mask, "labels": labels, "seq_weights": torch.ones(3), "rollout_logprobs": raw,
          "drawn_logprobs": drawn_old.float(), "teacher_logits": teacher}  # fmt: skip
    cfg = LossConfig(kind="forward_kl", mode="dense", staleness_correction="prefix", staleness_clip=1.2)
    loss_fn = make_loss_fn(cfg, vocab_size=V, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0,
                           sampling=TRUNCATED)  # fmt: skip
    loss, stats = loss_fn(logits.clone(), mb)
    d = torch.where(mask != 0, drawn_new - drawn_old, 0.0)
    weights = (d.cumsum(-1) - d).exp().clamp(max=1.2)
    trained = mask != 0
    if not stale:
        assert torch.equal(weights[trained], torch.ones(int(trained.sum()), dtype=torch.float64))
        assert stats.is_weight_sum == pytest.approx(float(trained.sum()), rel=1e-6)
    else:
        assert (weights[trained] - 1).abs().max() > 0.1 and (weights == 1.2).any(), (
            "weights too close to 1 or unclipped"
        )
        assert stats.is_weight_sum == pytest.approx(float(weights[trained].sum()), rel=1e-5)
    expected = (_dense_forward_kl(logits, teacher, mask) * weights).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def _loop_weights(d, mask, segments, mode, clip):
    """``loss.rollout_correction``'s weights, one token at a time (``segments``: each position's sample)."""
    out = torch.ones_like(d)
    for b in range(d.shape[0]):
        totals: dict[int, float] = {}
        for s in range(d.shape[1]):
            if mask[b, s]:
                totals[int(segments[b, s])] = totals.get(int(segments[b, s]), 0.0) + float(d[b, s])
        for s in range(d.shape[1]):
            r = math.exp(float(d[b, s]) if mode.startswith("token") else totals.get(int(segments[b, s]), 0.0))
            if mode.startswith("token") and not mask[b, s]:
                r = 1.0
            out[b, s] = min(r, clip) if mode.endswith("tis") else (r if r <= clip else 0.0)
    return out


@pytest.mark.parametrize("mode", [m for m in ROLLOUT_CORRECTIONS if m != "off"])
def test_rollout_correction_weights_against_a_loop_padded_and_packed(mode):
    gen = torch.Generator().manual_seed(7)
    trainer = -torch.rand(3, 7, generator=gen, dtype=torch.float64) * 3
    sampler = trainer + torch.randn(3, 7, generator=gen, dtype=torch.float64) * 0.4
    mask = torch.ones(3, 7)
    mask[0, :2], mask[1, 4], mask[1, 5:], mask[2, 4:] = 0, 0, 0, 0  # prompts, a tool token, padding
    rows = torch.arange(3)[:, None].expand(3, 7)
    expected = _loop_weights(trainer - sampler, mask, rows, mode, clip=1.3)
    got = rollout_correction_weights(trainer, sampler, mask, None, mode=mode, clip=1.3)
    trained = mask != 0
    torch.testing.assert_close(got.double()[trained], expected[trained], rtol=1e-6, atol=0)
    assert (expected[trained] == (0.0 if mode.endswith("mis") else 1.3)).any(), "the clip never applied"
    assert ((expected[trained] != 0) & (expected[trained] != 1.3)).any()
    lengths = [7, 5, 4]  # the same samples packed into one row: each segment its own sample
    row = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]  # noqa: E731
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = rollout_correction_weights(row(trainer), row(sampler), row(mask), segments, mode=mode, clip=1.3)
    torch.testing.assert_close(packed[row(mask) != 0], row(got)[row(mask) != 0], rtol=1e-6, atol=0)


def test_rollout_correction_weights_the_loss_with_the_truncated_ratios():
    """``token_tis`` at the issue's truncation: the loss is the per-token divergence times ``min(pi_new / pi_old,
    C)`` per token, from the trainer's truncated log-probabilities, not its raw ones."""
    logits, teacher, labels, mask, drawn_old, drawn_new = _stale_batch(TRUNCATED, drift=0.5)
    mb = {"loss_mask": mask, "labels": labels, "seq_weights": torch.ones(3), "teacher_logits": teacher,
          "rollout_logprobs": torch.zeros(3, 6), "drawn_logprobs": drawn_old.float()}  # fmt: skip
    cfg = LossConfig(kind="forward_kl", mode="dense", rollout_correction="token_tis", rollout_correction_clip=1.2)
    loss_fn = make_loss_fn(cfg, vocab_size=V, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0,
                           sampling=TRUNCATED)  # fmt: skip
    loss, _ = loss_fn(logits.clone(), mb)
    weights = (drawn_new - drawn_old).exp().clamp(max=1.2)
    expected = (_dense_forward_kl(logits, teacher, mask) * weights).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_the_config_accepts_truncated_sampling_and_refuses_what_it_cannot_correct():
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl", "rollout.temperature=0.7",
            "rollout.top_k=20", "rollout.top_p=0.8"]  # fmt: skip
    for ok in ("loss.staleness_correction=prefix", "loss.rollout_correction=sequence_mis"):
        parse_args(TrainConfig, [*base, ok]).validate()
        parse_args(TrainConfig, [*base, ok, "rollout.backend=vllm"]).validate()  # its engine records both
    refusals = (
        (["loss.staleness_correction=prefix", "rollout.backend=vllm", "rollout.address=h:1"], "processed_logprobs"),
        (
            ["loss.rollout_correction=token_tis", "rollout.backend=vllm", "rollout.max_new_tokens=1"],
            "max_new_tokens >= 2",
        ),
        (["loss.rollout_correction=token_tis", "loss.fused_output=on"], "loss.fused_output != on"),
        (["loss.rollout_correction=token_tis", "loss.rollout_correction_clip=0.5"], "must be a finite number >= 1"),
        (["loss.rollout_correction=tis"], "loss.rollout_correction"),
        (["loss.mode=sampled", "loss.sampled_credit=to_go"], "sampled_credit=to_go"),
    )
    for extra, match in refusals:
        with pytest.raises(ValueError, match=match):
            parse_args(TrainConfig, [*base, *extra]).validate()
