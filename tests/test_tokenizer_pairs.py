"""Every cross-tokenizer path on synthetic tokenizer pairs that stress alignment (issue #41).

The pairs (``testing.real_tokenizers.SYNTHETIC_PAIRS``): a teacher whose merges cross spaces, a character-level
student, merges across digits, a SentencePiece student with byte fallback, a character-level teacher. On each:
alignment against the reference of ``test_alignment``, re-tokenization, the vocabulary map against a brute-force
reading of its rule, both losses on the mapped scores, the stop handling; and the map's statistics against the table
in docs/training.md. All in-process, a few seconds.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch

from megatron_opd.cross_tokenizer.alignment import TokenBytes
from megatron_opd.cross_tokenizer.retokenize import MIN_MAPPED_SHARE, CrossTokenizer
from megatron_opd.cross_tokenizer.vocabulary_map import VocabularyMap
from megatron_opd.data.batch import pack_rollouts
from megatron_opd.data.prompts import PromptEncoder
from megatron_opd.interfaces import Rollouts, TeacherScores
from megatron_opd.losses.aligned import aligned_divergence
from megatron_opd.losses.sampled import SAMPLED_KINDS, label_logprobs, sampled_divergence
from megatron_opd.testing.real_tokenizers import MATRIX_TEXT, SYNTHETIC_KINDS, SYNTHETIC_PAIRS, synthetic_tokenizer
from tests.test_alignment import check, split_tokens

ROOT = Path(__file__).resolve().parents[1]
TEXTS = MATRIX_TEXT.splitlines()[:40] + ["51 15 5 1", "3 3 3", "7"]


@pytest.fixture(scope="module")
def toks() -> dict:
    found = {}
    for kind in SYNTHETIC_KINDS:
        try:
            found[kind] = synthetic_tokenizer(kind)
        except ImportError:  # byte_fallback without sentencepiece
            pass
    return found


def pair_of(toks, student_kind: str, teacher_kind: str):
    if student_kind not in toks or teacher_kind not in toks:
        pytest.skip("sentencepiece is not installed")
    return toks[student_kind], toks[teacher_kind]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def vocabulary_map(student, teacher) -> VocabularyMap:
    return VocabularyMap(TokenBytes(student), TokenBytes(teacher), [student.eos_token_id], [teacher.eos_token_id],
                         student_tokenizer=student)  # fmt: skip


PAIR_IDS = [f"{s}<-{t}" for s, t in SYNTHETIC_PAIRS]


@pytest.mark.parametrize("student_kind, teacher_kind", SYNTHETIC_PAIRS, ids=PAIR_IDS)
def test_alignment_matches_the_reference(toks, student_kind, teacher_kind):
    student, teacher = pair_of(toks, student_kind, teacher_kind)
    sb, tb = TokenBytes(student), TokenBytes(teacher)
    rng = random.Random(0)
    for text in TEXTS:
        s_ids, t_ids = encode(student, text), encode(teacher, text)
        check(s_ids + [student.eos_token_id], t_ids + [teacher.eos_token_id], sb, tb)
        check(split_tokens(student, s_ids, rng), t_ids, sb, tb)  # a non-canonical sample aligns the same way


@pytest.mark.parametrize("student_kind, teacher_kind", SYNTHETIC_PAIRS, ids=PAIR_IDS)
def test_first_token_map_follows_its_rule(toks, student_kind, teacher_kind):
    """Brute force over the student's vocabulary: a teacher token maps to the longest student token its bytes begin
    with, unless a longer student token begins with its bytes: then to that token if it is the only one and the
    teacher token has no twin, else to none; twins map to themselves; EOS to EOS."""
    student, teacher = pair_of(toks, student_kind, teacher_kind)
    sb, tb = TokenBytes(student), TokenBytes(teacher)
    vmap = vocabulary_map(student, teacher)
    pieces = {sb[i] for i in range(len(sb)) if sb[i]}
    for t in range(len(tb)):
        piece, got = tb[t], int(vmap.teacher_to_first[t])
        if t == teacher.eos_token_id:
            assert got == student.eos_token_id
            continue
        prefixes = [p for p in pieces if piece.startswith(p)]
        extensions = [p for p in pieces if p.startswith(piece) and len(p) > len(piece)]
        if piece and len(extensions) == 1 and piece not in pieces:
            assert sb[got] == extensions[0], (t, piece)
        elif not piece or extensions or not prefixes:
            assert got == -1, (t, piece)
        else:
            assert sb[got] == max(prefixes, key=len), (t, piece)
        if int(vmap.teacher_to_student[t]) >= 0 and got >= 0:
            assert got == int(vmap.teacher_to_student[t])


def map_statistics(student, teacher) -> dict[str, float]:
    return vocabulary_map(student, teacher).coverage(encode(teacher, MATRIX_TEXT))


def test_map_statistics_match_the_table_in_the_docs(toks):
    """docs/training.md's table of the pairs: each row's figures are what the map gives now."""
    doc = (ROOT / "docs" / "training.md").read_text()
    for student_kind, teacher_kind in SYNTHETIC_PAIRS:
        if student_kind not in toks:
            continue
        row = re.search(rf"^\| `{student_kind}` ← `{teacher_kind}` \|(.*)$", doc, re.M)
        assert row, f"docs/training.md has no row for {student_kind} <- {teacher_kind}"
        cells = [c.strip() for c in row.group(1).split("|")]
        stats = map_statistics(*pair_of(toks, student_kind, teacher_kind))
        want = [f"{len(toks[student_kind])}", f"{len(toks[teacher_kind])}"] + [
            f"{100 * stats[k]:.1f}%" for k in ("twin_ids", "twin_tokens", "first_ids", "first_tokens")
        ]
        assert cells[: len(want)] == want, f"{student_kind} <- {teacher_kind}: docs {cells}, measured {want}"


def batch_of(student, texts: list[str], stop: bool = True):
    record = {"prompt": "reverse 4 0 9 1 2 =", "answer": "2 1 9 0 4"}
    prompt = PromptEncoder(student).prompt_ids(record, "test")
    responses = [encode(student, t) + ([student.eos_token_id] if stop else []) for t in texts]
    n = len(responses)
    rollouts = Rollouts(
        prompt_ids=[torch.tensor(prompt)] * n,
        response_ids=[torch.tensor(r) for r in responses],
        response_mask=[torch.ones(len(r)) for r in responses],
        logprobs=[-torch.full((len(r),), 0.5) for r in responses],
        finish_reasons=["stop" if stop else "length"] * n,
        prompt_index=[0] * n,
    )
    return pack_rollouts(rollouts, pad_token_id=student.eos_token_id), rollouts, [record]


def fake_teacher(request, vocab: int, k: int, seed: int) -> tuple[TeacherScores, torch.Tensor]:
    """Random teacher distributions at every teacher position: its top-k and the requested ids' log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(*request.tokens.shape, vocab, generator=g) * 2, dim=-1)
    values, ids = logp.topk(k, dim=-1)
    requested = logp.gather(-1, request.request_ids)
    return TeacherScores(topk_ids=ids, topk_logprobs=values, requested_logprobs=requested), logp


@pytest.mark.parametrize("student_kind, teacher_kind", SYNTHETIC_PAIRS, ids=PAIR_IDS)
def test_retokenization_scores_and_both_losses(toks, student_kind, teacher_kind):
    """The teacher's tokens decode to the student's text; the group sums are the teacher's log-probabilities summed
    by hand (the stop correction included); each top-k row is the first position of a group and holds the teacher's
    full distribution there summed per student token by the map's rule (EOS less the stop shift); both losses give
    finite values and gradients."""
    student, teacher = pair_of(toks, student_kind, teacher_kind)
    texts = TEXTS[:12]
    batch, rollouts, records = batch_of(student, texts)
    cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,), topk=True)
    request = cross.request(batch, rollouts, records)
    vocab = len(teacher)
    scored, logp = fake_teacher(request, vocab, k=vocab, seed=1)  # k = the vocabulary: nothing in the tail
    scores = cross.scores(scored, request, batch)
    first_of = cross.vocabulary_map.teacher_to_first
    aligned = scores.extras["aligned_mask"]
    for i, alignment in enumerate(request.alignments):
        assert alignment is not None
        tp, p = request.teacher_prompt_lengths[i], batch.prompt_lengths[i]
        t_resp = request.tokens[i, tp : request.lengths[i]].tolist()
        assert cross.teacher_bytes.text(t_resp) == texts[i]
        lp = logp[i, torch.arange(tp - 1, request.lengths[i] - 1), request.tokens[i, tp : request.lengths[i]]].double()
        shift = 0.0
        if request.stop_prefixes[i] is not None:
            last, count = request.stop_prefixes[i]
            ext = request.request_ids[i, tp - 1 + last, :count]
            shift = float(torch.logsumexp(logp[i, tp - 1 + last, ext].double(), 0) - lp[last])
            lp[last] += shift
            lp[last + 1] -= shift
        starts = set()
        for g in alignment.groups:
            (s0, s1), (t0, t1) = g.student, g.teacher
            if g.one_sided:
                continue
            starts.add(s0)
            got = scores.requested_logprobs[i, p - 1 + s0 : p - 1 + s1, 0].double()
            assert torch.allclose(got, lp[t0:t1].sum().expand(s1 - s0), atol=1e-4)
            if not aligned[i, p - 1 + s0]:
                continue
            row = p - 1 + s0
            want: dict[int, float] = {}
            for t in range(vocab):
                u = int(first_of[t])
                if u >= 0:
                    want[u] = want.get(u, 0.0) + math.exp(float(logp[i, tp - 1 + t0, t]))
            if t0 == len(t_resp) - 1 and request.stop_prefixes[i] is not None:  # the EOS row
                want[student.eos_token_id] *= math.exp(-shift)
            support = scores.extras["teacher_topk_support"][i, row]
            have = dict(
                zip(scores.topk_ids[i, row][support].tolist(), scores.topk_logprobs[i, row][support].exp().tolist())
            )
            assert have == pytest.approx(want, rel=1e-4, abs=1e-6)
            assert sum(want.values()) >= MIN_MAPPED_SHARE - 1e-6
        rows = {int(r) - (p - 1) for r in aligned[i].nonzero()[:, 0]}
        assert rows <= starts
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(*batch.tokens.shape, len(student), generator=g, requires_grad=True)
    per_token, divergence = aligned_divergence(
        logits, batch.next_tokens(), aligned, scores.topk_ids, scores.topk_logprobs,
        scores.extras["teacher_topk_support"], scores.requested_logprobs[..., 0], scores.extras["group_offset"],
        "reverse_kl", vocab_size=len(student),
    )  # fmt: skip
    mask = batch.loss_mask != 0
    per_token[mask].sum().backward()
    logq = label_logprobs(logits.detach().reshape(-1, len(student)), batch.next_tokens().reshape(-1), vocab_size=None)
    for kind in SAMPLED_KINDS:  # loss.cross_tokenizer=sampled on the same scores
        surrogate, estimate = sampled_divergence(
            logq, scores.requested_logprobs[..., 0].reshape(-1), kind, scores.extras["group_offset"].reshape(-1)
        )
        assert torch.isfinite(surrogate[mask.reshape(-1)]).all() and torch.isfinite(estimate[mask.reshape(-1)]).all()
    assert torch.isfinite(per_token[mask]).all() and torch.isfinite(divergence[mask]).all()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    assert 0.0 < request.metrics["cross_tokenizer/topk_share"] <= 1.0
