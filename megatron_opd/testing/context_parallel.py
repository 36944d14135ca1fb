"""Megatron's own context-parallel batch split, as the reference the tests compare ours with (0.16 and 0.19)."""

from __future__ import annotations

import inspect
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
