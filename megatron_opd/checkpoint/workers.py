"""The processes a conversion runs on: one, or every rank ``torchrun`` started.

Conversion is CPU work coordinated with gloo whatever the accelerator: ranks only exchange small
plans and file lists. Work is split into contiguous runs of roughly equal bytes, so each rank reads
its own stretch of the source files.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from megatron_opd.checkpoint.atomic import commit_staging_dir, discard_staging_dir

T = TypeVar("T")


@dataclass(frozen=True)
class Workers:
    """This process's place among the conversion processes."""

    rank: int
    world_size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (so all ranks take the same branch after a failure)."""
        return all(self.gather(ok))

    def finish_output(self, ok: bool, staging: Path, out_dir: str | os.PathLike, force: bool) -> None:
        """Rank 0 moves the staging folder into place when every rank succeeded, and removes it otherwise."""
        all_ok = self.all_ok(ok)
        if self.is_first:
            if all_ok:
                commit_staging_dir(staging, out_dir, force)
            else:
                discard_staging_dir(staging)
        self.barrier()


# torchrun's store, joined once per process and kept: re-creating a TCPStore on MASTER_PORT for every
# conversion races (a fast rank can join the previous conversion's server before it closes and hang).
_LAUNCH_STORE: tuple | None = None
_CONVERSIONS = itertools.count()


def _launch_store(timeout: timedelta) -> tuple:
    global _LAUNCH_STORE
    if _LAUNCH_STORE is None:
        _LAUNCH_STORE = next(dist.rendezvous("env://", timeout=timeout))
    return _LAUNCH_STORE


@contextlib.contextmanager
def conversion_workers(timeout_s: float = 4 * 3600.0) -> Iterator[Workers]:
    """Join torchrun's ranks over gloo (or form a one-process group) for the duration of a conversion.

    An existing default process group is used as is and left alone. Every conversion gets a fresh
    group on its own prefix of one store, so all ranks must run the same conversions in the same order.
    """
    from megatron_opd.distributed.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    if dist.is_initialized():
        yield Workers(dist.get_rank(), dist.get_world_size())
        return
    timeout = timedelta(seconds=timeout_s)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        store, rank, world = _launch_store(timeout)
        store = dist.PrefixStore(f"megatron_opd/conversion/{next(_CONVERSIONS)}/", store)
    else:
        store, rank, world = dist.HashStore(), 0, 1
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        yield Workers(rank, world)
    finally:
        dist.destroy_process_group()


def split_contiguous(items: Sequence[T], sizes: Sequence[int], parts: int, part: int) -> list[T]:
    """The ``part``-th of ``parts`` contiguous runs of ``items`` with about equal total ``sizes``."""
    total = sum(sizes) or 1
    chosen, start = [], 0
    for item, size in zip(items, sizes):
        middle = start + size / 2  # an item goes to the part its middle byte falls in
        if min(int(middle * parts // total), parts - 1) == part:
            chosen.append(item)
        start += size
    return chosen


def _child_main(conn, fn: Callable[..., Any], args: tuple) -> None:
    import traceback

    try:
        conn.send((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the child's traceback
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()
    from megatron_opd.process_exit import exit_now

    exit_now(0)  # the parent has the result (or the traceback); it joins this process next


def run_in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a spawned process: no Megatron or process-group state leaks either way.

    ``fn`` must be importable; torchrun's variables are hidden from the child so it forms its own groups.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    hidden = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if k in os.environ}
    try:
        proc = ctx.Process(target=_child_main, args=(child, fn, args))
        proc.start()
    finally:
        os.environ.update(hidden)
    child.close()
    try:
        ok, value = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{fn.__name__} died in its child process (exit code {proc.exitcode})") from None
    proc.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its child process:\n{value}")
    return value
