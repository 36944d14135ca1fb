"""The teacher's view of a student batch when the two tokenizers differ (``loss.cross_tokenizer=sampled``).

For each sample the student's response ids are decoded to text; the teacher's prompt is built from the record with
the teacher's own tokenizer (a chat rendered with the teacher's chat template, a ``prompt`` text encoded as is), the
response text is tokenized by the teacher (its EOS appended where the student stopped), and the two responses are
aligned into byte groups (:mod:`megatron_opd.cross_tokenizer.alignment`). The teacher scores its own token
sequences (the log-probability of each of its tokens, ``request_ids`` = the next token); :meth:`CrossTokenizer.scores`
sums them over each group and puts the group's value at every student position of the group, with the offset to
the group's first position (``extras["group_offset"]``), which is what the sampled loss reads
(:mod:`megatron_opd.losses.sampled`). With ``loss.cross_tokenizer=aligned`` the teacher also returns its top-k:
at the first position of each group (a byte offset where both tokenizations have a boundary) each teacher token is
mapped to the student token its bytes begin with
(:attr:`~megatron_opd.cross_tokenizer.vocabulary_map.VocabularyMap.teacher_to_first`) for the top-k loss
(:mod:`megatron_opd.losses.aligned`); the group's other positions keep the sampled loss. Where the student's
template starts the answer with a space (the record's response, ``data.response_key``, does), the answer's first
position reads every teacher token with that space, so a teacher fine-tuned with and without it is compared by the
sum of its two boundary variants (``VocabularyMap.teacher_to_first_spaced``). All of it runs on the
host in the data path, off the accelerator.

Where the student stopped, the teacher's last token was chosen knowing that the text ends there: a teacher with a
token for "33" writes a lone "3" only last, so the cost of stopping one digit early would land on the "3" and none
on EOS. So the last text token is scored as the prefix it is (the teacher's probability of any of its tokens that
begin with those bytes, ``TokenBytes.extensions``, asked for at that position) and EOS takes the rest: the
sequence's total is unchanged, the stop is judged on EOS. Where the response was cut (the length limit) the text
goes on, so its last text token is scored as a prefix the same way and nothing takes the rest: the teacher's
probability of a text that continues (the enumerated reference, ``testing.cross_tokenizer_reference``, scores both
so). A teacher that scores only the next token (vLLM) skips it.
``aligned`` does the same on its rows: the row predicting the last text token credits every teacher token that
begins with its bytes (the map does), and the EOS row's EOS slot loses the same shift (the rest is left to the
loss's tail: what would have followed is not known there).

Samples whose texts cannot be aligned (a response cut inside a multi-byte character, a teacher normaliser that
rewrites text) are not trained on (their loss mask is cleared) and counted in the metrics. Student tokens in a
group without teacher tokens (a special token only the student has) are not trained on either.

Shape legend: ``N`` samples, ``S`` student positions, ``St`` teacher positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from megatron_opd.cross_tokenizer.alignment import (
    Alignment,
    Group,
    TextMismatchError,
    TokenBytes,
    align,
    alignment_stats,
)
from megatron_opd.cross_tokenizer.vocabulary_map import VocabularyMap
from megatron_opd.interfaces import Rollouts, TeacherScores

logger = logging.getLogger(__name__)

MIN_MAPPED_SHARE = 0.5
"""``aligned``: a group's first position takes the top-k loss when at least this share of the teacher's top-k mass
there maps to student tokens; below it the mapped distribution says too little and the sampled loss is kept (so the
loss falls back to ``sampled`` as a pair's mapped mass falls)."""


@dataclass
class TeacherRequest:
    """The teacher's token sequences for one student batch, and what maps its scores back."""

    tokens: torch.Tensor
    """``[N, St]`` teacher prompt + response ids, right-padded."""
    request_ids: torch.Tensor
    """``[N, St, 1]``: the token each teacher position predicts (its log-probability is what the loss needs)."""
    lengths: list[int]
    alignments: list[Alignment | None]
    """Per sample; None where the texts could not be aligned."""
    teacher_prompt_lengths: list[int]
    stop_prefixes: list[tuple[int, int] | None] = field(default_factory=list)
    """Per sample whose last text token is scored as a prefix (it stopped, or was cut): (index in the teacher
    response of its last text token, how many of ``request_ids[i, position predicting it]`` are that token's
    extensions); else None."""
    stopped: list[bool] = field(default_factory=list)
    spaced_answers: list[bool] = field(default_factory=list)
    """Per sample: the student's template starts the answer with a space (its record's response does)."""
    """Per sample: the teacher's EOS follows its text (the stop correction's rest goes there)."""
    metrics: dict[str, float] = field(default_factory=dict)


class CrossTokenizer:
    """Re-tokenizes student samples for a teacher with another tokenizer, and maps its scores back."""

    def __init__(
        self,
        student_tokenizer,
        teacher_tokenizer,
        teacher_encoder,
        student_stop_ids: tuple[int, ...],
        stop_prefix_ids: int = 16,
        topk: bool = False,
    ):
        self.student_bytes = TokenBytes(student_tokenizer, "student tokenizer")
        self.teacher_bytes = TokenBytes(teacher_tokenizer, "teacher tokenizer")
        self.teacher_tokenizer = teacher_tokenizer
        self.teacher_encoder = teacher_encoder
        """A ``PromptEncoder`` with the teacher's tokenizer and the run's ``data.*_key`` fields."""
        self.student_stop_ids = set(student_stop_ids)
        self.stop_prefix_ids = stop_prefix_ids
        """How many of the last text token's extensions the teacher is asked for (1: none, for a teacher that scores only
        the next token; see the module docstring)."""
        self.teacher_eos = teacher_tokenizer.eos_token_id
        self.same_vocabulary = student_tokenizer.get_vocab() == teacher_tokenizer.get_vocab()
        """One vocabulary: the teacher scores the student's own ids (a re-tokenization would score the canonical
        segmentation of the text instead of the one sampled) and every token is its own group (byte groups would
        join tokens that split a character)."""
        self.vocabulary_map = None
        """``loss.cross_tokenizer=aligned`` (``topk``): teacher ids -> student ids of the same bytes."""
        if topk and not self.same_vocabulary:  # the teacher's stops map to the student's EOS
            eos = student_tokenizer.eos_token_id
            self.vocabulary_map = VocabularyMap(
                self.student_bytes, self.teacher_bytes, sorted(self.student_stop_ids, key=lambda i: i != eos),
                [] if self.teacher_eos is None else [int(self.teacher_eos)], student_tokenizer=student_tokenizer,
            )  # fmt: skip
            shares = self.vocabulary_map.coverage([])
            logger.info(
                "vocabulary map: %.1f%% of the teacher's ids have a student twin, %.1f%% a student token they begin "
                "with (loss.cross_tokenizer=aligned uses the latter)",
                100 * shares["twin_ids"],
                100 * shares["first_ids"],
            )
        self.topk = topk

    def request(self, batch, rollouts: Rollouts, records: list[dict]) -> TeacherRequest:
        """The teacher's sequences for ``batch`` (``records``: each prompt's record, by ``rollouts.prompt_index``).

        Clears ``batch.loss_mask`` where a student token cannot be compared (see the module docstring)."""
        sequences, alignments, prompt_lengths, stop_prefixes, stopped = [], [], [], [], []
        responses = [
            batch.tokens[i, batch.prompt_lengths[i] : batch.lengths[i]].tolist() for i in range(len(batch.lengths))
        ]
        if self.same_vocabulary:
            retokenized = responses
        else:  # one call for the batch: the tokenizer's Rust side encodes them in one go
            texts = [self.student_bytes.text(ids) for ids in responses]
            retokenized = self.teacher_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        for i, student_ids in enumerate(responses):
            p = batch.prompt_lengths[i]
            record = records[rollouts.prompt_index[i]]
            t_prompt = self.teacher_encoder.prompt_ids(record, where=f"sample {i}'s record (teacher tokenizer)")
            stop_prefix = None
            t_response = list(retokenized[i])
            ends = False
            if not self.same_vocabulary:
                if t_response and self.stop_prefix_ids > 1:  # stopped or cut: the last text token is a prefix
                    stop_prefix = len(t_response) - 1
                if student_ids and student_ids[-1] in self.student_stop_ids and self.teacher_eos is not None:
                    t_response.append(int(self.teacher_eos))
                    ends = True
            try:
                alignment = (
                    Alignment([Group((k, k + 1), (k, k + 1)) for k in range(len(student_ids))])
                    if self.same_vocabulary
                    else align(student_ids, t_response, self.student_bytes, self.teacher_bytes)
                )
            except TextMismatchError:
                alignment = None
            sequences.append(t_prompt + t_response)
            stop_prefixes.append(stop_prefix if alignment is not None else None)
            stopped.append(ends)
            alignments.append(alignment)
            prompt_lengths.append(len(t_prompt))
            self._mask_uncompared(batch.loss_mask[i], p, alignment)
        n, width = len(sequences), max(len(s) for s in sequences)
        tokens = torch.full((n, width), self.teacher_eos or 0, dtype=torch.int64)
        for i, seq in enumerate(sequences):
            tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        next_ids = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)[..., None]
        extensions = {}
        for i, last in enumerate(stop_prefixes):
            if last is not None:
                ext = self.teacher_bytes.extensions(sequences[i][prompt_lengths[i] + last], self.stop_prefix_ids)
                if len(ext) > 1:  # a token no other token extends is already the prefix's probability
                    extensions[i] = ext
        width_r = max((len(e) for e in extensions.values()), default=1)
        next_ids = next_ids.expand(-1, -1, width_r).clone()  # columns past the first repeat it (never read)
        for i, ext in extensions.items():
            position = prompt_lengths[i] + stop_prefixes[i] - 1  # the position predicting the last text token
            next_ids[i, position, : len(ext)] = torch.tensor(ext, dtype=torch.int64)
        stop_prefixes = [(stop_prefixes[i], len(extensions[i])) if i in extensions else None for i in range(n)]
        aligned = [a for a in alignments if a is not None]
        stats = alignment_stats(aligned) if aligned else None
        metrics = {
            "cross_tokenizer/unaligned_samples": float(len(alignments) - len(aligned)),
            "cross_tokenizer/mean_group_student_tokens": stats.mean_student_tokens if stats else 0.0,
            "cross_tokenizer/mean_group_teacher_tokens": stats.mean_teacher_tokens if stats else 0.0,
            "cross_tokenizer/one_to_one_share": stats.one_to_one_share if stats else 0.0,
        }
        lengths = [len(s) for s in sequences]
        key = getattr(self.teacher_encoder, "response_key", "response")
        spaced = [str(records[j].get(key) or "")[:1] == " " for j in rollouts.prompt_index[:n]]
        return TeacherRequest(tokens, next_ids, lengths, alignments, prompt_lengths, stop_prefixes, stopped, spaced,
                              metrics)  # fmt: skip

    @staticmethod
    def _mask_uncompared(mask_S: torch.Tensor, prompt_length: int, alignment: Alignment | None) -> None:
        """Clear the loss mask of the student tokens nothing on the teacher's side is compared with."""
        first = prompt_length - 1  # position predicting the first response token
        if alignment is None:
            mask_S[first:] = 0.0
            return
        for group in alignment.groups:
            (s0, s1), (t0, t1) = group.student, group.teacher
            if s1 > s0 and t1 == t0:
                mask_S[first + s0 : first + s1] = 0.0

    def scores(self, teacher: TeacherScores, request: TeacherRequest, batch) -> TeacherScores:
        """The teacher's scores on the student's positions: at each position predicting a response token, the log-
        probability of that token's group under the teacher (``requested_logprobs[..., 0]``), and in
        ``extras["group_offset"]`` the offset back to the group's first position (0 for a 1:1 group)."""
        if teacher.requested_logprobs is None and teacher.topk_ids is None:
            return teacher  # an in-process teacher's pipeline stage before the last: no scores, no loss here
        n, s = batch.tokens.shape
        group_logp = torch.zeros(n, s, 1)
        offset = torch.zeros(n, s, dtype=torch.int64)
        logp_NStR = teacher.requested_logprobs.double()
        logp_NSt = logp_NStR[..., 0].clone()
        log_ratio, stop_shifts = [], {}
        for i, alignment in enumerate(request.alignments):
            if alignment is None:
                continue
            first_s = batch.prompt_lengths[i] - 1
            first_t = request.teacher_prompt_lengths[i] - 1
            if request.stop_prefixes and request.stop_prefixes[i] is not None:
                last, count = request.stop_prefixes[i]  # the last text token as a prefix; EOS takes the rest
                at = first_t + last
                shift = float(torch.logsumexp(logp_NStR[i, at, :count], 0) - logp_NStR[i, at, 0])
                logp_NSt[i, at] += shift
                if request.stopped[i]:  # cut: the text goes on, nothing takes the rest
                    logp_NSt[i, at + 1] -= shift
                    stop_shifts[i] = shift
            # Per group: the sum of its teacher tokens' log-probabilities, put at each of its student tokens.
            student_G, teacher_G = alignment.student_group_index(), alignment.teacher_group_index()
            two_sided_G = torch.tensor([not g.one_sided for g in alignment.groups])
            start_G = torch.tensor([g.student[0] for g in alignment.groups])
            sums_G = torch.zeros(len(alignment), dtype=torch.float64).index_add_(
                0, teacher_G, logp_NSt[i, first_t : first_t + teacher_G.numel()]
            )
            kept = two_sided_G[student_G]
            span = slice(first_s, first_s + student_G.numel())
            group_logp[i, span, 0] = torch.where(kept, sums_G[student_G], 0.0).float()
            offset[i, span] = torch.where(kept, start_G[student_G] - torch.arange(student_G.numel()), 0)
            if batch.rollout_logprobs is not None:
                trained = batch.loss_mask[i] != 0
                teacher_total = float(sums_G[two_sided_G].sum())
                log_ratio.append(teacher_total - float(batch.rollout_logprobs[i][trained].double().sum()))
        request.metrics["cross_tokenizer/sequence_log_ratio"] = sum(log_ratio) / max(len(log_ratio), 1)
        extras = {"group_offset": offset}
        if not self.topk:
            return TeacherScores(requested_logprobs=group_logp, extras=extras)
        ids, logprobs, support, aligned = self._mapped_topk(teacher, request, batch, stop_shifts)
        extras.update(aligned_mask=aligned, teacher_topk_support=support)
        return TeacherScores(topk_ids=ids, topk_logprobs=logprobs, requested_logprobs=group_logp, extras=extras)

    def _mapped_topk(self, teacher: TeacherScores, request: TeacherRequest, batch, stop_shifts: dict[int, float]):
        """``loss.cross_tokenizer=aligned``: at each trained student position predicting the first token of a
        two-sided group (a byte offset where both tokenizations have a boundary), the teacher's top-k there mapped
        to the student token each teacher token begins with (``VocabularyMap.teacher_to_first``): ``[N, S, K]`` ids,
        log-probabilities, support, and ``[N, S]`` where at least :data:`MIN_MAPPED_SHARE` of the teacher's top-k
        mass mapped (elsewhere the sampled loss). ``stop_shifts``: per sample that stopped, the stop correction
        taken off the EOS slot of its EOS row (see the module docstring)."""
        if teacher.topk_ids is None:
            raise ValueError("loss.cross_tokenizer=aligned needs the teacher's top-k; the teacher returned none")
        n, s = batch.tokens.shape
        k = teacher.topk_ids.shape[-1]
        student_at, teacher_at, shift_at, spaced_at = [], [], [], []  # per sample: (row, position) of each row, its
        # EOS shift, whether it is the answer's first position after the student template's leading space
        skip_first = self.vocabulary_map is not None and (
            self.student_bytes.dummy_prefix != self.teacher_bytes.dummy_prefix
        )  # one side's first group may hold a space the other's first token lacks: its first tokens differ, unless
        # the student's template starts the answer with a space (then every teacher token is read with one there:
        # both boundary variants of the teacher summed, VocabularyMap.teacher_to_first_spaced)
        for i, alignment in enumerate(request.alignments):
            if alignment is None:
                continue
            p, tp = batch.prompt_lengths[i], request.teacher_prompt_lengths[i]
            space = bool(request.spaced_answers) and request.spaced_answers[i]
            skip = skip_first and not space
            starts = [g for g in alignment.groups if not g.one_sided and not (skip and g.student[0] == 0)]
            if self.vocabulary_map is None:  # one vocabulary: every group is one token
                starts = [g for g in starts if g.student[1] - g.student[0] == 1 == g.teacher[1] - g.teacher[0]]
            if not starts:
                continue
            s0 = torch.tensor([g.student[0] for g in starts])
            t0 = torch.tensor([g.teacher[0] for g in starts])
            trained = batch.loss_mask[i, p - 1 + s0] != 0
            if self.vocabulary_map is None:
                trained &= batch.tokens[i, p + s0] == request.tokens[i, tp + t0]
            rows = torch.full((int(trained.sum()),), i)
            student_at.append(torch.stack([rows, p - 1 + s0[trained]], 1))
            teacher_at.append(torch.stack([rows, tp - 1 + t0[trained]], 1))
            shift = torch.zeros(len(starts), dtype=torch.float64)
            if i in stop_shifts:  # the EOS group: the teacher's EOS right after its last text token
                last = request.stop_prefixes[i][0]
                shift[t0 == last + 1] = stop_shifts[i]
            shift_at.append(shift[trained])
            spaced_at.append(((s0 == 0) & space)[trained])
        ids = torch.zeros(n, s, k, dtype=torch.int64)
        logprobs = torch.zeros(n, s, k, dtype=torch.float32)
        support = torch.zeros(n, s, k, dtype=torch.bool)
        aligned = torch.zeros(n, s, dtype=torch.bool)
        mapped_mass = topk_mass = torch.zeros(0)
        if student_at and sum(len(a) for a in student_at):
            si, sp = torch.cat(student_at).unbind(1)
            ti, tq = torch.cat(teacher_at).unbind(1)
            t_ids, t_logprobs = teacher.topk_ids[ti, tq].to(torch.int64), teacher.topk_logprobs[ti, tq].float()
            if self.vocabulary_map is None:  # one vocabulary: the teacher's ids are the student's
                m_ids, m_logprobs, m_support = t_ids, t_logprobs, torch.ones_like(t_ids, dtype=torch.bool)
            else:
                m_ids, m_logprobs, m_support = self.vocabulary_map.map_topk(t_ids, t_logprobs, prefixes=True)
                spaced_R = torch.cat(spaced_at)
                if spaced_R.any():  # the answer's first position: both boundary variants (VocabularyMap)
                    at = spaced_R.nonzero()[:, 0]
                    b_ids, b_logprobs, b_support = self.vocabulary_map.map_topk(t_ids[at], t_logprobs[at], spaced=True)
                    m_ids, m_logprobs, m_support = m_ids.clone(), m_logprobs.clone(), m_support.clone()
                    m_ids[at], m_logprobs[at], m_support[at] = b_ids, b_logprobs, b_support
                eos = self.vocabulary_map.student_eos_id
                shift_R = torch.cat(shift_at).float()
                m_logprobs = m_logprobs - torch.where(m_support & (m_ids == eos), shift_R[:, None], 0.0)
            mapped_mass = torch.where(m_support, m_logprobs.exp(), 0.0).sum(-1)
            topk_mass = t_logprobs.exp().sum(-1)
            kept = m_support.any(dim=-1) & (mapped_mass >= MIN_MAPPED_SHARE * topk_mass)
            ids[si, sp], logprobs[si, sp], support[si, sp] = m_ids, m_logprobs, m_support
            aligned[si, sp] = kept
        trained = int((batch.loss_mask != 0).sum())
        count = int(aligned.sum())
        request.metrics.update({
            "cross_tokenizer/topk_share": count / max(trained, 1),
            "cross_tokenizer/sampled_share": (trained - count) / max(trained, 1),
            "cross_tokenizer/mapped_teacher_mass": float(mapped_mass.mean()) if mapped_mass.numel() else 0.0,
            "cross_tokenizer/teacher_topk_mass": float(topk_mass.mean()) if topk_mass.numel() else 0.0,
        })  # fmt: skip
        return ids, logprobs, support, aligned
