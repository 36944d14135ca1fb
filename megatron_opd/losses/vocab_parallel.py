"""Where this rank's vocabulary shard sits, and the per-token collectives that stand in for a full softmax.

Under tensor parallelism each rank holds ``[tokens, V/TP]`` logits. A softmax over the whole vocabulary only
needs, per token, the global maximum and the global sum of ``exp(logit - max)``; a divergence additionally needs a
few weighted partial sums. This module owns those per-token reductions so the losses never gather the vocabulary:
what crosses ranks is ``[tokens, a few]`` (or ``[tokens, k]`` for top-k ids), never ``[tokens, V]``.

It also resolves ``group=None`` to Megatron-Core's tensor-parallel group, but only when the program already
imported and initialised ``megatron.core.parallel_state``; this module never imports Megatron itself.

Shape legend: ``T`` tokens, ``V`` local (shard) vocabulary columns, ``N`` a handful of per-token scalars.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_opd.kernels.divergence_torch import finite_or_zero

__all__ = [
    "VocabShard",
    "all_reduce_max_",
    "all_reduce_sum_",
    "finite_or_zero",
    "make_vocab_shard",
    "resolve_group",
    "rescale_factor",
]


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocabulary that is split evenly over a tensor-parallel group.

    Megatron-Core splits the (padded) vocabulary into ``world_size`` equal contiguous slices, rank ``r`` holding
    global ids ``[r * width, (r + 1) * width)``. Padding columns (global id ``>= vocab_size``) sit at the end of
    the vocabulary, so on every rank the real columns are a prefix of the shard: ``[0, valid_width)``.
    """

    group: dist.ProcessGroup | None
    """The tensor-parallel group, or ``None`` for a single process (no collectives)."""
    rank: int
    """This rank's index within ``group``."""
    world_size: int
    """Number of ranks the vocabulary is split over."""
    width: int
    """Columns in every rank's shard (padded vocabulary / world_size)."""
    vocab_size: int
    """The true vocabulary size; ids at or above it are padding."""

    @property
    def start(self) -> int:
        """Global id of this shard's first column."""
        return self.rank * self.width

    @property
    def valid_width(self) -> int:
        """Number of leading shard columns that are real tokens (the rest are padding)."""
        return max(0, min(self.width, self.vocab_size - self.start))

    @property
    def distributed(self) -> bool:
        """Whether per-token reductions must cross ranks."""
        return self.group is not None and self.world_size > 1


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """Return the process group the vocabulary is split over, or ``None`` for a single process.

    ``group=None`` means Megatron-Core's tensor-parallel group when ``parallel_state`` is initialised, else a single
    process. Megatron is never imported here: if the program has not imported ``megatron.core.parallel_state``, it
    cannot have initialised it.
    """
    if group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialised; call init_process_group first")
        return group
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        return None
    is_initialized = getattr(parallel_state, "model_parallel_is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def make_vocab_shard(width: int, group: dist.ProcessGroup | None, vocab_size: int | None) -> VocabShard:
    """Describe this rank's shard of a vocabulary whose shards are each ``width`` columns wide."""
    group = resolve_group(group)
    if group is None:
        rank, world_size = 0, 1
    else:
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    padded = width * world_size
    if vocab_size is None:
        vocab_size = padded
    if group is None and vocab_size > padded:
        # A shard with no group to reduce over would give per-shard losses and blame ids on other shards.
        raise ValueError(
            f"vocab_size={vocab_size} is larger than the logits' {width} columns, so they look like one rank's shard "
            "of the vocabulary, but no tensor-parallel group is available (group=None and Megatron's parallel_state "
            "is not initialised): pass group= (the tensor-parallel group) or initialise Megatron's parallel state "
            f"first; for unsharded logits vocab_size must be at most {width}"
        )
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} must be between 1 and the padded vocabulary {padded} "
            f"(shard width {width} x {world_size} ranks); pass the tokenizer's true vocabulary size"
        )
    return VocabShard(group=group, rank=rank, world_size=world_size, width=width, vocab_size=vocab_size)


def all_reduce_max_(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """In-place max over the shard's ranks (a no-op for one process). Only per-token scalars go through here."""
    if shard.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=shard.group)
    return x


def all_reduce_sum_(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """In-place sum over the shard's ranks (a no-op for one process). Only per-token scalars go through here."""
    if shard.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=shard.group)
    return x


def rescale_factor(local_max_T: torch.Tensor, global_max_T: torch.Tensor) -> torch.Tensor:
    """``exp(local_max - global_max)``, and 0 where this rank saw no finite logit (its partial sums are 0 there)."""
    factor_T = torch.exp(finite_or_zero(local_max_T) - finite_or_zero(global_max_T))
    return torch.where(torch.isfinite(local_max_T), factor_T, torch.zeros_like(factor_T))
