"""The Triton kernels run on this CPU machine too: the kernel tests again, under triton's interpreter.

``TRITON_INTERPRET`` is read when kernels are defined, so it must be set before ``kernels`` is imported:
a separate pytest process. The main run keeps the compiler path (the ahead-of-time sm_90 compile test).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run compiled in test_kernels_triton.py")
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["tests/test_kernels_triton.py", "tests/test_kernels_rmsnorm.py", "tests/test_kernels_moe_router.py"]
        + ["tests/test_kernels_moe_dispatch.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 20, out.stdout[-2000:]
