"""A sequence split over context-parallel ranks in Megatron's layout: ``2 * CP`` equal chunks, rank ``r`` holding
chunks ``r`` and ``2 * CP - 1 - r`` (so every rank's causal attention costs the same), and gathered back in order.
The model's side (attention over the split, micro-batches in this layout): :mod:`megatron_opd.models.context_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def chunk_order(cp_size: int) -> list[int]:
    """The global chunk index of each chunk in the all-gathered (rank-major) order."""
    return [c for rank in range(cp_size) for c in (rank, 2 * cp_size - 1 - rank)]


@dataclass(frozen=True)
class ContextParallelSplit:
    """The CP group and this rank's place in it: slices full sequences to this rank and gathers them back."""

    group: object
    size: int
    rank: int

    @classmethod
    def current(cls) -> ContextParallelSplit | None:
        """The split of Megatron's initialised layout; None without context parallelism."""
        from megatron.core import parallel_state as ps

        size = ps.get_context_parallel_world_size()
        if size == 1:
            return None
        return cls(ps.get_context_parallel_group(), size, ps.get_context_parallel_rank())

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``x`` along ``dim`` (whose length divides by ``2 * CP``)."""
        length = x.shape[dim]
        if length % (2 * self.size):
            raise ValueError(f"a sequence of {length} positions does not split into {2 * self.size} equal chunks")
        chunks = x.unflatten(dim, (2 * self.size, length // (2 * self.size)))
        index = torch.tensor([self.rank, 2 * self.size - 1 - self.rank], device=x.device)
        return chunks.index_select(dim, index).flatten(dim, dim + 1)

    def pad_multiple(self, config) -> int:
        """What a sequence is padded to before the split: ``2 * CP`` chunks, each split over TP with sequence
        parallelism (``config``: the model's ``TransformerConfig``)."""
        return 2 * self.size * (config.tensor_model_parallel_size if config.sequence_parallel else 1)

    @torch.no_grad()
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full sequences ``[B, S, ...]`` from every rank's ``[B, S / CP, ...]`` (no gradient: statistics and
        weights read along whole sequences)."""
        return natural_order(all_gather_sequence(x.contiguous(), 1, self.group, self.size), 1, self.size)


def all_gather_sequence(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    from megatron_opd.distributed.device import collective_device

    device = collective_device()
    parts = [torch.empty_like(x, device=device) for _ in range(size)]
    dist.all_gather(parts, x.to(device), group=group)
    return torch.cat(parts, dim=dim).to(x.device)


def natural_order(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Rank-major chunks (each rank's two) along ``dim`` -> the sequence's natural order."""
    chunks = x.unflatten(dim, (2 * size, x.shape[dim] // (2 * size)))
    inverse = torch.argsort(torch.tensor(chunk_order(size), device=x.device))
    return chunks.index_select(dim, inverse).flatten(dim, dim + 1)
