"""The rollout-fidelity monitor's parts in one process: the sampler's log-probs placed in the batch, the label's
log-prob read from the loss pass (every loss kind, support and student temperature) against a float64
full-vocabulary reference, the statistics, the stop rule, the defaults and the config refusal. The parallel layouts
are checked in ``test_train_step`` and the whole-run behaviour with vLLM in ``test_weight_sync_vllm``."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.data.batch import pack
from megatron_opd.losses.importance import importance_weights, prefix_log_ratios
from megatron_opd.rollout.fidelity import (
    RolloutMismatchError,
    check_step,
    default_max_logprob_diff,
    fidelity_metrics,
    fidelity_sums,
    policy_lag_warning,
)
from megatron_opd.trainer.config import LossConfig, RolloutConfig
from megatron_opd.trainer.objective import StepStats, make_loss_fn

V = 100  # the logits' width is 104: four padded columns


def test_pack_places_sampler_logprobs_at_the_predicting_position():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    responses = [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    masks = [torch.ones(2), torch.tensor([1.0, 0.0, 1.0])]  # the middle token of sample 1 is a tool token
    logprobs = [torch.tensor([-0.5, -1.5]), torch.tensor([-2.0, 0.0, -3.0])]
    batch = pack(prompts, responses, masks, pad_token_id=0, seq_len=8, logprobs=logprobs)
    expected = torch.zeros(2, 8)
    expected[0, 2:4] = torch.tensor([-0.5, -1.5])
    expected[1, 0:3] = torch.tensor([-2.0, 0.0, -3.0])
    assert torch.equal(batch.rollout_logprobs, expected)
    # Where the monitor reads (loss mask 1) the column holds the sampled token's value, the token it predicts.
    assert torch.equal(batch.next_tokens()[0, 2:4], responses[0])
    (mb,) = batch.micro_batches(2)
    assert torch.equal(mb["rollout_logprobs"], expected)
    with pytest.raises(ValueError, match="2 rollout log-probabilities for 3 response tokens"):
        pack(prompts, responses, masks, pad_token_id=0, logprobs=[logprobs[0], logprobs[0]])


def _reference_label_logprobs(logits_BSV, labels_BS):
    return torch.log_softmax(logits_BSV[..., :V].double(), dim=-1).gather(-1, labels_BS[..., None])[..., 0]


@pytest.mark.parametrize(
    "case",
    [
        dict(kind="forward_kl", mode="dense"),
        dict(kind="jsd", mode="dense", student_temperature=2.0),
        dict(kind="reverse_kl", mode="topk"),
        dict(kind="forward_kl", mode="topk", student_temperature=0.5),
        dict(kind="jsd", mode="topk", support="union"),
    ],
    ids=lambda c: "-".join(f"{v}" for v in c.values()),
)
def test_loss_pass_reads_the_label_logprob_at_temperature_one(case):
    gen = torch.Generator().manual_seed(0)
    B, S, K = 2, 6, 4
    logits = torch.randn(B, S, V + 4, generator=gen, dtype=torch.float32) * 3
    labels = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.ones(B, S)
    mask[1, :2] = 0
    reference = _reference_label_logprobs(logits, labels)
    sampler = reference + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.1
    mb = {"loss_mask": mask, "labels": labels, "seq_weights": torch.ones(B), "rollout_logprobs": sampler.float()}
    teacher = torch.randn(B, S, V + 4, generator=gen)
    if case["mode"] == "dense":
        mb["teacher_logits"] = teacher
    else:
        top = torch.log_softmax(teacher[..., :V], dim=-1).topk(K, dim=-1)
        mb["teacher_topk_ids"], mb["teacher_topk_logprobs"] = top.indices, top.values
        if case.get("support") == "union":
            mb["student_topk_ids"] = logits[..., :V].topk(2, dim=-1).indices
            mb["teacher_logprobs_at_student_ids"] = torch.log_softmax(teacher[..., :V], -1).gather(
                -1, mb["student_topk_ids"]
            )
    cfg = LossConfig(**case, topk=K)
    loss_fn = make_loss_fn(cfg, vocab_size=V, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0)
    _, stats = loss_fn(logits.clone().requires_grad_(False), mb)
    expected = fidelity_sums(reference, sampler.float(), mask)
    got = stats.as_dict()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=2e-5, abs=1e-6), name


def test_sums_and_metrics_match_their_definitions():
    gen = torch.Generator().manual_seed(1)
    trainer = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 4
    sampler = trainer + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.2
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    d = (trainer - sampler)[mask != 0]
    metrics = fidelity_metrics(fidelity_sums(trainer, sampler, mask))
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(float(d.abs().mean()))
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(float(d.abs().max()))
    assert metrics["rollout/logprob_diff_std"] == pytest.approx(float(d.abs().std(unbiased=False)))
    assert metrics["rollout/prob_ratio_mean"] == pytest.approx(float(d.exp().mean()))
    # k3 of KL(sampler || trainer) on the sampler's tokens: E[r - 1 - log r], r = p_trainer / p_sampler.
    assert metrics["rollout/kl_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert metrics["rollout/ppl_ratio"] == pytest.approx(
        math.exp(float(-trainer[mask != 0].mean())) / math.exp(float(-sampler[mask != 0].mean()))
    )
    assert fidelity_metrics(fidelity_sums(trainer, sampler, torch.zeros(3, 5))) == {}


def test_step_stats_reduce_sums_and_maxima():
    from megatron_opd.trainer.student import sum_stats

    a = StepStats(tokens=3, logprob_diff_abs_sum=0.3, logprob_diff_max=0.2)
    b = StepStats(tokens=2, logprob_diff_abs_sum=0.1, logprob_diff_max=0.05)
    total = sum_stats([a, b])
    assert (total.tokens, total.logprob_diff_abs_sum, total.logprob_diff_max) == (5, pytest.approx(0.4), 0.2)


def test_check_step_stops_fresh_batches_only():
    metrics = fidelity_metrics(fidelity_sums(torch.zeros(1, 4), torch.full((1, 4), -0.5), torch.ones(1, 4)))
    check_step(metrics, threshold=1.0, staleness=0)
    check_step(metrics, threshold=1e-3, staleness=1)  # asynchronous modes: includes policy drift, logged only
    check_step({}, threshold=1e-3, staleness=0)  # no sampler values (SFT): nothing to check
    with pytest.raises(RolloutMismatchError, match=r"by 0.5 nats per token.*max 0.5.*rollout.max_logprob_diff=0.001"):
        check_step(metrics, threshold=1e-3, staleness=0)
    with pytest.raises(RolloutMismatchError, match="weight sync"):
        check_step({**metrics, "rollout/logprob_diff_mean": float("nan")}, threshold=1.0, staleness=0)


def test_defaults_and_config():
    assert default_max_logprob_diff("torch.float32", "float32") == 1e-3
    assert default_max_logprob_diff("torch.float32", "bfloat16") == 0.1
    assert default_max_logprob_diff("torch.bfloat16", "torch.bfloat16") == 0.1
    assert RolloutConfig(max_logprob_diff=float("inf")).max_logprob_diff == float("inf")
    with pytest.raises(ValueError, match="rollout.max_logprob_diff must be > 0"):
        RolloutConfig(max_logprob_diff=0.0)


# ---- stale batches: the prefix importance weights and the correction ---------------------------------------------
def _loop_prefix(d, mask, inclusive):
    """Per sample, the sum of ``d`` over the trained positions before ``s`` (through ``s`` if ``inclusive``)."""
    out = torch.zeros_like(d, dtype=torch.float64)
    for b in range(d.shape[0]):
        total = 0.0
        for s in range(d.shape[1]):
            here = float(d[b, s]) if mask[b, s] else 0.0
            out[b, s] = total + here if inclusive else total
            total += here
    return out


@pytest.mark.parametrize("inclusive", [False, True], ids=["prefix", "through"])
def test_prefix_log_ratios_padded_and_packed_against_a_loop(inclusive):
    gen = torch.Generator().manual_seed(3)
    trainer = -torch.rand(3, 7, generator=gen, dtype=torch.float64) * 3
    sampler = trainer + torch.randn(3, 7, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.ones(3, 7)
    mask[0, :2], mask[1, 4], mask[2, 5:] = 0, 0, 0  # prompt positions, a tool token, padding
    expected = _loop_prefix(trainer - sampler, mask, inclusive)
    got = prefix_log_ratios(trainer, sampler, mask, inclusive=inclusive)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # The same samples packed into one row (THD): each segment starts from 0.
    lengths = [7, 5, 4]
    row = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]  # noqa: E731
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = prefix_log_ratios(row(trainer), row(sampler), row(mask), segments, inclusive=inclusive)
    torch.testing.assert_close(packed, row(expected), rtol=0, atol=1e-12)
    weights, truncated = importance_weights(got, clip=1.5)
    torch.testing.assert_close(weights.double(), expected.exp().clamp(max=1.5), rtol=1e-6, atol=0)
    assert torch.equal(truncated, expected.exp() > 1.5) and truncated.any() and not truncated.all()


def _forward_kl_reference(logits, teacher, mask):
    log_p = torch.log_softmax(teacher[..., :V].double(), -1)
    log_q = torch.log_softmax(logits[..., :V].double(), -1)
    return ((log_p.exp() * (log_p - log_q)).sum(-1)) * mask


@pytest.mark.parametrize("correction", ["off", "prefix"])
def test_staleness_correction_weights_each_token_by_its_prefix(correction):
    """The loss with ``loss.staleness_correction=prefix`` is the float64 per-token divergence times the clipped
    prefix weight from the trainer's own label log-probabilities; off, the loss is unweighted. The weights'
    statistics are logged either way."""
    gen = torch.Generator().manual_seed(5)
    B, S = 3, 6
    logits = torch.randn(B, S, V + 4, generator=gen) * 2
    teacher = torch.randn(B, S, V + 4, generator=gen) * 2
    labels = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.ones(B, S)
    mask[1, :2] = 0
    trainer_lp = _reference_label_logprobs(logits, labels)
    sampler = (trainer_lp + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.4).float()
    mb = {"loss_mask": mask, "labels": labels, "seq_weights": torch.ones(B), "rollout_logprobs": sampler,
          "teacher_logits": teacher}  # fmt: skip
    cfg = LossConfig(kind="forward_kl", mode="dense", staleness_correction=correction, staleness_clip=1.3)
    loss_fn = make_loss_fn(cfg, vocab_size=V, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0)
    loss, stats = loss_fn(logits.clone(), mb)
    weights = _loop_prefix(trainer_lp - sampler.double(), mask, inclusive=False).exp().clamp(max=1.3)
    per_token = _forward_kl_reference(logits, teacher, mask)
    expected = (per_token * (weights if correction == "prefix" else 1.0)).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert stats.is_weight_sum == pytest.approx(float(weights[mask != 0].sum()), rel=1e-5)
    assert stats.is_truncated_sum == float((weights[mask != 0] >= 1.3).sum()) > 0
    metrics = fidelity_metrics(stats.as_dict())
    assert metrics["staleness/is_weight_mean"] == pytest.approx(float(weights[mask != 0].mean()), rel=1e-5)
    assert metrics["staleness/is_weight_std"] == pytest.approx(float(weights[mask != 0].std(unbiased=False)), rel=1e-4)


def test_policy_lag_warning_and_the_correction_config():
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    row = {"staleness/policy_lag": 0.12, "staleness/is_truncated": 0.05}
    assert "lags them by 0.12 nats per token, 5.0% of" in policy_lag_warning(row, staleness=2, threshold=0.1)
    assert policy_lag_warning(row, staleness=2, threshold=0.2) is None
    assert policy_lag_warning(row, staleness=0, threshold=0.1) is None  # fresh batches: no lag to speak of
    assert policy_lag_warning(row, staleness=2, threshold=0.0) is None  # off
    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl", "loss.staleness_correction=prefix"]
    parse_args(TrainConfig, base).validate()
    for bad, match in (("rollout.temperature=0", "greedy decoding"),
                       ("loss.fused_output=on", "loss.fused_output != on"),
                       ("loss.staleness_clip=0.5", "must be >= 1")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_args(TrainConfig, [*base, bad]).validate()
    delayed = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl", "scheduler.sync_delay=2"]
    parse_args(TrainConfig, delayed).validate()
    for bad in ("rollout.backend=vllm", "scheduler.sync_delay=-1"):
        with pytest.raises(ValueError, match="scheduler.sync_delay=.* applies to distillation"):
            parse_args(TrainConfig, [*delayed, bad]).validate()
