"""Run this node's share of a plan: start its servers, and where the trainer runs, start it once every teacher
server answers a health check (PING) and every vLLM server's ``/health`` (vLLM teachers' too) says 200. Any process
that stops stops the node (Slurm's ``srun --kill-on-bad-exit`` then ends the other nodes)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from megatron_opd.launch.plan import TRAINER, Plan, Process

logger = logging.getLogger("megatron_opd.launch")

POLL_S = 2.0


def this_node(hosts: list[str], node_rank: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """This node's index: ``--node-rank``, else Slurm's ``SLURM_NODEID``, else the host name's place in ``hosts``."""
    if node_rank is None and "SLURM_NODEID" in environ:
        node_rank = int(environ["SLURM_NODEID"])
    if node_rank is None:
        name = socket.gethostname()
        for candidate in (name, name.split(".")[0]):
            if candidate in hosts:
                return hosts.index(candidate)
        raise ValueError(f"this host ({name}) is not in the node list {hosts}: pass --node-rank")
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node-rank {node_rank} is outside the node list {hosts}")
    return node_rank


def _teacher_ready(address: str) -> bool:
    from megatron_opd.teacher.transport import TransportError
    from megatron_opd.teacher.zmq_transport import wait_for_server

    try:
        wait_for_server(address, timeout_s=POLL_S)
        return True
    except TransportError:
        return False


def _vllm_ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=POLL_S) as reply:
            return reply.status == 200
    except OSError:
        return False


def _start(process: Process, log_dir: Path) -> subprocess.Popen:
    logger.info("starting %s: %s", process.job, process.shell())
    env = {**os.environ, **process.env, **process.secrets()}
    if process.job == TRAINER:  # the trainer keeps the terminal; servers log to files (a node may run eight)
        return subprocess.Popen(process.argv, env=env, start_new_session=True)
    with open(log_dir / f"{process.node}.{process.job}.log", "ab") as log:
        return subprocess.Popen(process.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(children: dict[str, subprocess.Popen], grace_s: float = 30.0) -> None:
    for child in children.values():
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)  # each child leads its own session (torchrun and its workers)
    deadline = time.monotonic() + grace_s
    for child in children.values():
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)


def _exited(children: dict[str, subprocess.Popen]) -> tuple[str, int] | None:
    for name, child in children.items():
        if child.poll() is not None:
            return name, child.returncode
    return None


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # Slurm's cancel or time limit: unwind, so the children are stopped


def run_node(plan: Plan, node: int, run_dir: Path, wait_timeout_s: float) -> int:
    """Start and supervise ``node``'s processes; the exit status of the node (the trainer's, where it runs)."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = plan.on_node(node)
    children: dict[str, subprocess.Popen] = {}
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for process in processes:
            if process.job != TRAINER:
                children[process.job] = _start(process, log_dir)
        trainer = [p for p in processes if p.job == TRAINER]
        if trainer:
            deadline = time.monotonic() + wait_timeout_s
            teachers = [("vllm", a.removeprefix("http://")) if a.startswith("http://") else ("teacher", a)
                        for a in plan.teacher_addresses]  # fmt: skip
            pending = teachers + [("vllm", a) for a in plan.rollout_addresses]
            while pending:
                if (gone := _exited(children)) is not None:
                    logger.error("%s exited with %s before the trainer started", *gone)
                    return gone[1] or 1
                if time.monotonic() > deadline:
                    raise TimeoutError(f"servers not ready after {wait_timeout_s:.0f} s: {pending}")
                ready = {"teacher": _teacher_ready, "vllm": _vllm_ready}
                pending = [(kind, a) for kind, a in pending if not ready[kind](a)]
                time.sleep(POLL_S if pending else 0)
            children[TRAINER] = _start(trainer[0], log_dir)
        while (gone := _exited(children)) is None:
            time.sleep(POLL_S)
        name, code = gone
        (logger.info if name == TRAINER and code == 0 else logger.error)("%s exited with %s", name, code)
        return code if name == TRAINER else (code or 1)
    finally:
        _stop(children)
        signal.signal(signal.SIGTERM, previous)
