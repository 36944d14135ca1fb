"""``loss.support=union`` in the trainer: the rollout's student top-k ids reach the loss through packing and the
teacher request, a TP=2 run's first-step loss equals the union loss computed independently (float64, gathered
vocabulary, per token) from the same rollouts and teacher, the loss falls over a few steps, and what cannot work is
refused with the field to change.

Shape legend: ``N`` samples, ``S`` positions, ``V`` vocabulary, ``K`` teacher top-k, ``R`` student top-k.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.data.batch import pack, pack_rollouts
from megatron_opd.interfaces import Rollouts, SamplingParams
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.trainer.config import LossConfig
from tests.test_losses import reference_union

VOCAB = 1001  # padded to 1024 over TP=2: padding columns are in play
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16], [100, 3], [7, 8, 9, 10, 200]]
STEPS = 6


def _full_logits(chunks, tokens_NS: torch.Tensor) -> torch.Tensor:
    """``[N, S, padded V]`` logits of a forward-only pass, the TP shards gathered (test-side only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_opd.models.forward_backward import forward_backward

    def collect(logits_BSV: torch.Tensor, mb: dict):
        return logits_BSV.new_zeros(()), logits_BSV.detach().clone()

    (shard_NSV,) = forward_backward(chunks, [{"tokens": tokens_NS}], collect, forward_only=True)
    parts = [torch.empty_like(shard_NSV) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, shard_NSV.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _union_run_body(dirs: dict[str, str], loss_cfg: LossConfig, teacher_temperature: float):
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.stream import PromptStream
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.rollout.builtin import BuiltinSampler
    from megatron_opd.scheduler import Scheduler
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    parallel = ParallelConfig(tensor_model_parallel_size=2)
    initialize_distributed(parallel)
    optim = OptimConfig(lr=3e-3, clip_grad=1.0)
    student = Student(
        build_and_load(dirs["student"], parallel, trainable=True)[1], optim, precision_plan(optim, detect_accelerator("cpu")), STEPS
    )  # fmt: skip
    teacher_chunks = build_and_load(dirs["teacher"], parallel, trainable=False)[1]
    teacher = InProcessTeacher(
        teacher_chunks, vocab_size=VOCAB, mode="topk", topk=loss_cfg.topk, temperature=teacher_temperature
    )
    sampler = BuiltinSampler(student.chunks, vocab_size=VOCAB, max_seq_len=32, pad_token_id=0)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)  # greedy: the loss is a function of the weights
    data = PromptStream(PROMPTS, [{}] * len(PROMPTS), seed=0, shuffle=False, global_batch=len(PROMPTS))
    scheduler = Scheduler(
        "zero_step_off", sampler, teacher, sampling, 2, data=data, seed_for=lambda b: b, pad_token_id=0, max_len=32,
        student_topk=loss_cfg.union_student_topk,
    )  # fmt: skip
    losses, first = [], None
    for step in range(STEPS):
        scored = scheduler.next_batch(step)
        if step == 0:
            # What an independent computation needs: the rollouts, the teacher's scores, both models' full logits.
            first = {
                "rollouts": scored.rollouts,
                "topk_ids": scored.scores.topk_ids,
                "topk_logprobs": scored.scores.topk_logprobs,
                "student_logits": _full_logits(student.chunks, scored.batch.tokens),
                "teacher_logits": _full_logits(teacher_chunks, scored.batch.tokens),
                "seq_len": scored.batch.seq_len,
            }
        result = train_step(
            student, scored.batch, scored.scores, loss_cfg, vocab_size=VOCAB, teacher_temperature=1.0,
            micro_batch_size=4,
        )  # fmt: skip
        sampler.sync_weights(step + 1)
        losses.append(result.stats.loss)
    return losses, first


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, str]:
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("union_pair")
    return {
        "teacher": str(make_tiny_hf_model("qwen3", root / "teacher", seed=0, vocab_size=VOCAB)),
        "student": str(make_tiny_hf_model("qwen3", root / "student", seed=1, vocab_size=VOCAB, num_hidden_layers=2)),
    }


def _independent_union_loss(
    first: dict, cfg: LossConfig, teacher_temperature: float, student_ids: bool = True
) -> float:
    """The token-mean union loss of the first step from the rollouts, written per sample and response token
    (``student_ids=False``: the teacher-top-k support alone)."""
    rollouts: Rollouts = first["rollouts"]
    rows, t_ids, t_lp, s_ids, s_lp = [], [], [], [], []
    for i, (prompt, response) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids)):
        for j in range(response.numel()):
            pos = prompt.numel() - 1 + j  # the position whose logits sampled response token j
            teacher_logp_V = torch.log_softmax(
                first["teacher_logits"][i, pos, :VOCAB].double() / teacher_temperature, -1
            )
            ids_R = rollouts.topk_ids[i][j]
            rows.append(first["student_logits"][i, pos])
            t_ids.append(first["topk_ids"][i, pos])
            t_lp.append(first["topk_logprobs"][i, pos])
            s_ids.append(ids_R if student_ids else torch.full_like(ids_R, -1))
            s_lp.append(teacher_logp_V[ids_R])
    per_token = reference_union(
        torch.stack(rows).double(), torch.stack(t_ids), torch.stack(t_lp), torch.stack(s_ids), torch.stack(s_lp),
        cfg.kind, cfg.beta, cfg.tail, cfg.student_temperature, VOCAB, cfg.coverage_weight,
    )  # fmt: skip
    return float(per_token.mean())


def test_union_trains_at_tp2_and_its_first_loss_is_the_union_loss(pair) -> None:
    teacher_temperature = 0.5  # a sharper teacher than the random tiny models keeps the divergence O(1)
    cfg = LossConfig(
        kind="reverse_kl", mode="topk", topk=16, support="union", student_topk=8, coverage_weight=0.1,
        student_temperature=0.5,
    )  # fmt: skip
    per_rank = run_distributed(_union_run_body, 2, args=(pair, cfg, teacher_temperature), timeout=300)
    (losses, first), (losses_1, _) = per_rank
    assert losses == losses_1, "the TP ranks disagree on the loss"
    assert all(math.isfinite(x) for x in losses), losses
    rollouts = first["rollouts"]
    assert rollouts.topk_ids is not None and all(
        t.shape == (r.numel(), 8) for t, r in zip(rollouts.topk_ids, rollouts.response_ids)
    )
    # The student's recorded ids are the top-8 of its own logits where it sampled (KV cache vs full forward:
    # compared by value, so float ties cannot fail it), and some of them lie outside the teacher's top-16.
    outside = 0
    for i, (prompt, ids) in enumerate(zip(rollouts.prompt_ids, rollouts.topk_ids)):
        positions = torch.arange(ids.shape[0]) + prompt.numel() - 1
        logits_RV = first["student_logits"][i, positions, :VOCAB]
        torch.testing.assert_close(logits_RV.gather(-1, ids), logits_RV.topk(8, -1).values, rtol=0, atol=1e-4)
        outside += int((ids[:, :, None] != first["topk_ids"][i, positions][:, None, :]).all(-1).sum())
    assert outside > 0, "the union adds nothing to the teacher's top-k here: a vacuous test"
    expected = _independent_union_loss(first, cfg, teacher_temperature)
    assert abs(losses[0] - expected) <= 1e-5 * abs(expected), (losses[0], expected)
    teacher_topk_only = _independent_union_loss(first, cfg, teacher_temperature, student_ids=False)
    assert abs(teacher_topk_only - expected) > 1e-2 * abs(expected), "the student's ids change nothing here"
    assert losses[-1] < 0.9 * losses[0], f"the union loss does not fall: {losses}"


def test_train_cli_with_union_support(tmp_path) -> None:
    """The whole loop through the trainer's command at TP=2: the config reaches the scheduler (the rollout records the
    student's ids), every step's loss is finite, and evaluation (teacher-top-k support: its request has no student
    ids) runs."""
    from megatron_opd.testing.distill_fixture import make_distill_fixture
    from tests.test_train_cli import losses, run

    fixture = make_distill_fixture(tmp_path / "pair")
    overrides = {
        "parallel.tensor_model_parallel_size": 2, "train.steps": 3, "export_hf": False, "loss.mode": "topk",
        "loss.topk": 8, "loss.support": "union", "loss.student_topk": 4, "loss.coverage_weight": 0.1,
    }  # fmt: skip
    code, out = run(fixture.overrides(tmp_path / "run", **overrides), nproc=2)
    assert code == 0, out[-3000:]
    per_step = losses(tmp_path / "run")
    assert sorted(per_step) == [1, 2, 3] and all(math.isfinite(x) for x in per_step.values()), per_step
    assert "eval before training" in out and "eval after step 3" in out


# ----------------------------------------------------------------------------------------------- single process


def test_packing_places_student_ids_and_the_teacher_request() -> None:
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    responses = [torch.tensor([10, 11]), torch.tensor([12, 13, 14])]
    masks = [torch.ones(2), torch.tensor([1.0, 0.0, 1.0])]  # a tool token in the second response
    topk = [torch.tensor([[20, 21], [22, 23]]), torch.tensor([[24, 25], [26, 27], [28, 29]])]
    batch = pack(prompts, responses, masks, pad_token_id=0, seq_len=8, topk_ids=topk)
    ids_NSK = batch.student_topk_ids
    assert ids_NSK.shape == (2, 8, 2)
    # Position p - 1 + j predicts response token j; the tool token's ids are never used.
    assert ids_NSK[0, 2:4].tolist() == [[20, 21], [22, 23]]
    assert (
        ids_NSK[1, 1].tolist() == [24, 25] and ids_NSK[1, 2].tolist() == [-1, -1] and ids_NSK[1, 3].tolist() == [28, 29]
    )
    untrained = batch.loss_mask == 0
    assert (ids_NSK[untrained] == -1).all() and (ids_NSK[~untrained] >= 0).all()
    request_NSR = batch.teacher_request_ids()
    assert request_NSR.shape == (2, 8, 3)
    assert torch.equal(request_NSR[..., 0], batch.next_tokens())  # teacher-confidence weights read slot 0
    assert request_NSR[0, 2].tolist() == [10, 20, 21]
    assert request_NSR[1, 2].tolist() == [13, 13, 13]  # -1 slots ask for the predicted token again
    assert pack(prompts, responses, masks, pad_token_id=0).teacher_request_ids().shape[-1] == 1

    rollouts = Rollouts(prompts, responses, masks, [torch.zeros(2), torch.zeros(3)], ["stop"] * 2, [0, 1])
    with pytest.raises(ValueError, match="loss.support=union needs the student's top-2 ids .* returned none"):
        pack_rollouts(rollouts, pad_token_id=0, student_topk=2)
    rollouts.topk_ids = topk
    with pytest.raises(ValueError, match="returned 2 per token"):
        pack_rollouts(rollouts, pad_token_id=0, student_topk=3)
    assert pack_rollouts(rollouts, pad_token_id=0, student_topk=1).student_topk_ids.shape[-1] == 1
    with pytest.raises(ValueError, match="Rollouts.topk_ids has 1 entries"):
        Rollouts(prompts, responses, masks, [torch.zeros(2)] * 2, ["stop"] * 2, [0, 1], topk_ids=topk[:1])


def test_config_refuses_what_cannot_work() -> None:
    assert LossConfig(mode="topk", topk=32, support="union").union_student_topk == 32
    assert LossConfig(mode="topk", topk=32, support="union", student_topk=4).union_student_topk == 4
    assert LossConfig(mode="topk", student_topk=4).union_student_topk == 0
    cases = [
        (
            dict(support="union"),
            "loss.support=union is a top-k distillation loss .* loss.mode=dense.*set loss.mode=topk",
        ),
        (dict(support="union", kind="sft", mode="topk"), "loss.kind=sft"),
        (dict(coverage_weight=0.5), "loss.coverage_weight applies to top-k distillation"),
        (dict(mode="topk", coverage_weight=-1.0), "loss.coverage_weight must be a finite number >= 0"),
        (dict(mode="topk", student_topk=-1), "loss.student_topk must be >= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            LossConfig(**kwargs)


def test_a_teacher_without_requested_logprobs_is_refused_at_start_up() -> None:
    from megatron_opd.scheduler import Scheduler

    class TopkOnlyTeacher:
        supports_dense = False
        supports_requested_logprobs = False

    common = dict(data=None, seed_for=int, pad_token_id=0, max_len=8)
    with pytest.raises(ValueError, match="loss.support=union needs the teacher's log-probabilities .* TopkOnlyTeacher"):
        Scheduler("zero_step_off", None, TopkOnlyTeacher(), SamplingParams(), 1, student_topk=4, **common)
    scheduler = Scheduler("zero_step_off", None, TopkOnlyTeacher(), SamplingParams(), 1, **common)
    assert scheduler.sampling.return_topk == 0
