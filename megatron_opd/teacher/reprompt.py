"""The teacher's view of a batch when it has its own prompt and the student's tokenizer (``teacher.prompt_template``).

Each sample's sequence for the teacher is its own prompt (``data.teacher_prompt``) followed by the student's response
ids as sampled, so every response token keeps its id and only moves by the difference of the two prompts' lengths,
``shift_i = teacher_prompt_i - prompt_i`` (negative when the teacher's prompt is shorter). The teacher scores those
sequences with the ids the loss needs moved the same way (``request_ids``), and :meth:`Reprompter.scores` moves every
score back to the student's positions: position ``s`` of sample ``i`` reads the teacher's ``s + shift_i``. Top-k,
requested log-probabilities, dense logit shards and hidden states are all per position, so every back end (in
process, server, vLLM) and every ``loss.mode`` works unchanged, and alignment is exact (no byte groups, unlike
``cross_tokenizer.retokenize``, which serves a teacher with another tokenizer and builds its prompt from the same
template). Positions outside a response read whatever the teacher had there and are never trained (loss mask 0).

Costs: the teacher's sequences are longer by the privileged text (its forward pass and, for dense scores, the
transfer grow with them); the moves are one gather per score tensor on the host or device the scores live on.

Shape legend: ``N`` samples, ``S`` student positions, ``St`` teacher positions, ``R`` requested ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatron_opd.interfaces import Rollouts, TeacherScores

PAD_MULTIPLE = 8
"""The teacher's sequences are padded to a multiple of this, as the student's are (sequence parallelism splits them
over the tensor-parallel ranks)."""


@dataclass
class ReprompterRequest:
    """The teacher's sequences for one student batch, and the shifts that map its scores back."""

    tokens: torch.Tensor
    """``[N, St]`` teacher prompt + student response ids, right-padded."""
    request_ids: torch.Tensor
    """``[N, St, R]``: the student's requested ids (``TrainBatch.teacher_request_ids``) at the teacher's positions."""
    lengths: list[int]
    shifts: list[int]
    """Per sample: teacher position minus student position of each response token."""
    metrics: dict[str, float] = field(default_factory=dict)


class Reprompter:
    """Puts each sample's response after the teacher's own prompt, and the teacher's scores back at the student's
    positions."""

    def __init__(self, teacher_encoder, pad_token_id: int) -> None:
        self.teacher_encoder = teacher_encoder
        """A ``data.teacher_prompt.TemplatePromptEncoder`` (the student's tokenizer)."""
        self.pad_token_id = pad_token_id

    def request(self, batch, rollouts: Rollouts, records: list[dict]) -> ReprompterRequest:
        """The teacher's sequences for ``batch`` (``records``: each prompt's record, by ``rollouts.prompt_index``)."""
        n = batch.num_samples
        prompts = [
            self.teacher_encoder.prompt_ids(records[rollouts.prompt_index[i]], where=f"sample {i}'s record (teacher)")
            for i in range(n)
        ]
        shifts = [len(prompts[i]) - batch.prompt_lengths[i] for i in range(n)]
        lengths = [batch.lengths[i] + shifts[i] for i in range(n)]
        width = -(-max(lengths, default=1) // PAD_MULTIPLE) * PAD_MULTIPLE  # as ``data.batch.pack`` pads
        student_ids = batch.teacher_request_ids()
        tokens = torch.full((n, width), self.pad_token_id, dtype=torch.int64)
        for i in range(n):
            p, length, t_p = batch.prompt_lengths[i], batch.lengths[i], len(prompts[i])
            tokens[i, :t_p] = torch.tensor(prompts[i], dtype=torch.int64)
            tokens[i, t_p : lengths[i]] = batch.tokens[i, p:length]
        # Every position asks for the token it predicts (a vLLM teacher scores only those); the positions predicting
        # a response token (student p - 1 .. length - 2) also for the student's other requested ids, moved.
        next_NS1 = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)[..., None]
        request_ids = next_NS1.expand(n, width, student_ids.shape[-1]).clone()
        for i in range(n):
            p, length, t_p = batch.prompt_lengths[i], batch.lengths[i], len(prompts[i])
            request_ids[i, t_p - 1 : lengths[i] - 1] = student_ids[i, p - 1 : length - 1]
        metrics = {"teacher_prompt/extra_tokens": sum(shifts) / max(n, 1)}
        return ReprompterRequest(tokens, request_ids, lengths, shifts, metrics)

    @staticmethod
    def scores(teacher: TeacherScores, request: ReprompterRequest, batch) -> TeacherScores:
        """The teacher's scores at the student's positions (``[N, S, ...]``): position ``s`` of sample ``i`` holds
        the teacher's ``s + shift_i`` (clamped into its sequence; such positions are never trained)."""
        n, s = batch.tokens.shape
        moved = {}
        for name in ("topk_ids", "topk_logprobs", "dense_logits", "dense_hidden", "requested_logprobs"):
            value = getattr(teacher, name)
            if value is None:
                continue
            width = value.shape[1]
            shift_N = torch.tensor(request.shifts, dtype=torch.int64, device=value.device)
            source_NS = (torch.arange(s, device=value.device)[None, :] + shift_N[:, None]).clamp_(0, width - 1)
            index = source_NS.view(n, s, *([1] * (value.dim() - 2))).expand(n, s, *value.shape[2:])
            moved[name] = value.gather(1, index)
        return dataclasses.replace(teacher, **moved)
