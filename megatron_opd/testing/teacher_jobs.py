"""Launch a real teacher server job (torchrun, its own process group) for tests and benchmarks, and stop it.

Servers run under ``torchrun --standalone``-like settings on loopback with a free master port, one thread per
process. Stopping kills torchrun and every descendant (its workers live in sessions of their own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_opd.testing.multiprocess import ROOT, find_free_port, kill_tree


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
) -> subprocess.Popen:
    """``torchrun --nproc-per-node tp*pp*cp*ep -m megatron_opd.teacher.serve`` in a new session; output to
    ``log_file``."""
    Path(ready_file).unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp * pp * cp * ep}",
        f"--master-port={find_free_port()}", "-m", "megatron_opd.teacher.serve", "--model", str(model),
        "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--ep", str(ep), "--port", str(port), "--ready-file", str(ready_file), *extra_args,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if env is None or "MEGATRON_OPD_TEACHER_FAULT" not in env:
        full_env.pop("MEGATRON_OPD_TEACHER_FAULT", None)
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            command, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_ready(proc: subprocess.Popen, ready_file: str | os.PathLike, log_file: str, timeout: float = 240) -> str:
    """The server's address once ``ready_file`` appears; raises with the log's tail if it died or took too long."""
    deadline = time.monotonic() + timeout
    while not Path(ready_file).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = Path(log_file).read_text(errors="replace")[-3000:]
            stop(proc)
            raise RuntimeError(f"teacher server not ready (exit code {proc.returncode}):\n{tail}")
        time.sleep(0.2)
    return json.loads(Path(ready_file).read_text())["address"]


def stop(proc: subprocess.Popen) -> None:
    """Kill the server job: torchrun and all its ranks (idempotent)."""
    kill_tree(proc.pid)
    proc.wait(timeout=30)


def train_metrics(output_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
