"""Several teachers in one run (``teachers.*``): the typed config map and its refusals, routing records to teachers,
the scheduler's grouped concurrent requests (each sample scored by its own teacher; a killed and restarted teacher
server delays only its part and loses nothing), and the routed training step (two teachers that are the same model
equal one teacher; a top-k and a sampled teacher in one batch equal each part trained alone, token-weighted;
``loss.teacher_balance=per_teacher`` averages the teachers' means)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from megatron_opd.config import ConfigError, describe, load_config
from megatron_opd.data.records import DataError
from megatron_opd.data.routing import TeacherRouter
from megatron_opd.trainer.config import TrainConfig

BASE = ["student.path=s", "data.train_files=f.jsonl", "loss.mode=topk"]


def _config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*BASE, *overrides])


# ---- config ------------------------------------------------------------------------------------------------------
def test_teachers_are_a_typed_map_with_merged_losses(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "teachers:\n"
        "  math: {path: /m, loss: {weight: 2.0}}\n"
        "  chat: {backend: server, address: 'h:1', path: /c, loss: {mode: sampled, cross_tokenizer: sampled}}\n"
    )
    cfg = load_config(TrainConfig, path, [*BASE, "teachers.math.loss.topk=8", "teachers.chat.timeout_s=5"])
    cfg.validate()
    assert list(cfg.teachers) == ["math", "chat"] and cfg.teachers["chat"].timeout_s == 5.0
    views = cfg.teacher_views()
    assert (views["math"].loss.mode, views["math"].loss.topk, views["math"].teacher.path) == ("topk", 8, "/m")
    assert (views["chat"].loss.mode, views["chat"].loss.cross_tokenizer) == ("sampled", "sampled")
    assert views["chat"].loss.tail == cfg.loss.tail and views["chat"].teacher.backend == "server"
    assert cfg.teachers["math"].loss.weight == 2.0
    # Entries are typed: unknown keys and bad values name the entry.
    with pytest.raises(ConfigError, match=r"teachers\.math\.bogus"):
        _config("teachers.math.bogus=1")
    with pytest.raises(ConfigError, match=r"teachers\.math\.loss\.topk: expected an integer"):
        _config("teachers.math.loss.topk=many")
    with pytest.raises(ConfigError, match=r"teachers\.math\.loss.*weight must be a finite number > 0"):
        _config("teachers.math.loss.weight=0")
    help_text = "\n".join(describe(TrainConfig))
    for key in ("teachers.<NAME>.address", "teachers.<NAME>.loss.weight", "teachers.<NAME>.loss.cross_tokenizer",
                "data.teacher_key", "data.default_teacher", "loss.teacher_balance"):  # fmt: skip
        assert f"  {key} = " in help_text, key


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["teacher.path=/t", "teachers.a.path=/a"], r"teacher\.\* and teachers\.\* \(a\) are both set"),
        (["teachers.a.path=/a", "data.default_teacher=b"], r"data.default_teacher=b is none of teachers"),
        (["teachers.a.path=/a", "teachers.b.path=/b"], r"at most one teacher shares the student's ranks"),
        (["teachers.a.path=/a", "teachers.b.backend=server"], r"teachers\.b: teacher.address is required"),
        (["teachers.a.path=/a", "teachers.b.backend=server", "teachers.b.address=h:1", "teachers.b.loss.mode=dense"],
         r"teachers\.b: teacher.backend=server sends the teacher's top-k"),
        (["teachers.a.path=/a", "teachers.a.loss.cross_tokenizer=sampled"],
         r"teachers\.a\.loss merged over loss\.\*: loss.cross_tokenizer=sampled"),
        (["teachers.a/b.path=/a"], r"may hold letters, digits"),
        (["teacher.path=/t", "data.default_teacher=a"], r"apply to several teachers"),
        (["teachers.a.path=/a", "loss.kind=sft"], r"loss.kind=sft .* remove teachers"),
    ],
)  # fmt: skip
def test_bad_teacher_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(*overrides).validate()


def test_records_are_routed_by_their_field_or_refused_with_file_and_record(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in [{"prompt": "1", "teacher": "code"}, {"prompt": "2"}]) + "\n")
    assert TeacherRouter(["math", "code"], default="math").check_files([str(good)], "data.train_files") == {
        "math": 1,
        "code": 1,
    }
    with pytest.raises(DataError, match=r"good.jsonl record 1 has no 'teacher' field .*\['math', 'code'\]"):
        TeacherRouter(["math", "code"]).check_files([str(good)], "data.train_files")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1", "domain": "poetry"}) + "\n")
    with pytest.raises(DataError, match=r"data.eval_files: .*bad.jsonl record 0: domain='poetry' is none of"):
        TeacherRouter(["math", "code"], key="domain").check_files([str(bad)], "data.eval_files")


# ---- scheduler -----------------------------------------------------------------------------------------------------
def test_each_sample_is_scored_by_its_own_teacher_and_a_restarted_one_delays_only_its_part():
    """Two toy teacher servers (different weights) behind the real client; "code" dies at its first request and is
    restarted on its port a moment later. Every batch is scored exactly once per sample, by the sample's own teacher
    (its float64 top-k), and "math" answers while "code" is down."""
    from megatron_opd.data.stream import PromptStream
    from megatron_opd.interfaces import RoutedScores, SamplingParams
    from megatron_opd.scheduler.batch_schedule import RoutedTeacher, Scheduler
    from megatron_opd.teacher.client import TeacherClient
    from megatron_opd.teacher.server import ServerLimits
    from megatron_opd.teacher.zmq_transport import ZmqTransportFactory
    from megatron_opd.testing.scheduler_fakes import PolicyRollout
    from megatron_opd.testing.teacher_fakes import ThreadServer, ToyScorer

    limits = ServerLimits(max_topk=8, max_seq_len=64, max_batch_tokens=512, batch_wait_s=0.0)
    scorers = {"math": ToyScorer(vocab=120, width=128, seed=1), "code": ToyScorer(vocab=120, width=128, seed=2)}
    servers = {"math": ThreadServer(scorers["math"], limits=limits),
               "code": ThreadServer(scorers["code"], limits=limits, fault_at_request=1)}  # fmt: skip
    clients = {
        name: TeacherClient([s.address], ZmqTransportFactory(token=b"", max_message_bytes=1 << 20), topk=4,
                            timeout_s=1.0, retries=30, backoff_s=0.05, backoff_max_s=0.2, connect_timeout_s=10.0)
        for name, s in servers.items()
    }  # fmt: skip
    restarted = []

    def restart() -> None:
        servers["code"].wait_dead()
        time.sleep(0.5)  # "math" answers meanwhile
        restarted.append(ThreadServer(scorers["code"], port=servers["code"].port, limits=limits))

    prompts = [[3 + i, 4 + i, 5 + i] for i in range(12)]
    records = [{"teacher": "code"} if i % 3 == 0 else {} for i in range(12)]
    data = PromptStream(prompts, records, seed=0, shuffle=True, global_batch=4)
    router = TeacherRouter(["math", "code"], default="math")
    teachers = {name: RoutedTeacher(c) for name, c in clients.items()}
    rollout = PolicyRollout([])
    scheduler = Scheduler("zero_step_off", rollout, None, SamplingParams(max_new_tokens=3), 2, data=data,
                          seed_for=lambda b: b, pad_token_id=0, max_len=16, teachers=teachers, route=router)  # fmt: skip
    thread = threading.Thread(target=restart)
    thread.start()
    try:
        for step in range(3):
            scored = scheduler.next_batch(step)
            assert isinstance(scored.scores, RoutedScores)
            rows = sorted(r for part in scored.scores.parts for r in part.rows)
            assert rows == list(range(len(scored.rollouts)))  # every sample, once
            for part in scored.scores.parts:
                for j, row in enumerate(part.rows):  # each sample against its own teacher's float64 reference
                    expected = router(scored.items[scored.rollouts.prompt_index[row]].record)
                    assert part.name == expected
                    tokens = scored.batch.tokens[row : row + 1]
                    ref_values, ref_ids = scorers[part.name].logprobs(tokens).topk(4, dim=-1)
                    n = scored.batch.lengths[row] - 1  # positions that predict a real token
                    assert torch.equal(part.scores.topk_ids[j, :n], ref_ids[0, :n])
                    torch.testing.assert_close(part.scores.topk_logprobs[j, :n].double(), ref_values[0, :n],
                                               atol=1e-6, rtol=1e-6)  # fmt: skip
            if step == 0:  # the outage: "math"'s part came back while "code" was down
                assert scored.metrics["teacher/math/latency"] < 0.5 <= scored.metrics["teacher/code/latency"]
                assert scored.metrics["teacher/code/retries"] >= 1 and scored.metrics["teacher/math/retries"] == 0
            rollout.sync_weights(step + 1)
    finally:
        thread.join(30)
        for c in clients.values():
            c.close()
        for s in [*servers.values(), *restarted]:
            s.stop()
    assert restarted and clients["code"].stats["retries"] >= 1 and clients["math"].stats["retries"] == 0


def test_a_cross_tokenizer_teacher_scores_its_part_of_a_routed_batch_as_it_scores_alone(digit_tokenizers):
    """The re-tokenizer runs on the cross-tokenizer teacher's part only: its scores, groups and the tokens it cannot
    compare (cleared from the loss mask of the whole batch) equal the one-teacher scheduler's for those samples."""
    from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
    from megatron_opd.data.batch import pack_rollouts
    from megatron_opd.data.prompts import PromptEncoder
    from megatron_opd.data.stream import PromptStream
    from megatron_opd.interfaces import SamplingParams
    from megatron_opd.scheduler.batch_schedule import RoutedTeacher, Scheduler
    from megatron_opd.testing.scheduler_fakes import PolicyRollout, TokenTeacher

    student, teacher = digit_tokenizers["none"], digit_tokenizers["pairs"]
    records = [{"prompt": f"reverse {40912 + 7 * i} =", **({"teacher": "cross"} if i % 2 else {})} for i in range(8)]
    prompts = [PromptEncoder(student).prompt_ids(r, "test") for r in records]

    def run(**kwargs) -> list:
        rollout, batches = PolicyRollout([]), []
        data = PromptStream(prompts, records, seed=0, shuffle=True, global_batch=4)
        scheduler = Scheduler("zero_step_off", rollout, kwargs.pop("teacher", None), SamplingParams(max_new_tokens=4),
                              2, data=data, seed_for=lambda b: b, pad_token_id=0, max_len=64, **kwargs)  # fmt: skip
        for step in range(2):
            batches.append(scheduler.next_batch(step))
            rollout.sync_weights(step + 1)
        return batches

    def cross() -> CrossTokenizer:
        """A teacher that rewrites capitals (as a teacher that normalises text): such samples cannot be compared."""
        retokenizer = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,))
        retokenizer.teacher_tokenizer = lambda texts, **kw: teacher([t.lower() for t in texts], **kw)
        return retokenizer

    routed = run(teachers={"same": RoutedTeacher(TokenTeacher([])), "cross": RoutedTeacher(TokenTeacher([]), cross())},
                 route=TeacherRouter(["same", "cross"], default="same"))  # fmt: skip
    alone = run(teacher=TokenTeacher([]), retokenizer=cross())
    cleared = 0
    for got, ref in zip(routed, alone):
        part = {p.name: p for p in got.scores.parts}["cross"]
        rows = torch.tensor(part.rows)
        assert all(got.items[got.rollouts.prompt_index[r]].record.get("teacher") == "cross" for r in part.rows)
        assert torch.equal(got.batch.loss_mask[rows], ref.batch.loss_mask[rows])
        trained = ref.batch.loss_mask[rows] != 0
        assert torch.equal(
            part.scores.requested_logprobs[..., 0][trained], ref.scores.requested_logprobs[rows, :, 0][trained]
        )
        assert torch.equal(
            part.scores.extras["group_offset"][trained], ref.scores.extras["group_offset"][rows][trained]
        )
        packed = pack_rollouts(got.rollouts, pad_token_id=0, max_len=64).loss_mask
        cleared += int((packed[rows] != got.batch.loss_mask[rows]).sum())
        others = torch.tensor([r for r in range(len(got.rollouts)) if r not in part.rows])
        assert torch.equal(got.batch.loss_mask[others], packed[others])  # the same-tokenizer part: untouched
    assert cleared > 0  # some sampled bytes did not align: those tokens are not trained, in the whole batch


# ---- the routed training step ---------------------------------------------------------------------------------------
def _fixed_batch():
    from megatron_opd.data.batch import pack

    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for p_len, r_len in [(3, 9), (5, 4), (2, 12), (6, 7), (4, 5), (3, 3)]:
        prompts.append(torch.randint(0, 1000, (p_len,), generator=gen))
        responses.append(torch.randint(0, 1000, (r_len,), generator=gen))
    masks = [torch.ones(r.numel()) for r in responses]
    return pack(prompts, responses, masks, pad_token_id=0, seq_len=16)


def _routed_body(dirs: dict[str, str]):
    import dataclasses

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.interfaces import RoutedScores, TeacherPart
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import TeacherObjective, train_step
    from megatron_opd.trainer.student import Student, precision_plan

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    optim = OptimConfig(lr=1e-3, clip_grad=0.0)
    plan = precision_plan(optim, detect_accelerator("cpu"))
    teacher = InProcessTeacher(build_and_load(dirs["teacher"], parallel, trainable=False)[1], vocab_size=1000,
                               mode="topk", topk=16, temperature=0.1, micro_batch_size=2)  # fmt: skip
    full = _fixed_batch()

    def step(scores, cfg, batch=full, teachers=None, micro_batch_size=2):
        """A fresh student's step; returns (stats, its gradient, read before the optimizer applies it)."""
        student = Student(build_and_load(dirs["student"], parallel, trainable=True)[1], optim, plan, 10)
        grads = []

        def guard(_):
            grads.append(torch.cat([p.main_grad.reshape(-1).double() for p in student.model[0].module.parameters()]))

        result = train_step(student, batch, scores, cfg, vocab_size=1000, teacher_temperature=1.0,
                            micro_batch_size=micro_batch_size, guard=guard, teachers=teachers)  # fmt: skip
        return result.stats, grads[0]

    def score(rows):
        part = full.select(rows)
        return teacher.score(part.tokens, part.teacher_request_ids()).result()

    topk = LossConfig(kind="reverse_kl", mode="topk", topk=16)
    sampled = LossConfig(kind="reverse_kl", mode="sampled")
    a, b = [0, 2, 3], [1, 4, 5]
    routed = RoutedScores([TeacherPart("a", a, score(a)), TeacherPart("b", b, score(b))])
    out = {"one": step(score(list(range(6))), topk)}
    same = {"a": TeacherObjective(topk, 0.1), "b": TeacherObjective(topk, 0.1)}
    out["two"] = step(routed, topk, teachers=same)
    balanced = dataclasses.replace(topk, teacher_balance="per_teacher")
    out["balanced"] = step(
        routed, balanced, teachers={k: dataclasses.replace(t, loss=balanced) for k, t in same.items()}
    )
    mixed = {"a": TeacherObjective(topk, 0.1), "b": TeacherObjective(sampled, 0.1)}
    out["mixed"] = step(routed, topk, teachers=mixed)
    out["alone_a"] = step(routed.parts[0].scores, topk, batch=full.select(a), micro_batch_size=3)
    out["alone_b"] = step(routed.parts[1].scores, sampled, batch=full.select(b), micro_batch_size=3)
    out["tokens"] = {"a": float(full.select(a).loss_mask.sum()), "b": float(full.select(b).loss_mask.sum())}
    out.update(_mixed_tokenizers(dirs, teacher, step))
    return out


def _mixed_tokenizers(dirs: dict[str, str], teacher, step) -> dict:
    """A same-tokenizer top-k teacher (the in-process one) and a cross-tokenizer sampled teacher (digit pairs against
    the student's one token per digit; its scripted log-probabilities go through the real re-tokenizer) in one batch,
    the routed step on the unfused path (a cross-tokenizer loss keeps the output layer), and each part alone."""
    from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
    from megatron_opd.data.batch import pack_rollouts
    from megatron_opd.data.prompts import PromptEncoder
    from megatron_opd.interfaces import Rollouts, RoutedScores, TeacherPart, TeacherScores
    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.trainer.config import LossConfig
    from megatron_opd.trainer.objective import TeacherObjective

    student_tok, teacher_tok = load_tokenizer(dirs["none"]), load_tokenizer(dirs["pairs"])
    eos = student_tok.eos_token_id
    record = {"prompt": "reverse 40912 =", "answer": "21904"}
    prompt = PromptEncoder(student_tok).prompt_ids(record, "test")
    texts = ["21904", "7", "2190", "40912", "9", "123"]
    responses = [student_tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    rollouts = Rollouts(
        prompt_ids=[torch.tensor(prompt)] * 6, response_ids=[torch.tensor(r) for r in responses],
        response_mask=[torch.ones(len(r)) for r in responses], logprobs=[-torch.full((len(r),), 0.5) for r in responses],
        finish_reasons=["stop"] * 6, prompt_index=[0] * 6,
    )  # fmt: skip
    batch = pack_rollouts(rollouts, pad_token_id=eos)
    same, cross = [0, 2, 4], [1, 3, 5]
    a = batch.select(same)
    same_scores = teacher.score(a.tokens, a.teacher_request_ids()).result()
    retokenizer = CrossTokenizer(student_tok, teacher_tok, PromptEncoder(teacher_tok), (eos,))
    b = batch.select(cross)
    request = retokenizer.request(b, rollouts.select(cross), [record])
    lp = -torch.rand(*request.tokens.shape, 1, generator=torch.Generator().manual_seed(3)) * 2
    cross_scores = retokenizer.scores(TeacherScores(requested_logprobs=lp), request, b)
    batch.loss_mask[torch.tensor(cross)] = b.loss_mask
    topk = LossConfig(kind="reverse_kl", mode="topk", topk=16, fused_output="off")
    sampled = LossConfig(kind="reverse_kl", mode="sampled", cross_tokenizer="sampled")
    routed = RoutedScores([TeacherPart("same", same, same_scores), TeacherPart("cross", cross, cross_scores)])
    teachers = {"same": TeacherObjective(topk, 0.1), "cross": TeacherObjective(sampled)}
    return {
        "x_mixed": step(routed, topk, batch=batch, teachers=teachers),
        "x_same": step(same_scores, topk, batch=a, micro_batch_size=3),
        "x_cross": step(cross_scores, sampled, batch=b, micro_batch_size=3),
        "x_tokens": {"same": float(a.loss_mask.sum()), "cross": float(b.loss_mask.sum())},
        "x_groups": int((cross_scores.extras["group_offset"] != 0).sum()),
    }


@pytest.fixture(scope="module")
def routed_steps(tiny_model_dirs, tmp_path_factory):
    from megatron_opd.tasks import digits
    from megatron_opd.testing.multiprocess import run_distributed

    root = tmp_path_factory.mktemp("digit_tokenizers")
    dirs = {"student": tiny_model_dirs["llama"], "teacher": tiny_model_dirs["qwen2"],
            **{m: str(digits.make_tokenizer(root / m, digit_merges=m)) for m in ("none", "pairs")}}  # fmt: skip
    return run_distributed(_routed_body, 1, args=(dirs,), timeout=300)[0]


def test_two_teachers_that_are_the_same_model_equal_one_teacher(routed_steps):
    (one, g_one), (two, g_two) = routed_steps["one"], routed_steps["two"]
    assert abs(one.loss - two.loss) <= 1e-6 * abs(one.loss) and one.tokens == two.tokens
    torch.testing.assert_close(g_two, g_one, atol=1e-6, rtol=1e-6)
    tokens = routed_steps["tokens"]
    assert {k: t.tokens for k, t in two.teachers.items()} == tokens  # exact per-teacher counts
    assert sum(t.loss for t in two.teachers.values()) == pytest.approx(two.loss, rel=1e-9)
    assert g_one.abs().sum() > 0


def test_a_topk_and_a_sampled_teacher_in_one_batch_equal_each_part_alone(routed_steps):
    """``token_mean`` over the whole batch: each part's loss and gradient weighted by its share of the tokens."""
    (mixed, g_mixed), (a, g_a), (b, g_b) = routed_steps["mixed"], routed_steps["alone_a"], routed_steps["alone_b"]
    n_a, n_b = routed_steps["tokens"]["a"], routed_steps["tokens"]["b"]
    assert mixed.loss == pytest.approx((a.loss * n_a + b.loss * n_b) / (n_a + n_b), rel=1e-6)
    torch.testing.assert_close(g_mixed, (g_a * n_a + g_b * n_b) / (n_a + n_b), atol=1e-6, rtol=1e-5)
    for name, alone in (("a", a), ("b", b)):
        part = mixed.teachers[name]
        assert part.tokens == alone.tokens
        assert part.divergence_sum == pytest.approx(alone.divergence_sum, rel=1e-6)
        assert part.agree_sum == alone.agree_sum


def test_per_teacher_balance_averages_the_teachers_means(routed_steps):
    stats, _ = routed_steps["balanced"]
    means = [t.divergence_sum / t.tokens for t in stats.teachers.values()]  # topk: the loss is the divergence
    assert stats.loss == pytest.approx(sum(means) / 2, rel=1e-6)
    tokens = routed_steps["tokens"]
    assert tokens["a"] != tokens["b"]  # otherwise balancing would change nothing


def test_a_same_tokenizer_topk_and_a_cross_tokenizer_teacher_in_one_batch_equal_each_part_alone(routed_steps):
    """Each part against its one-teacher path (whose float64 references: tests/test_losses.py, test_sampled_loss.py)."""
    (mixed, g_mixed), (same, g_same), (cross, g_cross) = (routed_steps[k] for k in ("x_mixed", "x_same", "x_cross"))
    n_same, n_cross = routed_steps["x_tokens"]["same"], routed_steps["x_tokens"]["cross"]
    assert routed_steps["x_groups"] > 0  # the cross teacher's groups span several student tokens
    assert mixed.teachers["same"].tokens == n_same and mixed.teachers["cross"].tokens == n_cross > 0
    assert mixed.loss == pytest.approx((same.loss * n_same + cross.loss * n_cross) / (n_same + n_cross), rel=1e-6)
    torch.testing.assert_close(
        g_mixed, (g_same * n_same + g_cross * n_cross) / (n_same + n_cross), atol=1e-6, rtol=1e-5
    )
    assert mixed.teachers["cross"].divergence_sum == pytest.approx(cross.divergence_sum, rel=1e-6)
    assert g_cross.abs().sum() > 0 and g_same.abs().sum() > 0


def test_the_digit_sorting_task_of_the_multi_teacher_quick_start():
    from megatron_opd.tasks import digits

    held_out = digits.make_records(50, seed=1, task="sort")
    train = digits.make_records(200, seed=2, task="sort", exclude=[r["prompt"] for r in held_out])
    for r in held_out + train:
        word, number, equals = r["prompt"].split()
        assert (word, equals) == ("sort", "=") and r["answer"] == r["response"] == "".join(sorted(number))
    assert not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
    assert digits.make_records(3, seed=2)[0]["prompt"].startswith("reverse ")  # the default task is unchanged
    with pytest.raises(ValueError, match="task must be one of"):
        digits.make_records(1, seed=0, task="shuffle")


def test_per_teacher_stats_round_trip_and_leave_out_an_agreement_without_a_teacher_top1():
    """The per-teacher blocks survive the step's reduction vector in field order; a teacher with no top-1 (the sampled
    loss across tokenizers) gets no ``top1_agreement``, the others' is over the tokens where the teacher has one."""
    from megatron_opd.train import teacher_rows
    from megatron_opd.trainer.objective import StepStats, TeacherStats

    stats = StepStats(loss=1.5, agree_sum=3.0, top1_tokens=4.0, tokens=13.0, teachers={
        "math": TeacherStats(loss=1.0, divergence_sum=2.0, agree_sum=3.0, top1_tokens=4.0, tokens=8.0),
        "xtok": TeacherStats(loss=0.5, divergence_sum=1.0, tokens=5.0),
    })  # fmt: skip
    assert StepStats.from_tensor(stats.as_tensor(), teachers=("math", "xtok")) == stats
    row = teacher_rows(stats)
    assert row["teacher/math/top1_agreement"] == 0.75 and "teacher/xtok/top1_agreement" not in row
    assert row["teacher/xtok/divergence"] == 0.2 and row["teacher/xtok/tokens"] == 5.0
