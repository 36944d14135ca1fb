"""Packed micro-batches (``train.packing``, THD with ``cu_seqlens``) against the padded layout: the layout itself
(positions restart, per-token columns land on the same tokens, a token budget for pipeline parallelism), the
per-sequence reduction over segment ids, and in spawned jobs at TP=1, TP=2 with sequence parallelism and TP=2 x
PP=2, for samples of very different lengths: the same per-token losses and gradients (<= 1e-6 relative, fp32), and
three training steps from the same rollouts (a teacher's divergence, ``sequence_mean``, per-sequence weights) with
the same losses (<= 1e-5 relative; also the cross-tokenizer sampled and aligned losses, equal across layouts); the
in-process teacher's packed scoring (dense shards, top-k, requested ids) equals its padded scoring at every real
position. A teacher with a prompt of its own (``teacher.prompt_template``, the student's weights: self-distillation),
padded and packed: its scores at the student's response positions are transformers' after the longer prompt, and
with an empty privileged field the first step's divergence and loss are exactly 0 (its gradient norm < 1e-6; packed
at PP=2, whose micro-batches take other shapes than the teacher's, within rounding)."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.data.batch import pack
from megatron_opd.losses import reduce_loss
from megatron_opd.testing.multiprocess import run_distributed

LENGTHS = [(3, 57), (2, 5), (4, 1), (1, 30)]  # (prompt, response): 60, 7, 5 and 31 tokens


def _batch(vocab: int = 1000):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (p,), generator=gen) for p, _ in LENGTHS]
    responses = [torch.randint(0, vocab, (r,), generator=gen) for _, r in LENGTHS]
    masks = [torch.ones(r.numel()) for r in responses]
    masks[0][10:14] = 0  # tool tokens: never trained
    logprobs = [-3 - torch.rand(r.numel(), generator=gen) for r in responses]
    batch = pack(prompts, responses, masks, pad_token_id=0, seq_len=64, logprobs=logprobs)
    batch.seq_weights = torch.tensor([1.0, 0.5, 2.0, 1.5])
    return batch


def test_packed_layout_holds_the_padded_values_at_the_same_tokens():
    batch = _batch()
    extra = {"teacher_topk_ids": torch.arange(4 * 64 * 3).reshape(4, 64, 3)}
    padded = batch.micro_batches(2, extra)
    packed = batch.packed_micro_batches(2, extra, pad_multiple=4)
    assert len(packed) == len(padded) == 2
    for mb_pad, mb_pack, lengths in zip(padded, packed, ([60, 7], [5, 31])):
        total = -(-sum(lengths) // 4) * 4
        assert mb_pack["tokens"].shape == (1, total)
        assert mb_pack["cu_seqlens"].tolist() == [0, lengths[0], sum(lengths)] + (
            [total] if total > sum(lengths) else []
        )
        assert mb_pack["position_ids"][0, : sum(lengths)].tolist() == [*range(lengths[0]), *range(lengths[1])]
        for j, n in enumerate(lengths):
            lo = sum(lengths[:j])
            assert (mb_pack["segment_ids"][0, lo : lo + n] == j).all()
            assert (mb_pack["token_weights"][0, lo : lo + n] == mb_pad["seq_weights"][j]).all()
            for name in ("tokens", "loss_mask", "labels", "rollout_logprobs", "teacher_topk_ids"):
                assert torch.equal(mb_pack[name][0, lo : lo + n], mb_pad[name][j, :n]), name
        assert mb_pack["loss_mask"][0, sum(lengths) :].sum() == 0  # padding trains nothing
    assert sum(float(mb["loss_mask"].sum()) for mb in packed) == float(batch.loss_mask.sum())


def test_token_budget_for_pipeline_parallelism():
    batch = _batch()
    packed = batch.packed_micro_batches(2, token_budget=68)
    assert [mb["tokens"].shape for mb in packed] == [(1, 68)] * 2  # one shape for every stage
    assert [mb["cu_seqlens"].tolist() for mb in packed] == [[0, 60, 67, 68], [0, 5, 36, 68]]
    with pytest.raises(ValueError, match="a sequence of 60 tokens does not fit train.micro_batch_tokens=32"):
        batch.packed_micro_batches(2, token_budget=32)


def test_sequence_mean_over_segment_ids_equals_the_padded_rows():
    gen = torch.Generator().manual_seed(1)
    lengths = [6, 1, 9]
    loss = [torch.rand(n, generator=gen, dtype=torch.float64) for n in lengths]
    mask = [torch.randint(0, 2, (n,), generator=gen).double() for n in lengths]
    mask[1][:] = 0  # a sequence with nothing trained does not count
    padded_loss = torch.zeros(3, 9, dtype=torch.float64)
    padded_mask = torch.zeros(3, 9, dtype=torch.float64)
    for i, (v, m) in enumerate(zip(loss, mask)):
        padded_loss[i, : len(v)], padded_mask[i, : len(m)] = v, m
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    got = reduce_loss(torch.cat(loss)[None], torch.cat(mask)[None], "sequence_mean", segment_ids=segments)
    assert got == pytest.approx(float(reduce_loss(padded_loss, padded_mask, "sequence_mean")), rel=1e-12)


def _packed_vs_padded_body(layout: dict, dirs: dict[str, str]):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models import load_architecture
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.trainer.config import LossConfig

    parallel = ParallelConfig(**layout)
    initialize_distributed(parallel)
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    one_stage = ps.get_pipeline_model_parallel_world_size() == 1
    arch = load_architecture(dirs["student"])
    batch = _batch()

    # Per-token losses and gradients of one forward/backward, packed and padded.
    chunks = build_and_load(dirs["student"], parallel, trainable=True)[1]

    def per_token(logits, mb):
        ce = vocab_parallel_cross_entropy(logits.float(), mb["labels"]) * mb["loss_mask"]
        return ce.sum(), ce.detach()

    layouts = {
        "padded": batch.micro_batches(2, trim=one_stage, pad_multiple=8 * tp),
        "packed": batch.packed_micro_batches(2, pad_multiple=tp, token_budget=None if one_stage else 68),
    }
    grads, tokens = {}, {}
    for name, micro_batches in layouts.items():
        for chunk in chunks:
            chunk.zero_grad()
        outputs = forward_backward(chunks, micro_batches, per_token)
        for chunk in chunks:  # sequence-parallel norms: each TP rank holds its tokens' share
            for param in chunk.parameters():
                if getattr(param, "sequence_parallel", False) and param.grad is not None:
                    dist.all_reduce(param.grad, group=tp_group)
        grads[name] = full_tensors(chunks, arch, tp_group, of="grad")
        values = {}  # (sample, position) -> loss
        for index, (mb, out) in enumerate(zip(micro_batches, outputs)):
            if name == "padded":
                for j in range(out.shape[0]):
                    for s in range(out.shape[1]):
                        values[(2 * index + j, s)] = float(out[j, s])
            else:
                for t in range(out.shape[1]):
                    j = int(mb["segment_ids"][0, t])
                    if j < 2:  # not padding
                        values[(2 * index + j, int(mb["position_ids"][0, t]))] = float(out[0, t])
        tokens[name] = {k: v for k, v in values.items() if batch.loss_mask[k] != 0}

    # Teacher scoring, packed and padded: dense logit shards, and top-k with log-probs at requested ids.
    teacher_chunks = build_and_load(dirs["teacher"], parallel, trainable=False)[1]
    scored = {}
    for mode in ("dense", "topk"):
        for packing in (False, True):
            teacher = InProcessTeacher(teacher_chunks, vocab_size=1000, mode=mode, topk=16, micro_batch_size=2,
                                       packing=packing, micro_batch_tokens=None if one_stage else 68)  # fmt: skip
            scored[mode, packing] = teacher.score(batch.tokens, batch.teacher_request_ids(), batch.lengths).result()
    # A teacher with another tokenizer gets sequences of a length the student did not pad to a multiple of TP:
    # an odd length scores as the first positions of the longer batch (sequence parallelism pads it internally).
    odd = batch.tokens.shape[1] - 1 + batch.tokens.shape[1] % 2
    cut = teacher.score(batch.tokens[:, :odd], batch.teacher_request_ids()[:, :odd]).result()
    assert cut.topk_logprobs is None or cut.topk_logprobs.shape[1] == odd
    if cut.topk_logprobs is not None:  # the last pipeline stage
        for name in ("topk_logprobs", "requested_logprobs"):
            torch.testing.assert_close(
                getattr(cut, name), getattr(scored["topk", False], name)[:, :odd], atol=1e-5, rtol=1e-5
            )
    # Dense scores are hidden states and the output weight: h @ W^T is the model's own logit shard.
    logits = forward_backward(teacher_chunks, [{"tokens": batch.tokens}],
                              lambda out, mb: (out.new_zeros(()), out.detach().clone()), forward_only=True)  # fmt: skip
    if logits:
        from megatron_opd.trainer.objective import teacher_logits_of

        dense = scored["dense", False]
        formed = teacher_logits_of(dense.dense_hidden, dense.output_weight)
        torch.testing.assert_close(formed, logits[0], rtol=1e-5, atol=1e-5)

    # Three steps from the same rollouts, packed and padded (each with its own teacher scoring).
    cfg = LossConfig(kind="jsd", mode="dense", beta=0.3, reduction="sequence_mean")
    losses = {}
    for packing in (False, True):
        losses[packing] = step_losses(dirs["student"], parallel, batch, scored["dense", packing], cfg, 1000, packing, 3)
    # The sampled reverse KL over aligned groups of a teacher with another tokenizer (groups of 1 and 2 tokens).
    cfg = LossConfig(kind="reverse_kl", mode="sampled", cross_tokenizer="sampled")
    groups = _groups_of_two(batch)
    for packing in (False, True):
        losses["sampled", packing] = step_losses(dirs["student"], parallel, batch, groups, cfg, 1000, packing, 3)
    # The same weighted by the reward to go (each sample's later groups: packed rows hold several samples).
    cfg = LossConfig(kind="reverse_kl", mode="sampled", cross_tokenizer="sampled", sampled_credit="to_go")
    for packing in (False, True):
        losses["to_go", packing] = step_losses(dirs["student"], parallel, batch, groups, cfg, 1000, packing, 3)
    # The aligned loss: the mapped top-k where a group is one token on both sides, the sampled loss elsewhere.
    cfg = LossConfig(kind="jsd", mode="topk", topk=8, cross_tokenizer="aligned")
    aligned = _aligned_scores(batch, groups)
    for packing in (False, True):
        losses["aligned", packing] = step_losses(dirs["student"], parallel, batch, aligned, cfg, 1000, packing, 3)
    return grads, tokens, losses, scored, _own_prompt_checks(dirs, parallel, batch, one_stage)


HINTS = [[11, 12, 13], [], [14], [15, 16, 17, 18, 19]]
"""Each sample's privileged tokens before its prompt (``teacher.prompt_template``); one sample has none."""


class _HintEncoder:
    """The teacher's prompt of a test record: its ids as they are (``TemplatePromptEncoder``'s part is tested in
    ``test_teacher_prompt``)."""

    @staticmethod
    def prompt_ids(record, where):
        return record["ids"]


def _own_prompt_checks(dirs, parallel, batch, one_stage):
    """The student's own weights as the in-process teacher with a prompt of its own (``teacher.reprompt``), padded
    and packed: the scores it puts at the student's positions (checked against transformers in the test), and with
    every privileged field empty the first step's divergence, loss and gradient norm (all 0)."""
    from types import SimpleNamespace

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.teacher.reprompt import Reprompter
    from megatron_opd.trainer.config import LossConfig

    chunks = build_and_load(dirs["student"], parallel, trainable=False)[1]
    rollouts = SimpleNamespace(prompt_index=list(range(batch.num_samples)))
    prompts = [batch.tokens[i, : batch.prompt_lengths[i]].tolist() for i in range(batch.num_samples)]
    reprompter = Reprompter(_HintEncoder(), pad_token_id=0)
    out = {}
    cases = [("hints", "topk", False), ("hints", "topk", True), ("hints", "dense", True), ("empty", "dense", False),
             ("empty", "dense", True)]  # fmt: skip
    for hints, mode, packing in cases:
        records = [{"ids": (HINTS[i] if hints == "hints" else []) + p} for i, p in enumerate(prompts)]
        request = reprompter.request(batch, rollouts, records)
        teacher = InProcessTeacher(chunks, vocab_size=1000, mode=mode, topk=4, micro_batch_size=2, packing=packing,
                                   micro_batch_tokens=None if one_stage else 68)  # fmt: skip
        scores = teacher.score(request.tokens, request.request_ids, request.lengths).result()
        out[hints, mode, packing] = (request.tokens, Reprompter.scores(scores, request, batch))
    firsts = {}
    cfg = LossConfig(kind="forward_kl", mode="dense")
    for packing in (False, True):
        firsts[packing] = _first_step(dirs["student"], parallel, batch, out["empty", "dense", packing][1], cfg, packing)
    return out, firsts


def _first_step(hf_dir, parallel, batch, scores, cfg, packing):
    """Step 1 of a fresh student from ``hf_dir`` on ``batch``: (loss, divergence summed over tokens, grad norm)."""
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    optim = OptimConfig(lr=1e-3)
    student = Student(build_and_load(hf_dir, parallel, trainable=True)[1], optim,
                      precision_plan(optim, detect_accelerator("cpu")), 10)  # fmt: skip
    one_stage = ps.get_pipeline_model_parallel_world_size() == 1
    result = train_step(student, batch, scores, cfg, vocab_size=1000, teacher_temperature=1.0, micro_batch_size=2,
                        packing=packing, micro_batch_tokens=None if one_stage else 68)  # fmt: skip
    return result.stats.loss, result.stats.divergence_sum, result.grad_norm


def _assert_own_prompt_scores(own, student_dir: str, layout: str) -> None:
    """The teacher's scores at the student's positions are transformers' on the teacher's own sequence (hint +
    prompt + response), read at the teacher's positions of the same response tokens; with no hint, at the same."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student_dir).float().eval()
    batch = _batch()
    scored, firsts = own
    for (hints, mode, packing), (tokens, scores) in scored.items():
        if scores.requested_logprobs is None:  # not the last pipeline stage
            return
        for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.lengths)):
            shift = len(HINTS[i]) if hints == "hints" else 0
            assert torch.equal(tokens[i, p + shift : n + shift], batch.tokens[i, p:n]), "the response moved"
            with torch.no_grad():
                logits = model(tokens[i : i + 1, : n + shift]).logits[0, p + shift - 1 : n + shift - 1, :1000]
            ref = torch.log_softmax(logits.double(), -1)
            labels = batch.tokens[i, p:n]
            what = f"{layout} {hints} {mode} packing={packing} sample {i}"
            got = scores.requested_logprobs[i, p - 1 : n - 1, 0].double()
            torch.testing.assert_close(got, ref.gather(-1, labels[:, None])[:, 0], atol=2e-5, rtol=1e-5, msg=what)
            if mode == "topk":
                ids = scores.topk_ids[i, p - 1 : n - 1]
                torch.testing.assert_close(scores.topk_logprobs[i, p - 1 : n - 1].double(), ref.gather(-1, ids),
                                           atol=2e-5, rtol=1e-5, msg=what)  # fmt: skip
                torch.testing.assert_close(ref.gather(-1, ids), ref.topk(4, -1).values, atol=2e-5, rtol=0, msg=what)
    for packing, (loss, divergence, grad_norm) in firsts.items():  # the gradient's q - p rounds apart: ~3e-8
        if layout == "tp2_pp2" and packing:  # micro-batches of other shapes than the teacher's: rounding, ~3e-6
            assert abs(loss) < 1e-6 and abs(divergence) < 1e-5 and grad_norm < 1e-6, f"{layout}: {firsts}"
        else:
            assert (loss, divergence) == (0.0, 0.0) and grad_norm < 1e-6, f"{layout} packing={packing}: {firsts}"


def _groups_of_two(batch):
    """Cross-tokenizer scores: consecutive trained tokens paired into groups, a group's log p at both its tokens."""
    from megatron_opd.interfaces import TeacherScores

    logp = -torch.rand(batch.tokens.shape, generator=torch.Generator().manual_seed(3)) * 4
    offset = torch.zeros(batch.tokens.shape, dtype=torch.int64)
    trained = batch.loss_mask != 0
    for i, j in trained.nonzero().tolist():
        if j > 0 and trained[i, j - 1] and offset[i, j - 1] == 0 and (j % 3):  # pairs, some tokens alone
            offset[i, j] = -1
            logp[i, j] = logp[i, j - 1]
    return TeacherScores(requested_logprobs=logp[..., None], extras={"group_offset": offset})


def _aligned_scores(batch, groups):
    """``loss.cross_tokenizer=aligned`` scores on ``groups``: single-token groups take a mapped top-k of 8 (some
    slots empty: teacher ids without a student twin), the pairs keep their sampled group values."""
    from megatron_opd.interfaces import TeacherScores

    g = torch.Generator().manual_seed(4)
    n, s = batch.tokens.shape
    offset = groups.extras["group_offset"]
    single = (batch.loss_mask != 0) & (offset == 0) & (torch.cat([offset[:, 1:], offset[:, :1]], dim=1) == 0)
    logprobs, ids = torch.log_softmax(torch.randn(n, s, 1000, generator=g) * 3, dim=-1).topk(8, dim=-1)
    support = torch.rand(n, s, 8, generator=g) > 0.25
    support[..., 0] = True
    extras = dict(groups.extras, aligned_mask=single, teacher_topk_support=support)
    return TeacherScores(topk_ids=ids, topk_logprobs=logprobs, requested_logprobs=groups.requested_logprobs,
                         extras=extras)  # fmt: skip


def step_losses(hf_dir: str, parallel, batch, scores, cfg, vocab: int, packing: bool, steps: int) -> list[float]:
    """The losses of ``steps`` training steps of a fresh student from ``hf_dir`` on ``batch`` (micro-batches of 2
    samples; with PP, packed ones of 68 tokens)."""
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    optim = OptimConfig(lr=1e-3, clip_grad=0.5)
    student = Student(build_and_load(hf_dir, parallel, trainable=True)[1], optim,
                      precision_plan(optim, detect_accelerator("cpu")), 10)  # fmt: skip
    one_stage = ps.get_pipeline_model_parallel_world_size() == 1
    return [
        train_step(
            student,
            batch,
            scores,
            cfg,
            vocab_size=vocab,
            teacher_temperature=1.0,
            micro_batch_size=2,
            packing=packing,
            micro_batch_tokens=None if one_stage else 68,
        ).stats.loss  # fmt: skip
        for _ in range(steps)
    ]


def _assert_scores_equal_at_real_positions(scored: dict, layout: str) -> None:
    """Packed teacher scores equal the padded ones at every real position (padding scores anything valid)."""
    lengths = _batch().lengths
    for (mode, packing), scores in scored.items():
        if not packing:
            continue
        ref = scored[mode, False]
        names = ["requested_logprobs"] + (["dense_hidden"] if mode == "dense" else ["topk_logprobs"])
        for row, n in enumerate(lengths):
            for name in names:
                what = f"{layout} {mode} {name} row {row}:"
                got, want = getattr(scores, name)[row, :n], getattr(ref, name)[row, :n]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, w=what: f"{w} {m}")
            if mode == "topk":  # the packed ids hold the padded log-probabilities (any order among ties)
                want_SV = torch.full((n, 1000), -torch.inf).scatter(
                    -1, ref.topk_ids[row, :n], ref.topk_logprobs[row, :n]
                )
                torch.testing.assert_close(want_SV.gather(-1, scores.topk_ids[row, :n]), scores.topk_logprobs[row, :n],
                                           atol=1e-5, rtol=1e-5)  # fmt: skip
        assert torch.isfinite(scores.requested_logprobs).all()  # padding positions hold valid values too


_CROSS_LOSSES: dict[tuple[str, str], list[float]] = {}
"""The cross-tokenizer losses (sampled, aligned, sampled with the reward to go) per layout: every layout's must equal TP=1's (run first)."""
LAYOUTS = {
    "tp1": (1, dict()),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_padded(layout, tmp_path):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    dirs = {
        "teacher": str(make_tiny_hf_model("qwen3", tmp_path / "teacher", seed=0)),
        "student": str(make_tiny_hf_model("llama", tmp_path / "student", seed=1, num_hidden_layers=2)),
    }
    world, kwargs = LAYOUTS[layout]
    results = run_distributed(_packed_vs_padded_body, world, args=(kwargs, dirs), timeout=400)
    grads = {"padded": {}, "packed": {}}
    for rank_grads, tokens, losses, scored, own in results:
        _assert_own_prompt_scores(own, dirs["student"], layout)
        for name in grads:
            grads[name].update(rank_grads[name])
        if tokens["padded"]:  # the last pipeline stage
            assert set(tokens["packed"]) == set(tokens["padded"]) and len(tokens["padded"]) == 89  # every trained one
            for key, ref in tokens["padded"].items():
                assert tokens["packed"][key] == pytest.approx(ref, rel=1e-6, abs=1e-6), f"{layout}: token {key}"
        if scored["topk", False].topk_ids is not None:  # the last pipeline stage
            _assert_scores_equal_at_real_positions(scored, layout)
        assert losses[True] == pytest.approx(losses[False], rel=1e-5), f"{layout}: {losses}"
        assert losses["aligned", False][0] != pytest.approx(losses["sampled", False][0]), "no top-k position taken"
        assert losses["to_go", False][0] != pytest.approx(losses["sampled", False][0]), "to_go weighs as token"
        for cross in ("sampled", "aligned", "to_go"):
            steps = losses[cross, True]
            assert steps == pytest.approx(losses[cross, False], rel=1e-5), f"{layout} {cross}: {losses}"
            _CROSS_LOSSES.setdefault((cross, layout), steps)
            if (cross, "tp1") in _CROSS_LOSSES:  # the layouts agree (tp1 runs first)
                assert steps == pytest.approx(_CROSS_LOSSES[cross, "tp1"], rel=1e-5), f"{layout}: {_CROSS_LOSSES}"
        assert losses[False][2] < losses[False][0], "the steps did not train"
    assert set(grads["packed"]) == set(grads["padded"])
    for name, ref in grads["padded"].items():
        assert ref.abs().max() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        rel = float((grads["packed"][name] - ref).abs().max() / ref.abs().max())
        assert rel <= 1e-6, f"{layout}: gradient of {name} differs by {rel:.2e} (relative to its largest entry)"


def test_a_teacher_sample_longer_than_the_token_budget_gets_a_micro_batch_of_its_length(monkeypatch):
    """A cross-tokenizer teacher's rows follow its own tokenization: one longer than ``train.micro_batch_tokens``
    (which bounds the student's samples) is scored in micro-batches of its length, not refused mid-run."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from megatron_opd.teacher.inprocess import InProcessTeacher

    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    teacher = SimpleNamespace(micro_batch_tokens=16, micro_batch_size=2)
    lengths = [5, 21, 9]
    tokens = torch.arange(3 * 21).reshape(3, 21)
    micro_batches = InProcessTeacher._packed(teacher, tokens, None, lengths)
    assert {mb["tokens"].shape[-1] for mb in micro_batches} == {22}  # 21 rounded up to TP: one shape per call
    assert sorted(int(n) for mb in micro_batches for n in mb["sequence_lengths"]) == sorted(lengths)
    assert InProcessTeacher._packed(teacher, tokens[:, :9], None, [5, 9, 9])[0]["tokens"].shape[-1] == 16
