"""An endless, resumable, deterministic stream of prompts, cut into per-data-parallel-rank batches.

The global order is fixed by the seed alone: epoch ``e`` is a permutation of the usable prompts drawn from
``torch.Generator().manual_seed(seed + e)``, epochs are concatenated, and each step takes the next
``global_batch`` prompts. Data-parallel rank ``r`` of ``dp_size`` gets the ``r``-th contiguous slice of that
global batch, so the ranks together see exactly what a single rank would, whatever the data-parallel size,
and the position is one integer (prompts consumed) that survives a resume at another size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from megatron_opd.data.records import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a batch."""

    index: int
    """Index of the record in the list the stream was built from (skipped prompts included)."""
    prompt_ids: list[int]
    record: dict[str, Any]
    """The raw record (reward functions and scorers read the answer and other fields from it)."""


class PromptStream:
    """Hands out this data-parallel rank's share of each global batch of prompts, across epochs.

    Prompts longer than ``max_prompt_len`` (and empty ones) are skipped when the stream is built, never
    truncated: a cut prompt would ask the student to continue a different question.
    """

    def __init__(
        self,
        prompt_ids: list[list[int]],
        records: list[dict[str, Any]],
        *,
        seed: int,
        shuffle: bool,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_prompt_len: int | None = None,
        key: str = "data.train_files",
    ) -> None:
        if len(prompt_ids) != len(records):
            raise ValueError(f"got {len(prompt_ids)} encoded prompts for {len(records)} records")
        if global_batch < 1:
            raise ValueError(f"train.prompts_per_step must be >= 1, got {global_batch}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is outside a data-parallel size of {dp_size}")
        if global_batch % dp_size:
            raise ValueError(
                f"train.prompts_per_step={global_batch} must be a multiple of the data-parallel size {dp_size} "
                "(each data-parallel rank takes an equal share of the prompts); change one of them"
            )
        self.prompt_ids = prompt_ids
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.max_prompt_len = max_prompt_len

        too_long = 0
        empty = 0
        valid = []
        for i, ids in enumerate(prompt_ids):
            if not ids:
                empty += 1
            elif max_prompt_len is not None and len(ids) > max_prompt_len:
                too_long += 1
            else:
                valid.append(i)
        self._valid = valid
        self.num_skipped = too_long + empty
        if self.num_skipped:
            reasons = []
            if too_long:
                reasons.append(f"{too_long} longer than {max_prompt_len} tokens")
            if empty:
                reasons.append(f"{empty} empty")
            logger.warning(
                "%s: skipping %d of %d prompts (%s); they are never truncated",
                key,
                self.num_skipped,
                len(prompt_ids),
                ", ".join(reasons),
            )
        if not valid:
            raise DataError(
                f"{key}: no usable prompt among {len(prompt_ids)} ({too_long} longer than {max_prompt_len} tokens, "
                f"{empty} empty); raise train.max_seq_len or shorten the prompts"
            )
        self._consumed = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    @property
    def num_prompts(self) -> int:
        """Usable prompts per epoch (after skipping)."""
        return len(self._valid)

    @property
    def consumed(self) -> int:
        """Prompts taken from the global stream so far, over all data-parallel ranks."""
        return self._consumed

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0-based)."""
        return self._consumed // len(self._valid)

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            n = len(self._valid)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(n, generator=generator).tolist()
            else:
                self._perm = list(range(n))
            self._perm_epoch = epoch
        return self._perm

    def _item(self, position: int) -> PromptItem:
        epoch, offset = divmod(position, len(self._valid))
        index = self._valid[self._order(epoch)[offset]]
        return PromptItem(index=index, prompt_ids=self.prompt_ids[index], record=self.records[index])

    def next_batch(self) -> list[PromptItem]:
        """This rank's ``global_batch // dp_size`` prompts of the next global batch; advances every rank alike."""
        per_rank = self.global_batch // self.dp_size
        start = self._consumed + self.dp_rank * per_rank
        batch = [self._item(p) for p in range(start, start + per_rank)]
        self._consumed += self.global_batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position (and what defines the order, to catch a resume on different data)."""
        return {"consumed": self._consumed, "seed": self.seed, "shuffle": self.shuffle, "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (at any data-parallel size)."""
        for name, ours in (("num_prompts", self.num_prompts), ("seed", self.seed), ("shuffle", self.shuffle)):
            if name in state and state[name] != ours:
                raise DataError(
                    f"the checkpoint's prompt stream had {name}={state[name]!r} but this run has {ours!r}, so its "
                    "position would point at different prompts; resume with the same data files, train.max_seq_len, "
                    "seed and data.shuffle, or start a new run"
                )
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ValueError(f"prompt stream state has consumed={consumed}, expected >= 0")
        self._consumed = consumed
