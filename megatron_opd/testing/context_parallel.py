"""Megatron's own context-parallel batch split, as the reference the tests compare ours with (0.16 and 0.19)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from unittest import mock

import torch


class StandInGroup:
    """A process group as far as Megatron's split reads one: its size and this rank's place."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def megatron_cp_split(batch: dict[str, torch.Tensor], group: StandInGroup) -> dict[str, torch.Tensor]:
    """``get_batch_on_this_cp_rank`` of ``batch`` for ``group``, without a process group (0.16 reads the group's
    size through ``get_pg_size``, which answers 1 without one; 0.19 through ``torch.distributed``)."""
    from megatron.core import utils

    size, rank = (lambda g=None: g.size()), (lambda g=None: g.rank())
    with (
        mock.patch.object(utils, "get_pg_size", size, create=True),
        mock.patch.object(utils, "get_pg_rank", rank, create=True),
        mock.patch.object(torch.distributed, "get_world_size", size),
        mock.patch.object(torch.distributed, "get_rank", rank),
    ):
        if "is_hybrid_cp" in inspect.signature(utils.get_batch_on_this_cp_rank).parameters:  # 0.19
            return utils.get_batch_on_this_cp_rank(dict(batch), False, cp_group=group)
        return utils.get_batch_on_this_cp_rank(dict(batch), cp_group=group)


def stand_in_cp_ranks(q, k, v, size: int = 2) -> Iterator[tuple[StandInGroup, object, tuple]]:
    """For each of ``size`` context-parallel ranks without a process group: its group, its ``ContextParallelSplit`` and
    its local ``(q, k, v)`` (``[s, b, heads, d]``, split along ``s``), while ``SDPAttention``'s K/V all-gather answers
    that rank's local K/V with the whole sequence's."""
    from megatron_opd.models import context_parallel
    from megatron_opd.models.context_parallel import ContextParallelSplit

    for rank in range(size):
        group = StandInGroup(size, rank)
        split = ContextParallelSplit(group, size, rank)
        local = tuple(split.split(x, 0) for x in (q, k, v))
        # The module gathers its local K/V as [b, g, s, d] views: each stands for the whole sequence's.
        whole = {local[1].data_ptr(): k.permute(1, 2, 0, 3), local[2].data_ptr(): v.permute(1, 2, 0, 3)}
        with mock.patch.object(
            context_parallel._GatherSequence, "apply", lambda x, dim, split, kv=whole: kv[x.data_ptr()]
        ):
            yield group, split, local
