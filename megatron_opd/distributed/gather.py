"""Reassemble tensor-parallel shards for diagnostics: ``--verify``, the quick start and tests.

Training and the losses never gather the vocabulary; these exist to compare a sharded model with a reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_vocab_shards(logits_local: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's ``[..., V/TP]`` slice into ``[..., V]``."""
    world = dist.get_world_size(group)
    if world == 1:
        return logits_local
    parts = [torch.empty_like(logits_local) for _ in range(world)]
    dist.all_gather(parts, logits_local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def gather_tp_shards(tensor_local: torch.Tensor, group) -> list[torch.Tensor]:
    """Every tensor-parallel rank's copy of an equally shaped shard, in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return [tensor_local]
    parts = [torch.empty_like(tensor_local) for _ in range(world)]
    dist.all_gather(parts, tensor_local.contiguous(), group=group)
    return parts
