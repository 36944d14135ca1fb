"""Resumable training checkpoints with Megatron-Core ``dist_checkpointing``, written so a crash never loses one.

Layout of ``checkpoint.dir``::

    step_00000010/   a complete dist_ckpt: model, optimizer, LR schedule, RNG states, data position, step, config
    step_00000020/
    latest           the name of the newest complete checkpoint (replaced atomically)
    .lock            held (flock) by the run using this folder (not by the processes it forks)

A save writes ``tmp.step_N`` first, then renames it and only then moves ``latest``: a run killed during a save
leaves the previous checkpoint as ``latest``. Older checkpoints beyond ``keep_last`` are deleted after the new one
is in place. Fault-injection hooks (tests only): ``MEGATRON_OPD_FAULT=abort_during_save:N`` kills the process after
the tensors of step N are written but before the checkpoint is committed; ``kill_after_step:N`` right after step N
(and its checkpoint, if one is due) is done. ``MEGATRON_OPD_HOLD=2,5@DIR`` pauses every rank after steps 2 and 5
(writing ``DIR/held_2`` and waiting for ``DIR/release_2``), so a test can kill and restart servers mid-run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import socket
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_opd.distributed.device import collective_device
from megatron_opd.faults import fault_point
from megatron_opd.models.hf_io import CheckpointError

logger = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.json"


class CheckpointLockedError(RuntimeError):
    """Another run holds ``checkpoint.dir``."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _close_lock_in_forked_child(manager_ref: weakref.ref) -> None:
    """In a child forked while the run holds ``.lock``: close the child's copy of the file. A flock belongs to the open
    file, which fork shares, so a child that outlived a killed run (dist_checkpointing's forked Manager polls for its
    parent once a second) held the folder against the run's restart; closing a copy leaves the parent's lock as is."""
    manager = manager_ref()
    if manager is not None and manager._lock_file is not None:
        manager._lock_file.close()
        manager._lock_file = None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict[str, Any]:
    """Every random stream this process draws from (CPU/accelerator generators, Megatron's tracker)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed_rng(seed: int, step: int) -> int:
    """Fresh random streams for a resume at another layout, where the saved per-rank states have no owner: seeded
    from ``seed`` and ``step`` (``seed`` alone would replay the first steps' streams). Returns the seed used."""
    from megatron_opd.distributed.parallel import seed_rng

    derived = seed + 7919 * step
    seed_rng(derived)
    return derived


def sharded_rng_state():
    """This rank's RNG states as a ``ShardedObject``: one per pipeline x tensor x data-parallel rank, and x
    context-parallel rank at CP > 1 (a fourth axis only then, so the keys of CP=1 checkpoints stay as they were;
    ``trainer.resharding`` reads both)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = [
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    ]
    offset = [
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    ]
    if ps.get_context_parallel_world_size() > 1:  # CP ranks draw their own dropout masks
        shape.append(ps.get_context_parallel_world_size())
        offset.append(ps.get_context_parallel_rank())
    return ShardedObject("rng_state", rng_state(), tuple(shape), tuple(offset), replica_id=0)


class CheckpointManager:
    """Save, find and load the training checkpoints of one run folder."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.dir = Path(directory)
        self.keep_last = keep_last
        self._lock_file = None
        self._previous_owner = ""

    # ---- the run's lock --------------------------------------------------------------------------------------
    def acquire_lock(self) -> None:
        """Refuse to start when another run uses this folder (a collective: every rank raises the same error)."""
        error = None
        if _rank0():
            self.dir.mkdir(parents=True, exist_ok=True)
            lock = open(self.dir / ".lock", "a+")  # noqa: SIM115 - held for the whole run
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.seek(0)
                owner = lock.read().strip() or "another process"
                lock.close()
                error = (
                    f"checkpoint.dir {self.dir} is in use by {owner}; wait for that run to finish, or give this "
                    "run another checkpoint.dir"
                )
            else:
                lock.seek(0)
                self._previous_owner = lock.read()
                lock.seek(0)
                lock.truncate()
                lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
                lock.flush()
                self._lock_file = lock
                os.register_at_fork(after_in_child=functools.partial(_close_lock_in_forked_child, weakref.ref(self)))
                for stale in self.dir.glob("tmp.step_*"):  # an interrupted save: never committed
                    shutil.rmtree(stale, ignore_errors=True)
        error = _broadcast(error)
        if error:
            raise CheckpointLockedError(error)

    def release_lock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    @contextlib.contextmanager
    def starting(self):
        """A start that fails inside (a refused resume) hands the folder back as it found it: the previous run's
        line back in ``.lock``, and the lock released, so the error is all that changed."""
        try:
            yield
        except BaseException:
            if self._lock_file is not None:
                self._lock_file.seek(0)
                self._lock_file.truncate()
                self._lock_file.write(self._previous_owner)
                self._lock_file.flush()
            self.release_lock()
            raise

    # ---- finding ---------------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None for a fresh run; a dangling pointer is a clear error."""
        pointer = self.dir / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        path = self.dir / name
        if not (path / STATE_FILE).is_file() or not (path / "metadata.json").is_file():
            raise CheckpointError(
                f"{pointer} names {name!r}, but {path} is missing or incomplete; write the name of a complete "
                f"step_N folder into {pointer}, or remove {pointer} to start from scratch"
            )
        return path

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, sharded_state_dict: dict, info: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` (a collective); ``info`` is saved as JSON beside it for people and tools."""
        from megatron.core import dist_checkpointing

        final = self.dir / step_dir_name(step)
        staging = self.dir / f"tmp.{step_dir_name(step)}"
        if _rank0():
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        _barrier()
        dist_checkpointing.save(sharded_state_dict, str(staging))
        _barrier()
        fault_point("abort_during_save", step)
        if _rank0():
            with open(staging / STATE_FILE, "w") as f:
                json.dump({"step": step, **info}, f, indent=2, default=str)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            tmp_pointer = self.dir / f"{LATEST}.tmp"
            tmp_pointer.write_text(final.name + "\n")
            os.replace(tmp_pointer, self.dir / LATEST)
            _fsync_dir(self.dir)
            self._prune()
        _barrier()
        logger.info("saved checkpoint %s", final)
        return final

    def _prune(self) -> None:
        steps = sorted(p for p in self.dir.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- loading ---------------------------------------------------------------------------------------------
    def load(self, path: Path, sharded_state_dict: dict) -> dict:
        """Load ``sharded_state_dict`` from checkpoint ``path`` (a collective); damaged files give a clear error."""
        from megatron_opd.checkpoint.mcore_io import load_dist_checkpoint

        try:
            return load_dist_checkpoint(sharded_state_dict, path)
        except CheckpointError as err:
            raise CheckpointError(
                f"{err}. Point {self.dir / LATEST} at an earlier step_N folder, or remove it to start from scratch"
            ) from err


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PreemptionGuard:
    """Turns SIGTERM (pre-emption, ``scancel``, torchrun shutting down) into a save-and-exit at the next step."""

    def __init__(self) -> None:
        self._flag = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self._flag = True

    def should_stop(self) -> bool:
        """Whether any rank was signalled (a collective, so every rank stops at the same step)."""
        flag = torch.tensor([1.0 if self._flag else 0.0], device=collective_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
