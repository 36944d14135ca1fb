"""The quick start runs under a real torchrun: one node with two processes, and two single-process nodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_opd.testing.multiprocess import find_free_port

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(args: list[str], timeout: float = 240) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def test_quickstart_single_node_tp2(tmp_path):
    port = find_free_port()
    out = _finish(
        _torchrun([f"--master-port={port}", "--nproc-per-node=2", "examples/quickstart.py", f"workdir={tmp_path}"])
    )
    assert "PASS" in out and "TP=2" in out and "(1, 12, 512)" in out


def test_quickstart_two_nodes(tmp_path):
    """Two torchrun agents (node ranks 0 and 1) rendezvous over loopback like two machines would."""
    port = find_free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    script = ["examples/quickstart.py", f"workdir={tmp_path}", "family=llama"]
    nodes = [_torchrun([*common, f"--node-rank={r}", *script]) for r in (0, 1)]
    outs = [_finish(p) for p in nodes]
    assert "PASS" in outs[0] and "TP=2" in outs[0]
