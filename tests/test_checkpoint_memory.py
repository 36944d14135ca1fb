"""The converter streams: a several-GB model converts in both directions with peak memory of a few tensors.

Each conversion runs the CLI in its own process; after it returns, the test reads that process's
peak resident set size from the kernel (``VmHWM`` in ``/proc/self/status``, which -- unlike
``getrusage`` -- does not include the memory of the pytest process that forked it).

Stated bound, checked here:

    peak RSS <= overhead + 2 x largest full Megatron tensor + largest chunk + 128 MiB

where ``overhead`` is the peak of the same command converting a tiny model (interpreter, torch,
Megatron-Core, the meta-device model), measured in the same run.

Disk: the test holds at most two copies of the model (5.5 GB) at once -- the input is deleted, its spot-check tensors
kept in memory, before the export is written -- and removes everything it wrote when it ends, passed or failed
(a CI machine keeps earlier runs' temporary folders; once ran out of disk here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_opd.checkpoint.synthetic import SyntheticLlama, write_synthetic_llama

REPO = Path(__file__).resolve().parents[1]
CONVERT = REPO / "tools" / "checkpoint" / "convert.py"
SLACK = 128 * 2**20

# Run the CLI's main() in-process, then report the kernel's peak RSS of this very process.
_WRAPPER = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    code = runpy.run_path(sys.argv[0])["main"]()
except SystemExit as exit_:
    code = exit_.code or 0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(f"VMHWM_KIB={hwm}")
sys.exit(code)
"""


def run_cli(*args: str) -> tuple[str, int]:
    """Run convert.py with ``args``; return (output, peak RSS in bytes)."""
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, str(CONVERT), *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"convert.py {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("VMHWM_KIB=")]
    return proc.stdout, int(line.split("=")[1]) * 1024


SPOT_CHECKS = ("model.embed_tokens.weight", "model.layers.17.mlp.up_proj.weight", "lm_head.weight")


@pytest.fixture
def scratch(tmp_path):
    """``tmp_path``, removed when the test ends, passed or failed: it holds two copies of a 2.6 GB model."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc accounting")
def test_streaming_conversion_peak_memory(tiny_model_dirs, scratch):
    from megatron_opd.models.hf_io import HFCheckpointReader

    shape = SyntheticLlama()  # 40 layers, hidden 1024, ffn 4096, vocab 8000: 2.75 GB in float32
    model_bytes = shape.nbytes(torch.float32)
    hf_dir = write_synthetic_llama(scratch / "synthetic", shape, max_shard_bytes=256 * 2**20)
    assert len(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]) == 363
    # Largest full Megatron tensor: the fused gate/up weight [2F, H] or the padded embedding [8192, H].
    largest_full = max(2 * shape.intermediate_size, 8192) * shape.hidden_size * 4
    largest_chunk = largest_full // 2  # TP=2 halves both

    _, overhead = run_cli(
        "hf-to-mcore", "--hf-dir", tiny_model_dirs["qwen3"], "--out", str(scratch / "tiny"), "--tp", "2", "--pp", "2"
    )
    bound = overhead + 2 * largest_full + largest_chunk + SLACK
    assert bound < model_bytes / 3, "the synthetic model is too small for the bound to mean anything"

    out, to_mcore = run_cli(
        "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(scratch / "mcore"), "--tp", "2", "--pp", "2"
    )
    assert "wrote" in out
    reader = HFCheckpointReader(hf_dir)
    original = {name: reader.get(name) for name in SPOT_CHECKS}
    shutil.rmtree(hf_dir)
    out, to_hf = run_cli(
        "mcore-to-hf", "--ckpt", str(scratch / "mcore"), "--out", str(scratch / "back"), "--max-shard-size", "1GB"
    )
    mib = 2**20
    report = (
        f"model {model_bytes / mib:.0f} MiB, overhead {overhead / mib:.0f} MiB, bound {bound / mib:.0f} MiB, "
        f"hf-to-mcore peak {to_mcore / mib:.0f} MiB, mcore-to-hf peak {to_hf / mib:.0f} MiB"
    )
    print(report)
    assert to_mcore <= bound, report
    # mcore-to-hf holds one layer group (16.8M parameters, 64 MiB here) and its Hugging Face pieces.
    h, f = shape.hidden_size, shape.intermediate_size
    layer_bytes = (4 * h * h + 3 * h * f) * 4
    assert to_hf <= overhead + 2 * max(layer_bytes, largest_full) + SLACK, report
    # The export is the original model again (spot check; the tiny round trips check every tensor).
    back = HFCheckpointReader(scratch / "back")
    for name, tensor in original.items():
        assert torch.equal(tensor, back.get(name)), name
