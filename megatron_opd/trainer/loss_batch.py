"""The micro-batch as the loss sees it: a typed record of the student's tokens and masks and the teacher's signal.

Megatron's schedule moves micro-batches as dicts of tensors (``forward_backward`` puts every value on the device);
the loss function turns its dict into a ``LossBatch`` once, and the objective (``trainer.objective``), chosen from
the config, reads the fields its kind of teacher signal provides. Nothing picks a code path from which keys exist.

Shape legend: ``B`` samples in the micro-batch (1 for a packed THD row), ``S`` positions (tokens of a packed row),
``V`` vocab shard, ``H`` the teacher's hidden size, ``K`` teacher top-k, ``R`` the student's top-k. The fused output
layer flattens ``[B, S, ...]`` to ``[N, ...]`` and picks chunks of rows (``flatten``, ``select``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from megatron_opd.models.context_parallel import SPLIT_MARKER, ContextParallelSplit, split_micro_batch


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch's loss inputs; every tensor field but ``trained_index`` is per token (``[B, S, ...]``)."""

    NOT_PER_TOKEN: ClassVar[frozenset[str]] = frozenset({"trained_index", "sequence_tokens", "context_parallel"})

    # The student's side.
    loss_mask: torch.Tensor
    """``[B, S]``: 1 where the position predicts a trained token."""
    labels: torch.Tensor
    """``[B, S]`` int64: the token each position predicts."""
    weights: torch.Tensor
    """``[B, S]``: each token's loss weight (its sample's weight)."""
    segment_ids: torch.Tensor | None = None
    """``[1, T]`` which sample each token of a packed row belongs to (sequence-level reductions)."""
    rollout_logprobs: torch.Tensor | None = None
    """``[B, S]`` the sampler's log-probability of each sampled token (rollout fidelity, staleness weights)."""
    drawn_logprobs: torch.Tensor | None = None
    """``[B, S]`` the same under the distribution the sampler drew from (truncated sampling: temperature, top-k,
    top-p), what the staleness and rollout corrections compare with."""
    truncated_logprobs: torch.Tensor | None = None
    """``[B, S]`` the trainer's own log-probability of each label under the sampler's truncation (read in the loss
    pass before the loss, ``losses.importance.TRUNCATED_FLOOR`` where it is excluded); set by the objective."""
    trained_index: torch.Tensor | None = None
    """``[n]`` flat indices of the trained tokens (fused output layer; found before the schedule, not by a sync)."""
    # Dense teachers: logits, or the in-process teacher's hidden states (its output weight goes to the objective).
    teacher_logits: torch.Tensor | None = None
    """``[B, S, V]`` the teacher's logit shard."""
    teacher_hidden: torch.Tensor | None = None
    """``[B, S, H]`` the teacher's final hidden states."""
    # Top-k teachers (also the top-1 of ``loss.mode=sampled``, and the aligned cross-tokenizer top-k).
    teacher_topk_ids: torch.Tensor | None = None
    """``[B, S, K]`` global ids, most probable first."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """``[B, S, K]`` log-probabilities at ``teacher_topk_ids``."""
    student_topk_ids: torch.Tensor | None = None
    """``[B, S, R]`` the student's own top-k ids (``loss.support=union``)."""
    teacher_logprobs_at_student_ids: torch.Tensor | None = None
    """``[B, S, R]`` the teacher's log-probabilities at ``student_topk_ids``."""
    # Sampled teachers: the log-probability of the token each position predicts.
    teacher_label_logprobs: torch.Tensor | None = None
    """``[B, S]`` (cross-tokenizer: the group's, at its first position)."""
    # Cross-tokenizer groups (``cross_tokenizer.retokenize``).
    group_offset: torch.Tensor | None = None
    """``[B, S]`` int64 offset back to the first position of the token's aligned group (0 for a 1:1 group)."""
    aligned_mask: torch.Tensor | None = None
    """``[B, S]`` bool: the group's first position has a twin in both vocabularies (``cross_tokenizer=aligned``)."""
    teacher_topk_support: torch.Tensor | None = None
    """``[B, S, K]`` bool: which of the mapped teacher top-k ids exist in the student's vocabulary."""
    # Context parallelism (``split_for_context_parallel``): S is this rank's share of each sequence.
    sequence_tokens: torch.Tensor | None = None
    """``[B]`` each sequence's ``loss_mask`` total over all of it, counted before the split (``sequence_mean``)."""
    context_parallel: ContextParallelSplit | None = None
    """The CP split, for what is read along whole sequences (cross-tokenizer groups, prefix importance weights)."""

    @classmethod
    def of(cls, mb: dict[str, torch.Tensor], context_parallel: ContextParallelSplit | None = None) -> LossBatch:
        """From the schedule's micro-batch dict (``TrainBatch.micro_batches``/``packed_micro_batches`` plus the
        teacher's columns, ``objective.teacher_columns``); keys that are not fields (tokens, positions, THD
        boundaries) are the model's, not the loss's."""
        if (SPLIT_MARKER in mb) != (context_parallel is not None):
            raise ValueError("a micro-batch split over context-parallel ranks needs the split, and only such a one")
        mask = mb["loss_mask"]
        # Packed micro-batches (THD, one row) carry each sample's weight per token.
        weights = mb["token_weights"] if "token_weights" in mb else mb["seq_weights"][:, None].expand_as(mask)
        names = {f.name for f in fields(cls)} - {"weights", "context_parallel"}
        columns = {name: value for name, value in mb.items() if name in names}
        return cls(weights=weights, context_parallel=context_parallel, **columns)

    def _per_token(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in self.NOT_PER_TOKEN and getattr(self, f.name) is not None
        }

    def flatten(self) -> LossBatch:
        """Every per-token field ``[B, S, ...]`` as ``[B * S, ...]``."""
        return replace(
            self, **{k: v.reshape(v.shape[0] * v.shape[1], *v.shape[2:]) for k, v in self._per_token().items()}
        )

    def select(self, index: torch.Tensor) -> LossBatch:
        """The rows ``index`` of a flattened batch (a chunk of the fused output layer)."""
        return replace(self, **{k: v.index_select(0, index) for k, v in self._per_token().items()})


# Micro-batch keys that are per token besides the loss's fields: the model's inputs (with the sampler's routes,
# ``rollout.routing_replay``), and packed rows' weights.
MODEL_COLUMNS: frozenset[str] = frozenset({"tokens", "position_ids", "token_weights", "routes"})
# Keys that are per sample or per micro-batch: never split.
NOT_SPLIT: frozenset[str] = frozenset({"seq_weights", "sequence_tokens", SPLIT_MARKER})
# Padding a per-token column may not repeat the last position's value (it would be trained or grouped).
_ZERO_PADDED = frozenset({"loss_mask", "group_offset", "rollout_logprobs", "drawn_logprobs"})


def split_for_context_parallel(mb: dict[str, torch.Tensor], split: ContextParallelSplit, *, pad_multiple: int):
    """Megatron's context-parallel layout (``get_batch_on_this_cp_rank``) of a padded micro-batch ``[B, S, ...]``:
    every per-token column (the model's inputs and every ``LossBatch`` field) cut to this rank's two chunks.

    ``S`` is first padded to a multiple of ``pad_multiple`` (``2 * CP``; ``2 * CP * TP`` with sequence
    parallelism) by repeating the last position, which predicts nothing trained (its ``loss_mask`` is 0). What needs
    the whole sequence is counted before the split: ``position_ids`` (global positions) and ``sequence_tokens``
    (``sequence_mean``'s per-sequence denominators). A key with no rule here is refused, so no column can reach
    the loss in the full layout while the logits are in the split one.
    """
    if "cu_seqlens" in mb:
        raise ValueError("packed sequences (train.packing=true) cannot be split over context-parallel ranks")
    per_token = ({f.name for f in fields(LossBatch)} - LossBatch.NOT_PER_TOKEN) | MODEL_COLUMNS
    unknown = sorted(set(mb) - per_token - NOT_SPLIT)
    if unknown:
        raise ValueError(f"no rule to split the micro-batch columns {unknown} over context-parallel ranks")
    mb = {**mb, "sequence_tokens": mb["loss_mask"].sum(dim=-1)}
    return split_micro_batch(mb, split, per_token=per_token, pad_multiple=pad_multiple, zero_padded=_ZERO_PADDED)
