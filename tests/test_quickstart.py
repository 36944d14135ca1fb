"""The README's first command: the quick start distils a tiny teacher into a smaller student and passes its bar."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_distils(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--workdir", str(tmp_path / "qs")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "PASS: divergence at least halved, accuracy up 10+ points" in proc.stdout
    # What a newcomer sees is our output, not pages of library warnings.
    noise = [line for line in out.splitlines() if "Warning" in line or "warnings.warn" in line]
    assert not noise, "unfiltered library warnings:\n" + "\n".join(noise[:20])
    assert (tmp_path / "qs" / "student" / "hf" / "model.safetensors").is_file()
