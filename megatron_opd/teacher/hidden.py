"""Dense scores from a remote teacher's final hidden states (``teacher.transfer=hidden``).

The teacher server sends ``[N, S, H]`` hidden states instead of a top-k; every rank of the student's last pipeline
stage holds its shard of the teacher's output layer (loaded from ``teacher.path``, laid out like the student's own
output-layer shard), and the student's fused loss forms the teacher's logits from the two a chunk of tokens at a
time: the exact full-vocabulary divergence (``loss.mode=dense``) from a teacher of any layout, at ``H`` values per
token on the wire instead of ``V``. Log-probabilities at requested ids (the sampled tokens, for teacher-confidence
weights and metrics) are formed here the same way, vocab-parallel over the TP group.

Shape legend: ``N`` samples, ``S`` positions, ``H`` hidden size, ``R`` requested ids, ``V`` this rank's columns.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from megatron_opd.interfaces import TeacherBackend, TeacherScores
from megatron_opd.losses.fused_output import chunk_tokens
from megatron_opd.losses.shard_ops import logprobs_at
from megatron_opd.losses.vocab_parallel import make_vocab_shard
from megatron_opd.teacher.capabilities import SERVER_HIDDEN
from megatron_opd.teacher.shared import LazyFuture


class HiddenStateTeacher:
    """``TeacherBackend`` over a back end that answers with hidden states; ``output_weight``: this rank's ``[V, H]``
    shard of the teacher's output layer (None on ranks without a loss, whose back end returns empty scores)."""

    supports_dense = SERVER_HIDDEN.dense
    supports_requested_logprobs = SERVER_HIDDEN.requested_logprobs

    def __init__(
        self,
        backend: TeacherBackend,
        output_weight: torch.Tensor | None,
        *,
        vocab_size: int,
        temperature: float = 1.0,
        chunk_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.output_weight = output_weight
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.chunk_size = chunk_size

    def score(
        self, tokens: torch.Tensor, request_ids: torch.Tensor | None = None, lengths: list[int] | None = None
    ) -> Future[TeacherScores]:
        """The back end's hidden states with the output weight attached; ``result()`` also forms the log-probs at
        ``request_ids`` (a collective over the TP group, like the back end's own ``result()``)."""
        return _Resolved(self, self.backend.score(tokens, None, lengths), request_ids)

    def complete(self, scores: TeacherScores, request_ids: torch.Tensor | None) -> TeacherScores:
        if scores.dense_hidden is None:  # a rank without a loss
            return scores
        scores.output_weight = self.output_weight
        if request_ids is not None:
            scores.requested_logprobs = self._requested(scores.dense_hidden, request_ids)
        return scores

    @torch.no_grad()
    def _requested(self, hidden_NSH: torch.Tensor, ids_NSR: torch.Tensor) -> torch.Tensor:
        """``[N, S, R]`` log-probabilities at ``ids_NSR`` at the teacher temperature, a chunk of tokens at a time."""
        weight_VH = self.output_weight
        n, s, h = hidden_NSH.shape
        rows = chunk_tokens(self.chunk_size, weight_VH.shape[0], weight_VH.device)
        shard = make_vocab_shard(weight_VH.shape[0], None, self.vocab_size)
        hidden_TH, ids_TR = hidden_NSH.reshape(n * s, h), ids_NSR.reshape(n * s, -1)
        parts = []
        for lo in range(0, n * s, rows):
            h_CH = hidden_TH[lo : lo + rows].to(weight_VH.device, weight_VH.dtype)
            z_CV = (h_CH @ weight_VH.t()).float() / self.temperature
            parts.append(logprobs_at(z_CV, ids_TR[lo : lo + rows].to(weight_VH.device), shard).float().cpu())
        return torch.cat(parts).view(n, s, -1)


class _Resolved(LazyFuture):
    """The inner future's scores completed on ``result()``: that result may itself be a collective
    (``GroupSharedTeacher``), and forming the requested log-probabilities is one."""

    def __init__(self, teacher: HiddenStateTeacher, inner: Future, request_ids: torch.Tensor | None) -> None:
        super().__init__()
        self._teacher, self._inner, self._request_ids = teacher, inner, request_ids

    def _resolve(self, timeout: float | None) -> TeacherScores:
        return self._teacher.complete(self._inner.result(timeout), self._request_ids)
