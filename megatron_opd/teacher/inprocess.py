"""The in-process teacher: a frozen GPTModel in the trainer's job, under the student's parallel layout.

It scores a packed batch with a forward-only pass through Megatron's pipeline schedule and keeps, on the last
pipeline stage, either its logit shards (``dense``: for ``dense_divergence``) or its global top-k computed
without gathering the vocabulary (``topk``: local top-k per shard, then a merge of k candidates per rank).
Log-probabilities at requested ids (e.g. the sampled tokens, for teacher-confidence weights) come with both.

Two-phase memory mode (``offload=True``): the weights move to the accelerator only to score a step's rollouts,
the scores are cached in (pinned) host memory and the weights leave again before the student trains, so a
teacher larger than the student fits. On a CPU-only machine both already live in host memory.

Shape legend: ``N`` samples, ``S`` positions, ``K`` top-k, ``R`` requested ids, ``V`` this rank's vocab shard.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Literal

import torch

from megatron_opd.interfaces import TeacherScores, completed
from megatron_opd.losses.shard_ops import global_topk_logprobs, logprobs_at
from megatron_opd.losses.vocab_parallel import make_vocab_shard
from megatron_opd.models.pipeline import forward_backward


class InProcessTeacher:
    """A frozen Megatron teacher colocated with the student (same TP/PP layout, same job)."""

    supports_dense = True
    supports_requested_logprobs = True

    def __init__(
        self,
        chunks: list,
        *,
        vocab_size: int,
        mode: Literal["dense", "topk"],
        topk: int,
        temperature: float = 1.0,
        micro_batch_size: int = 8,
        offload: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if any(p.requires_grad for chunk in chunks for p in chunk.parameters()):
            raise ValueError("the teacher must be frozen: build it with build_model(..., trainable=False)")
        self.chunks = chunks
        self.vocab_size = vocab_size
        self.mode = mode
        self.topk = topk
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.offload = offload and device is not None and device.type != "cpu"
        self.device = device
        if self.offload:
            self._move("cpu")

    def _move(self, device: str | torch.device) -> None:
        for chunk in self.chunks:
            chunk.to(device)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, request_ids: torch.Tensor | None = None) -> Future[TeacherScores]:
        """Score ``tokens`` ``[N, S]``; returns a completed future (this runs collectives on every rank)."""
        if self.offload:
            self._move(self.device)
        n = tokens.shape[0]
        # Pipeline schedules need micro-batches of one shape: the largest size <= micro_batch_size dividing n.
        mbs = next(size for size in range(min(self.micro_batch_size, n), 0, -1) if n % size == 0)
        micro_batches = []
        for lo in range(0, n, mbs):
            mb = {"tokens": tokens[lo : lo + mbs]}
            if request_ids is not None:
                mb["request_ids"] = request_ids[lo : lo + mbs]
            micro_batches.append(mb)

        def collect(logits_BSV: torch.Tensor, mb: dict):
            return logits_BSV.new_zeros(()), self._scores_of(logits_BSV, mb.get("request_ids"))

        outputs = forward_backward(self.chunks, micro_batches, collect, forward_only=True)
        if self.offload:
            self._move("cpu")
        return completed(self._concat(outputs))

    def _scores_of(self, logits_BSV: torch.Tensor, request_ids_BSR: torch.Tensor | None) -> TeacherScores:
        shard = make_vocab_shard(logits_BSV.shape[-1], None, self.vocab_size)
        scores = TeacherScores()
        lse_BS = None
        if self.mode == "dense":
            scores.dense_logits = self._to_host(logits_BSV.detach().clone())
        else:
            ids_BSK, logprobs_BSK, lse_BS = global_topk_logprobs(logits_BSV, self.topk, shard, self.temperature)
            scores.topk_ids = self._to_host(ids_BSK)
            scores.topk_logprobs = self._to_host(logprobs_BSK.float())
        if request_ids_BSR is not None:
            z_BSV = logits_BSV if self.temperature == 1.0 else logits_BSV.float() / self.temperature
            scores.requested_logprobs = self._to_host(logprobs_at(z_BSV, request_ids_BSR, shard, lse_BS).float())
        return scores

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        """Cache on the host while the student trains (pinned, so it returns to the GPU asynchronously)."""
        if not self.offload:
            return x
        return x.to("cpu").pin_memory()

    @staticmethod
    def _concat(parts: list[TeacherScores]) -> TeacherScores:
        """Micro-batch scores -> one ``TeacherScores`` (empty on ranks that are not the last pipeline stage)."""
        if not parts:
            return TeacherScores()

        def cat(name: str):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values, dim=0)

        return TeacherScores(
            topk_ids=cat("topk_ids"),
            topk_logprobs=cat("topk_logprobs"),
            dense_logits=cat("dense_logits"),
            requested_logprobs=cat("requested_logprobs"),
        )
