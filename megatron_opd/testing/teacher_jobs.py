"""Launch a real teacher server job for tests and benchmarks, and stop it.

A server's ranks start as torchrun starts them, on loopback with a free master port and one thread per process, but
fork from the rank server (``RankJob``: no import of torch and Megatron-Core per rank, no torchrun agent). Stopping
kills every rank and what it started.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatron_opd.testing.multiprocess import RankJob


def start_teacher_server(
    model: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    port: int,
    ready_file: str | os.PathLike,
    log_file: str | os.PathLike,
    extra_args: list[str] = (),
    env: dict[str, str] | None = None,
) -> RankJob:
    """``torchrun --nproc-per-node tp*pp*cp*ep -m megatron_opd.teacher.serve`` as a ``RankJob``; output to
    ``log_file``."""
    Path(ready_file).unlink(missing_ok=True)
    argv = [
        "--model", str(model), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--ep", str(ep), "--port", str(port),
        "--ready-file", str(ready_file), *extra_args,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if env is None or "MEGATRON_OPD_TEACHER_FAULT" not in env:
        full_env.pop("MEGATRON_OPD_TEACHER_FAULT", None)
    return RankJob("megatron_opd.teacher.serve", argv, nproc=tp * pp * cp * ep, env=full_env, log_file=log_file)


def wait_ready(proc: RankJob, ready_file: str | os.PathLike, log_file: str, timeout: float = 240) -> str:
    """The server's address once ``ready_file`` appears; raises with the log's tail if it died or took too long."""
    deadline = time.monotonic() + timeout
    while not Path(ready_file).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = Path(log_file).read_text(errors="replace")[-3000:]
            stop(proc)
            raise RuntimeError(f"teacher server not ready (exit code {proc.returncode}):\n{tail}")
        time.sleep(0.2)
    return json.loads(Path(ready_file).read_text())["address"]


def stop(proc: RankJob) -> None:
    """Kill the server job: all its ranks and what they started (idempotent)."""
    proc.kill()
    proc.wait(timeout=30)


def train_metrics(output_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
