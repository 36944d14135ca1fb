"""Re-tokenization for a teacher with another tokenizer (``loss.cross_tokenizer=sampled``), in the data path.

The quick start's two tokenizers: one token per digit (the teacher's) and one per pair of digits (the student's).
The teacher's view of a student batch (its prompt from the record, the response re-tokenized, its EOS where the
student stopped), the group sums mapped back to the student's positions against sums written out by hand, the
identical-tokenizer case (every group 1:1, the teacher's own per-token log-probabilities), and a sample whose text
cannot be aligned (not trained on, counted).
"""

from __future__ import annotations

import pytest
import torch

from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
from megatron_opd.data.batch import pack_rollouts
from megatron_opd.data.prompts import PromptEncoder
from megatron_opd.interfaces import Rollouts, TeacherScores


@pytest.fixture(scope="module")
def tokenizers(digit_tokenizers):
    return digit_tokenizers["none"], digit_tokenizers["pairs"]


@pytest.fixture(scope="module")
def doubles(digit_tokenizers):
    """A tokenizer with a token for each doubled digit ("33"): the cross-tokenizer quick start's teacher."""
    return digit_tokenizers["doubles"]


def _batch(student, texts: list[str], eos: bool = True, extra: list[list[int]] | None = None):
    """Rollouts of the prompt ``reverse 40912 =`` answered with ``texts`` (student ids), packed."""
    record = {"prompt": "reverse 40912 =", "answer": "21904"}
    prompt = PromptEncoder(student).prompt_ids(record, "test")
    responses = [student(t, add_special_tokens=False)["input_ids"] + ([student.eos_token_id] if eos else [])
                 for t in texts] + (extra or [])  # fmt: skip
    n = len(responses)
    rollouts = Rollouts(
        prompt_ids=[torch.tensor(prompt)] * n,
        response_ids=[torch.tensor(r) for r in responses],
        response_mask=[torch.ones(len(r)) for r in responses],
        logprobs=[-torch.full((len(r),), 0.5) for r in responses],
        finish_reasons=["stop"] * n,
        prompt_index=[0] * n,
    )
    return pack_rollouts(rollouts, pad_token_id=student.eos_token_id), rollouts, [record]


def test_groups_of_digit_pairs_against_sums_by_hand(tokenizers):
    teacher, student = tokenizers
    cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,))
    batch, rollouts, records = _batch(student, ["21904", "7"])
    mask_before = batch.loss_mask.clone()
    request = cross.request(batch, rollouts, records)
    t_prompt = PromptEncoder(teacher).prompt_ids(records[0], "test")
    digit_ids = teacher("21904", add_special_tokens=False)["input_ids"]
    assert request.tokens[0, : request.lengths[0]].tolist() == t_prompt + digit_ids + [teacher.eos_token_id]
    assert torch.equal(batch.loss_mask, mask_before)  # every student token has a teacher partner here
    lp = -torch.rand(request.tokens.shape[0], request.tokens.shape[1], 1, generator=torch.Generator().manual_seed(0))
    scores = cross.scores(TeacherScores(requested_logprobs=lp), request, batch)
    # Sample 0: student "2" "19" "04" EOS against teacher "2" "1" "9" "0" "4" EOS.
    s_first, t_first = batch.prompt_lengths[0] - 1, len(t_prompt) - 1
    groups = [(1, 1), (1, 2), (1, 2), (1, 1)]  # (student tokens, teacher tokens) per group
    s_pos, t_pos = s_first, t_first
    assert [len(student.decode([i])) for i in batch.tokens[0, s_first + 1 : s_first + 4]] == [1, 2, 2]
    for n_s, n_t in groups:
        want = float(lp[0, t_pos : t_pos + n_t, 0].double().sum())
        got = scores.requested_logprobs[0, s_pos : s_pos + n_s, 0]
        assert torch.allclose(got.double(), torch.full((n_s,), want, dtype=torch.float64)), (s_pos, n_s, n_t)
        assert scores.extras["group_offset"][0, s_pos : s_pos + n_s].tolist() == [-k for k in range(n_s)]
        s_pos, t_pos = s_pos + n_s, t_pos + n_t
    assert request.metrics["cross_tokenizer/unaligned_samples"] == 0
    assert request.metrics["cross_tokenizer/mean_group_teacher_tokens"] > 1.0
    assert request.metrics["cross_tokenizer/one_to_one_share"] < 1.0
    # log p(teacher tokens) - log q(student tokens) (the sampler's, -0.5 each), averaged over the two samples.
    t_first1 = request.teacher_prompt_lengths[1] - 1
    ratio0 = float(lp[0, t_first : t_first + 6, 0].double().sum()) + 0.5 * 4
    ratio1 = float(lp[1, t_first1 : t_first1 + 2, 0].double().sum()) + 0.5 * 2
    assert request.metrics["cross_tokenizer/sequence_log_ratio"] == pytest.approx((ratio0 + ratio1) / 2, rel=1e-9)


def test_identical_tokenizers_give_one_to_one_groups_and_the_teachers_own_scores(tokenizers):
    teacher, _ = tokenizers
    cross = CrossTokenizer(teacher, teacher, PromptEncoder(teacher), (teacher.eos_token_id,))
    batch, rollouts, records = _batch(teacher, ["21904", "19", "0"])
    request = cross.request(batch, rollouts, records)
    assert torch.equal(request.tokens, batch.tokens[:, : request.tokens.shape[1]])
    assert request.metrics["cross_tokenizer/one_to_one_share"] == 1.0
    lp = -torch.rand(*request.tokens.shape, 1, generator=torch.Generator().manual_seed(1))
    scores = cross.scores(TeacherScores(requested_logprobs=lp), request, batch)
    w = lp.shape[1]
    trained = batch.loss_mask != 0
    assert not trained[:, w:].any()  # the batch is padded further; nothing trained there
    assert torch.equal(scores.requested_logprobs[:, :w, 0][trained[:, :w]], lp[..., 0][trained[:, :w]])
    assert scores.extras["group_offset"].abs().max() == 0


def test_invalid_utf8_aligns_as_the_replacement_character_and_a_mismatch_is_not_trained_on(tokenizers):
    """A random student samples stray bytes: "â" alone (the first byte of "€") is not text. The teacher reads U+FFFD
    there, and the student's byte forms one group with the teacher's tokens of it, so even such a sample teaches
    (a student that could not be compared on it would never learn to avoid it). Texts that do not match (a teacher
    that rewrites text) leave the sample out of the loss, counted."""
    teacher, student = tokenizers
    cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,))
    half_euro = [student.convert_tokens_to_ids("â")]
    batch, rollouts, records = _batch(student, ["21904"], extra=[half_euro + student("19")["input_ids"]])
    request = cross.request(batch, rollouts, records)
    replacement = teacher("\ufffd19", add_special_tokens=False)["input_ids"]
    t_prompt = request.teacher_prompt_lengths[1]
    assert request.tokens[1, t_prompt : request.lengths[1]].tolist() == replacement
    # The decoder emits U+FFFD only when "1" shows "â" was not the start of a character: one group "â19" <-> "�19".
    groups = request.alignments[1].groups
    assert [(g.student, g.teacher) for g in groups] == [((0, 2), (0, len(replacement)))]
    assert request.metrics["cross_tokenizer/unaligned_samples"] == 0
    assert batch.loss_mask[1].sum() == 2  # both student tokens are trained

    cross.teacher_tokenizer = lambda texts, **kw: teacher([t.replace("9", "8") for t in texts], **kw)  # rewrites
    batch, rollouts, records = _batch(student, ["21904", "7"])
    request = cross.request(batch, rollouts, records)
    assert request.alignments[0] is None and request.metrics["cross_tokenizer/unaligned_samples"] == 1.0
    assert batch.loss_mask[0].sum() == 0 and batch.loss_mask[1].sum() > 0


def test_a_stray_byte_before_eos_keeps_eos_paired_and_one_vocabulary_is_not_retokenized(tokenizers):
    """ "3", "ó" (a lone UTF-8 lead byte), EOS: the pending byte flushes as U+FFFD into "ó"'s group, not into the EOS,
    which still pairs with the teacher's EOS. With one vocabulary the teacher scores the sampled ids themselves
    (a non-canonical split such as "Ġ" "=" instead of "Ġ=" stays as sampled)."""
    teacher, student = tokenizers
    cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,))
    stray = [student.convert_tokens_to_ids(t) for t in ("3", "ó")] + [student.eos_token_id]
    batch, rollouts, records = _batch(student, [], extra=[stray])
    request = cross.request(batch, rollouts, records)
    replacement = teacher("3\ufffd", add_special_tokens=False)["input_ids"]
    assert [(g.student, g.teacher) for g in request.alignments[0].groups] == [
        ((0, 1), (0, 1)),
        ((1, 2), (1, len(replacement))),
        ((2, 3), (len(replacement), len(replacement) + 1)),  # EOS <-> EOS
    ]
    same = CrossTokenizer(teacher, teacher, PromptEncoder(teacher), (teacher.eos_token_id,))
    split = [teacher.convert_tokens_to_ids(t) for t in ("2", "Ġ", "=")]
    assert teacher.convert_tokens_to_ids("Ġ=") != teacher.unk_token_id  # a canonical merge exists
    batch, rollouts, records = _batch(teacher, [], extra=[split])
    request = same.request(batch, rollouts, records)
    assert request.tokens[0, request.teacher_prompt_lengths[0] : request.lengths[0]].tolist() == split


def test_a_stop_is_judged_on_eos_not_on_the_last_token_the_teacher_chose_knowing_the_end(tokenizers, doubles):
    """A student (one token per digit) stops after "213"; the teacher writes "33" as one token, so its lone "3" is a
    token it writes only last. The last text token is scored as a prefix (log of p("3") + p("33"), both asked for at
    its position) and EOS takes the rest: the total is the teacher's log p of the text either way. Without
    the other ids (a vLLM teacher: stop_prefix_ids=1) nothing moves. A sample cut by the length limit goes on, so
    its last "3" is a prefix too and nothing takes the rest (its total is the teacher's log p of a text that
    begins so)."""
    student, teacher = tokenizers[0], doubles
    three, three_three = teacher.convert_tokens_to_ids("3"), teacher.convert_tokens_to_ids("33")
    cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,))
    batch, rollouts, records = _batch(student, ["213"])
    cut, cut_rollouts, _ = _batch(student, ["213"], eos=False)
    request = cross.request(batch, rollouts, records)
    t_first = request.teacher_prompt_lengths[0] - 1
    assert request.stop_prefixes == [(2, 2)]
    assert request.request_ids[0, t_first + 2, :2].tolist() == [three, three_three]
    lp = -torch.rand(*request.request_ids.shape, generator=torch.Generator().manual_seed(2))
    got = cross.scores(TeacherScores(requested_logprobs=lp), request, batch).requested_logprobs[0, :, 0].double()
    lp0 = lp[0, :, 0].double()
    prefix = float(torch.logsumexp(lp[0, t_first + 2, :2].double(), 0))
    s_first = batch.prompt_lengths[0] - 1
    want = [lp0[t_first], lp0[t_first + 1], prefix, lp0[t_first + 3] + lp0[t_first + 2] - prefix]  # 2, 1, 3, EOS
    assert torch.allclose(got[s_first : s_first + 4], torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert float(got[s_first : s_first + 4].sum()) == pytest.approx(float(lp0[t_first : t_first + 4].sum()), abs=1e-5)

    plain = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,), stop_prefix_ids=1)
    batch, rollouts, records = _batch(student, ["213"])
    request = plain.request(batch, rollouts, records)
    assert request.stop_prefixes == [None] and request.request_ids.shape[-1] == 1
    got = plain.scores(TeacherScores(requested_logprobs=lp[..., :1]), request, batch).requested_logprobs[0, :, 0]
    assert torch.allclose(got[s_first : s_first + 4].double(), lp0[t_first : t_first + 4], atol=1e-6)
    request = cross.request(cut, cut_rollouts, records)
    assert request.stop_prefixes == [(2, 2)] and request.stopped == [False]
    assert request.tokens[0, request.teacher_prompt_lengths[0] : request.lengths[0]].tolist()[-1] == three
    got = cross.scores(TeacherScores(requested_logprobs=lp), request, cut).requested_logprobs[0, :, 0].double()
    assert torch.allclose(got[s_first : s_first + 3], torch.tensor(want[:3], dtype=torch.float64), atol=1e-6)
    assert cut.loss_mask[0, s_first + 3] == 0  # nothing after the cut is trained


def test_a_pipeline_stage_without_teacher_scores_passes_them_through():
    """An in-process teacher at PP > 1 scores on its last stage only; the other stages' (empty) scores pass the
    re-tokenizer unmapped (they compute no loss) instead of stopping the run at its first step."""
    from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
    from megatron_opd.interfaces import TeacherScores

    empty = TeacherScores()
    assert CrossTokenizer.scores(object(), empty, request=None, batch=None) is empty
