"""The in-process teacher: a frozen GPTModel in the trainer's job, under the student's parallel layout.

It scores a packed batch with a forward-only pass through Megatron's pipeline schedule and keeps, on the last
pipeline stage, either its logit shards (``dense``: for ``dense_divergence``) or its global top-k computed
without gathering the vocabulary (``topk``: local top-k per shard, then a merge of k candidates per rank).
Log-probabilities at requested ids (e.g. the sampled tokens, for teacher-confidence weights) come with both.
The logit shard never exists whole: the model hands over its final hidden states (``models.output.HiddenStateOutput``);
in top-k mode the top-k is taken a chunk of tokens at a time from ``h_chunk @ W^T``, and in dense mode the hidden
states and the output weight go to the student's loss, which forms the teacher's logits chunk by chunk (with
``offload`` the weights leave the accelerator, so dense mode keeps whole logit shards there).

Two-phase memory mode (``offload=True``): the weights move to the accelerator only to score a step's rollouts,
the scores are cached in (pinned) host memory and the weights leave again before the student trains, so a
teacher larger than the student fits. On a CPU-only machine both already live in host memory.

With context parallelism each CP rank scores its share of every sequence (``models.context_parallel``) and the
scores are all-gathered back to whole sequences, which the student's update splits again with the rest of its
micro-batch (the gathered scores cost ``S / CP`` times a rank's own: modest for top-k, a full hidden-state or logit
tensor per sequence in dense mode).

Shape legend: ``N`` samples, ``S`` positions, ``K`` top-k, ``R`` requested ids, ``V`` this rank's vocab shard.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Literal

import torch

from megatron_opd.distributed.lockstep import lockstep_group
from megatron_opd.interfaces import TeacherScores, completed
from megatron_opd.losses.fused_output import chunk_tokens
from megatron_opd.losses.shard_ops import global_topk_logprobs, logprobs_at
from megatron_opd.losses.vocab_parallel import make_vocab_shard
from megatron_opd.models import packing
from megatron_opd.models.context_parallel import ContextParallelSplit, split_micro_batch
from megatron_opd.models.forward_backward import forward_backward
from megatron_opd.models.output import HiddenStateOutput
from megatron_opd.teacher.capabilities import INPROCESS
from megatron_opd.teacher.graphs import BucketedForward


class InProcessTeacher:
    """A frozen Megatron teacher colocated with the student (same TP/PP layout, same job)."""

    supports_dense = INPROCESS.dense
    supports_requested_logprobs = INPROCESS.requested_logprobs

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
        packing: bool = False,
        micro_batch_tokens: int | None = None,
        chunk_size: int | None = None,
        graphs: BucketedForward | None = None,
    ) -> None:
        if any(p.requires_grad for chunk in chunks for p in chunk.parameters()):
            raise ValueError("the teacher must be frozen: build it with build_model(..., trainable=False)")
        self.chunks = chunks
        self.vocab_size = vocab_size
        self.mode = mode
        self.topk = topk
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.packing = packing
        """Pack rows without padding (THD) when ``score`` is told their lengths (``train.packing``)."""
        self.micro_batch_tokens = micro_batch_tokens
        """Tokens per packed micro-batch under pipeline parallelism (default: ``micro_batch_size`` rows of ``S``)."""
        self.chunk_size = chunk_size
        """Tokens whose logits exist at once (None: automatic, ``losses.fused_output.chunk_tokens``)."""
        self.offload = offload and device is not None and device.type != "cpu"
        if graphs is not None and (self.offload or packing):
            raise ValueError(
                "teacher.cuda_graphs captures the forward at fixed weight addresses and padded shapes: it cannot "
                "run with teacher.offload (the weights move) or packed rows (train.packing); unset one of them"
            )
        self.graphs = graphs
        """``teacher.cuda_graphs``: the chunks' forward replays a captured graph per (rows, length) bucket."""
        self.device = device
        if self.offload:
            self._move("cpu")
        self.lockstep = lockstep_group(chunks)
        """Not None where the teacher's MoE layers exchange tokens across data-parallel ranks: a rank with no rows
        for it must still call ``score`` (with none) when the others do."""
        self.output = HiddenStateOutput(chunks)
        """The model returns hidden states; the logits are formed chunk by chunk (``_chunked``, or the loss)."""

    @property
    def dense(self) -> bool:
        """It returns the whole distribution (logit shards, or hidden states and the output weight), not its top-k.
        A property: the teacher server switches ``mode`` per request (``teacher.transfer=hidden``)."""
        return self.mode == "dense"

    def _move(self, device: str | torch.device) -> None:
        for chunk in self.chunks:
            chunk.to(device)

    @torch.no_grad()
    def score(
        self, tokens: torch.Tensor, request_ids: torch.Tensor | None = None, lengths: list[int] | None = None
    ) -> Future[TeacherScores]:
        """Score ``tokens`` ``[N, S]``; returns a completed future (this runs collectives on every rank).

        With ``lengths`` (each row's real tokens) and ``packing``, the rows are packed (THD) so no compute goes to
        padding; the scores come back as ``[N, S, ...]`` either way."""
        if self.offload:
            self._move(self.device)
        packed = self.packing and lengths is not None
        # The model returns hidden states, not logits (unless they are not its logits: soft-capped final logits).
        hidden = (not self.dense or not self.offload) and self.output.exact
        if not tokens.shape[0]:  # no rows: only the lockstep dummies of the MoE layers' exchange (``lockstep``)
            micro_batches = []
        elif packed:
            micro_batches = self._packed(tokens, request_ids, lengths)
        else:
            micro_batches = self._padded(tokens, request_ids)
        split = ContextParallelSplit.current()
        config = self.chunks[0].config
        if micro_batches and not packed and split is None and config.sequence_parallel:
            # Sequence parallelism splits every sequence over the TP ranks: a length the student's padding did not
            # make (a teacher with another tokenizer) is padded by repeating its last position, cut off below.
            micro_batches = [pad_columns(mb, config.tensor_model_parallel_size) for mb in micro_batches]
        if split is not None:  # each rank scores its share of every sequence; the scores are gathered back whole
            if packed:
                raise ValueError("packed sequences cannot be scored with context parallelism; set train.packing=false")
            sp = self.chunks[0].config.sequence_parallel
            multiple = 2 * split.size * (self.chunks[0].config.tensor_model_parallel_size if sp else 1)
            micro_batches = [
                split_micro_batch(mb, split, per_token={"request_ids"}, pad_multiple=multiple) for mb in micro_batches
            ]

        def collect(output: torch.Tensor, mb: dict):
            if hidden:  # output: hidden states [b, s, H]
                needs_logits = not self.dense or "request_ids" in mb
                scores = self._chunked(output, mb.get("request_ids")) if needs_logits else TeacherScores()
                if self.dense:
                    scores.dense_hidden = output.detach().clone()
            else:  # output: logit shards [b, s, V]
                scores = self._scores_of(output, mb.get("request_ids"))
            if split is not None:  # this rank's positions -> the whole (unpadded) sequences
                scores = _map(scores, lambda v: split.gather(v)[:, : tokens.shape[1]])
            elif not packed:  # the sequence-parallel padding off
                scores = _map(scores, lambda v: v[:, : tokens.shape[1]])
            if packed:  # [1, T, ...] -> [b, S, ...]
                sizes = mb["sequence_lengths"].tolist()
                scores = _map(scores, lambda v: packing.unpack(v, sizes, tokens.shape[1]))
            return output.new_zeros(()), _map(scores, self._to_host)

        graphed = self.graphs.installed(self.chunks, hidden) if self.graphs else contextlib.nullcontext()
        with self.output.active() if hidden else contextlib.nullcontext(), graphed:
            outputs = forward_backward(self.chunks, micro_batches, collect, forward_only=True)
        result = self._concat(outputs)
        if hidden and self.dense and outputs:
            result.output_weight = self.output.weight
        if self.offload:
            self._move("cpu")
        return completed(result)

    def _padded(self, tokens: torch.Tensor, request_ids: torch.Tensor | None) -> list[dict]:
        n = tokens.shape[0]
        # Pipeline schedules need micro-batches of one shape: the largest size <= micro_batch_size dividing n.
        mbs = next(size for size in range(min(self.micro_batch_size, n), 0, -1) if n % size == 0)
        micro_batches = []
        for lo in range(0, n, mbs):
            mb = {"tokens": tokens[lo : lo + mbs]}
            if request_ids is not None:
                mb["request_ids"] = request_ids[lo : lo + mbs]
            micro_batches.append(mb)
        return micro_batches

    def _packed(self, tokens: torch.Tensor, request_ids: torch.Tensor | None, lengths: list[int]):
        """THD micro-batches of ``micro_batch_size`` rows; with PP, of ``micro_batch_tokens`` (one shape per stage)."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        budget = packing.pipeline_token_budget(self.micro_batch_tokens, self.micro_batch_size, tokens.shape[1])
        longest = -(-max(lengths) // tp) * tp
        if budget is not None and longest > budget:
            # A teacher with another tokenizer (loss.cross_tokenizer) may see a sample longer than the student's
            # budget: this call's micro-batches take its length (every stage packs the same rows: one shape still).
            budget = longest
        groups = packing.group_sequences(
            lengths,
            per_group=self.micro_batch_size,
            token_budget=budget,
            field="train.micro_batch_tokens (a teacher server's --micro-batch-tokens)",
        )
        columns = {"tokens": tokens} | ({} if request_ids is None else {"request_ids": request_ids})
        micro_batches = packing.pack(lengths, groups, columns, pad_multiple=tp, token_budget=budget)
        for mb, group in zip(micro_batches, groups):
            mb["sequence_lengths"] = torch.tensor([lengths[i] for i in group])
        return micro_batches

    def _chunked(self, hidden_BSH: torch.Tensor, request_ids_BSR: torch.Tensor | None) -> TeacherScores:
        """``_scores_of`` the logits ``h @ W^T`` of a chunk of tokens at a time (never ``[b, s, V]`` at once)."""
        b, s, h = hidden_BSH.shape
        weight_VH, device = self.output.weight, hidden_BSH.device
        rows = chunk_tokens(self.chunk_size, weight_VH.shape[0], device)
        flat_TH = hidden_BSH.reshape(b * s, h).to(weight_VH.dtype)  # Float16Module's output is fp32
        requested_TR = None if request_ids_BSR is None else request_ids_BSR.reshape(b * s, -1)
        parts = [
            self._scores_of(
                flat_TH[lo : lo + rows] @ weight_VH.t(),
                None if requested_TR is None else requested_TR[lo : lo + rows],
                keep_dense=False,
            )
            for lo in range(0, b * s, rows)
        ]
        return _map(self._concat(parts), lambda v: v.view(b, s, *v.shape[1:]))

    def _scores_of(
        self, logits_BSV: torch.Tensor, request_ids_BSR: torch.Tensor | None, keep_dense: bool = True
    ) -> TeacherScores:
        shard = make_vocab_shard(logits_BSV.shape[-1], None, self.vocab_size)
        scores = TeacherScores()
        lse_BS = None
        if self.dense:
            if keep_dense:
                scores.dense_logits = logits_BSV.detach().clone()
        else:
            ids_BSK, logprobs_BSK, lse_BS = global_topk_logprobs(logits_BSV, self.topk, shard, self.temperature)
            scores.topk_ids, scores.topk_logprobs = ids_BSK, logprobs_BSK.float()
        if request_ids_BSR is not None:
            z_BSV = logits_BSV if self.temperature == 1.0 else logits_BSV.float() / self.temperature
            scores.requested_logprobs = logprobs_at(z_BSV, request_ids_BSR, shard, lse_BS).float()
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

        return TeacherScores(**{name: cat(name) for name in _FIELDS})


_FIELDS = ("topk_ids", "topk_logprobs", "dense_logits", "dense_hidden", "requested_logprobs")


def _map(scores: TeacherScores, fn) -> TeacherScores:
    return TeacherScores(**{name: None if (v := getattr(scores, name)) is None else fn(v) for name in _FIELDS})


def pad_columns(mb: dict, multiple: int) -> dict:
    """``mb``'s ``[b, S, ...]`` columns (tokens, request ids) padded to a multiple of ``multiple`` positions by
    repeating the last one: a causal model's scores of the real positions are unchanged."""
    b, s = mb["tokens"].shape
    extra = -s % multiple
    if not extra:
        return mb
    return {name: torch.cat([v, v[:, -1:].expand(b, extra, *v.shape[2:])], dim=1) for name, v in mb.items()}
