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


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch's loss inputs; every tensor field but ``trained_index`` is per token (``[B, S, ...]``)."""

    NOT_PER_TOKEN: ClassVar[frozenset[str]] = frozenset({"trained_index"})

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

    @classmethod
    def of(cls, mb: dict[str, torch.Tensor]) -> LossBatch:
        """From the schedule's micro-batch dict (``TrainBatch.micro_batches``/``packed_micro_batches`` plus the
        teacher's columns, ``objective.teacher_columns``); keys that are not fields (tokens, positions, THD
        boundaries) are the model's, not the loss's."""
        mask = mb["loss_mask"]
        # Packed micro-batches (THD, one row) carry each sample's weight per token.
        weights = mb["token_weights"] if "token_weights" in mb else mb["seq_weights"][:, None].expand_as(mask)
        names = {f.name for f in fields(cls)} - {"weights"}
        return cls(weights=weights, **{name: value for name, value in mb.items() if name in names})

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
