"""Throughput and peak memory of the streaming checkpoint converter against the naive route, in one run.

    python benchmarks/bench_convert.py                       # ~2.6 GiB synthetic Llama in float32
    python benchmarks/bench_convert.py --layers 80 --keep    # bigger model, keep the files

The naive route is what most converters do: ``transformers`` loads the whole model, a full
Megatron-Core model is built (TP=1, no random initialisation) and filled from it, and
``dist_checkpointing.save`` writes it. The streaming route is ``tools/checkpoint/convert.py``.
Every route runs in its own process; peak RSS is the kernel's ``VmHWM`` of that process, read by
the process itself when it finishes; throughput is model bytes over the process's wall time
(imports included, the same for every route). Prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVERT = REPO / "tools" / "checkpoint" / "convert.py"

_REPORT_HWM = """
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(f"VMHWM_KIB={hwm}")
"""
# Runs convert.py's main() in this process, then reports this process's peak RSS.
_CLI_WRAPPER = (
    """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit_:
    if exit_.code:
        raise
"""
    + _REPORT_HWM
)


def naive_hf_to_mcore(hf_dir: str, out: str) -> None:
    """Load with transformers, fill a full Megatron model, save with dist_checkpointing (one process)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from transformers import AutoModelForCausalLM

    from megatron_opd.distributed.cpu_compat import apply_cpu_patches
    from megatron_opd.distributed.parallel import ParallelConfig, initialize_model_parallel
    from megatron_opd.models.builder import ModelBuildConfig, build_model_chunk, transformer_config
    from megatron_opd.models.hf_config import load_architecture
    from megatron_opd.models.name_mapping import expand_rules, hf_to_megatron

    apply_cpu_patches()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    initialize_model_parallel(ParallelConfig())
    arch = load_architecture(hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_state = hf_model.state_dict()
    config = transformer_config(arch, ParallelConfig(), ModelBuildConfig(dtype="fp32"))
    config.perform_initialization = False  # random init would only add time to the naive route
    padded = arch.padded_vocab_size(1)
    model = build_model_chunk(
        arch, config, te=False, vp_stage=None, pre_process=True, post_process=True, padded_vocab_size=padded
    )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for rule, layer in expand_rules(arch):
            full = hf_to_megatron(rule, [hf_state[n] for n in rule.hf_names(layer)], arch, padded)
            params[rule.megatron_name(layer)].copy_(full)
    del hf_model, hf_state
    Path(out).mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, list[int], str]:
    """Run ``cmd``; return wall seconds, every reported peak RSS (bytes) and the output."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    peaks = [int(line.split("=")[1]) * 1024 for line in proc.stdout.splitlines() if line.startswith("VMHWM_KIB=")]
    if not peaks:  # torchrun ranks report their own VmHWM in convert.py's summary line
        peaks = [int(float(x) * 2**30) for x in _summary_peaks(proc.stdout)]
    return wall, peaks, proc.stdout


def _summary_peaks(output: str) -> list[str]:
    import re

    return re.findall(r"peak RSS ([0-9.]+) GiB", output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=40, help="transformer layers of the synthetic Llama")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size")
    parser.add_argument("--ffn", type=int, default=4096, help="SwiGLU width")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--naive-worker", nargs=2, metavar=("HF_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_worker:
        naive_hf_to_mcore(*args.naive_worker)
        exec(_REPORT_HWM)
        return

    import torch

    from megatron_opd.checkpoint.synthetic import SyntheticLlama, write_synthetic_llama

    shape = SyntheticLlama(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers)
    model_bytes = shape.nbytes(torch.float32)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        hf_dir = work / "hf"
        if not (hf_dir / "config.json").exists():
            write_synthetic_llama(hf_dir, shape, max_shard_bytes=512 * 2**20)
        largest = max(2 * shape.intermediate_size, 8192) * shape.hidden_size * 4
        py = sys.executable
        stream = [py, "-c", _CLI_WRAPPER, str(CONVERT)]
        torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533", str(CONVERT)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        routes = [
            ("naive: transformers load + Megatron model + dist_checkpointing.save", "TP1",
             [py, __file__, "--naive-worker", str(hf_dir), str(work / "naive")], None),
            ("streaming hf-to-mcore (1 process)", "TP1",
             [*stream, "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(work / "s1"), "--no-progress"], None),
            ("streaming hf-to-mcore (1 process)", "TP2xPP2", [*stream, "hf-to-mcore", "--hf-dir", str(hf_dir),
             "--out", str(work / "s4"), "--tp", "2", "--pp", "2", "--no-progress"], None),
            ("streaming hf-to-mcore (torchrun, 2 processes)", "TP2xPP2", [*torchrun, "hf-to-mcore", "--hf-dir",
             str(hf_dir), "--out", str(work / "s4r"), "--tp", "2", "--pp", "2", "--no-progress"], env),
            ("streaming mcore-to-hf (1 process)", "from TP2xPP2", [*stream, "mcore-to-hf", "--ckpt",
             str(work / "s4"), "--out", str(work / "back"), "--no-progress"], None),
        ]  # fmt: skip
        for previous in ("naive", "s1", "s4", "s4r", "back"):
            shutil.rmtree(work / previous, ignore_errors=True)
        rows = []
        for name, layout, cmd, run_env in routes:
            print(f"running: {name} [{layout}] ...", file=sys.stderr, flush=True)
            wall, peaks, _ = measure(cmd, run_env)
            rows.append((name, layout, wall, model_bytes / 1e6 / wall, max(peaks)))
        naive = rows[0]
        gib = 2**30
        print(f"\nSynthetic Llama: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab 8000, float32: "
              f"{model_bytes / gib:.2f} GiB in {len(list(hf_dir.glob('*.safetensors')))} safetensors shards; "
              f"largest full Megatron tensor {largest / 2**20:.0f} MiB. "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}.\n")  # fmt: skip
        print(
            "| route | layout | wall time (s) | throughput (MB/s) | peak RSS (GiB) | speed vs naive | peak RSS vs naive |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, layout, wall, rate, peak in rows:
            print(
                f"| {name} | {layout} | {wall:.1f} | {rate:.0f} | {peak / gib:.2f} | "
                f"{rate / naive[3]:.2f}x | {peak / naive[4]:.2f}x |"
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
