"""Runs that learn, per rollout back end: held-out accuracy and divergence to the teacher after a short distillation.

    python benchmarks/bench_learning.py                       # ~10 minutes on 2 cores (vLLM rows skip without vllm)
    python benchmarks/bench_learning.py --seeds 1234,1,2,3 --vllm-seeds 1234,1 --teacher-run runs/quickstart/teacher
    python benchmarks/bench_learning.py --runs vllm:one_step_off --sync-skip model.embed_tokens.weight  # a broken sync
    python benchmarks/bench_learning.py --code /tmp/prefix --runs vllm:zero_step_off   # another checkout's trainer

The settings of ``tests/test_quickstart.py``: the quick start's task and config (``examples/quickstart/``: a
digit-reversal task, a 6.6x smaller student with tied embeddings, TP=2, 64 prompts per step) for ``--steps`` of its
300 steps on its learning-rate schedule (``optim.lr_decay_steps``). The teacher is a quick start's (``--teacher-run``,
else one quick start runs first). Each run is ``python -m megatron_opd.train`` under torchrun; the measures are the
held-out accuracy and ``eval/divergence_teacher_samples`` (the per-token divergence on the teacher's own answers to
the 256 held-out prompts: the same tokens in every run) before the first and after the last step.

The built-in sampler in ``zero_step_off`` runs once per ``--seeds`` seed: the spread of its results is what a
rollout back end's run is held to. The vLLM modes run with ``--vllm-seeds``. ``--sync-skip NAMES`` leaves those
tensors out of every vLLM weight sync (as the tied-embedding bug did) with the fidelity checks off, to show what the
learning bounds catch on their own. ``--code DIR`` runs the trainer of another checkout (e.g. a ``git worktree`` of
an older commit) on this checkout's task and teacher.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "examples" / "quickstart" / "distil.yaml"
MODES = ("zero_step_off", "one_step_off", "two_step_off")
FIXED, ACCURACY = "eval/divergence_teacher_samples", "eval/accuracy"


def train(quickstart: Path, out_dir: Path, code: Path, backend: str, mode: str, seed: int, steps: int,
          sync_skip: str | None) -> dict:  # fmt: skip
    """One run of ``code``'s trainer: its first and last evaluation and its wall time."""
    from megatron_opd.testing.multiprocess import find_free_port, kill_tree

    task = quickstart / "task"
    overrides = {"student.path": task / "student-init", "teacher.path": quickstart / "teacher" / "hf",
                 "data.train_files": task / "train.jsonl", "data.eval_files": task / "eval.jsonl",
                 "parallel.tensor_model_parallel_size": 2, "rollout.backend": backend, "scheduler.mode": mode,
                 "train.steps": steps, "optim.lr_decay_steps": yaml.safe_load(CONFIG.read_text())["train"]["steps"],
                 "seed": seed, "export_hf": False, "logging.progress_bar": False, "output_dir": out_dir}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(code)}
    env.pop("MEGATRON_OPD_FAULT", None)
    if sync_skip and backend == "vllm":
        env["MEGATRON_OPD_SYNC_SKIP"] = sync_skip
        overrides.update({"rollout.startup_check": False, "rollout.max_logprob_diff": 1e9})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               f"--master-port={find_free_port()}", "-m", "megatron_opd.train", "--config", str(CONFIG),
               *(f"{k}={v}" for k, v in overrides.items())]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        kill_tree(proc.pid)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} {mode} seed {seed} failed ({proc.returncode}):\n{out[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if FIXED in r]
    label = backend + (" (sync skips " + sync_skip + ")" if sync_skip and backend == "vllm" else "")
    return {"backend": label, "mode": mode, "seed": seed, "before": evals[0], "after": evals[-1],
            "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="of the quick start's 300, on its LR schedule")
    parser.add_argument("--seeds", default="1234,1,2,3", help="built-in zero_step_off runs, one per seed")
    parser.add_argument("--vllm-seeds", default="1234", help="vLLM runs of every mode, one per seed")
    parser.add_argument("--runs", default=None, help="only these BACKEND:MODE (comma-separated), every seed")
    parser.add_argument("--teacher-run", type=Path, help="a quick start's WORKDIR (its task/ and teacher/)")
    parser.add_argument("--sync-skip", default=None, help="leave these tensors out of vLLM syncs (checks off)")
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose trainer runs (default: this)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    import importlib.util

    plan = [("builtin", "zero_step_off", int(s)) for s in args.seeds.split(",")]
    if importlib.util.find_spec("vllm") is not None:
        plan += [("vllm", m, int(s)) for s in args.vllm_seeds.split(",") for m in MODES]
    if args.runs:
        wanted = {tuple(r.split(":")) for r in args.runs.split(",")}
        plan = [(b, m, s) for b, m, s in plan if (b, m) in wanted]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        quickstart = args.teacher_run
        if quickstart is None:
            quickstart = Path(tmp) / "qs"
            subprocess.run([sys.executable, "examples/quickstart.py", "--workdir", str(quickstart)], cwd=REPO,
                           check=True, capture_output=True)  # fmt: skip
        for backend, mode, seed in plan:
            results.append(train(quickstart.resolve(), Path(tmp) / f"{backend}-{mode}-{seed}", args.code.resolve(),
                                 backend, mode, seed, args.steps, args.sync_skip))  # fmt: skip
            print(json.dumps(results[-1]), flush=True)

    code = "this checkout" if args.code.resolve() == REPO else str(args.code)
    print(f"\n{args.steps} steps of the quick start, trainer of {code}; held-out accuracy and {FIXED}:")
    print("| back end | mode | seed | accuracy before → after | divergence before → after | s |")
    print("| --- | --- | ---: | --- | --- | ---: |")
    for r in results:
        b, a = r["before"], r["after"]
        print(f"| {r['backend']} | {r['mode']} | {r['seed']} | {b[ACCURACY]:.1%} → {a[ACCURACY]:.1%} "
              f"| {b[FIXED]:.4f} → {a[FIXED]:.4f} | {r['seconds']:.0f} |")  # fmt: skip
    reference = [r for r in results if r["backend"] == "builtin"]
    if len(reference) >= 2:
        by_seed = {r["seed"]: r["after"] for r in reference}
        for key in (ACCURACY, FIXED):
            values = [r["after"][key] for r in reference]
            print(f"\nbuilt-in over {len(values)} seeds, {key}: {statistics.mean(values):.4f} ± "
                  f"{statistics.stdev(values):.4f} (sample sd), range {min(values):.4f}-{max(values):.4f}")  # fmt: skip
            for r in results:
                if r["backend"] != "builtin" and r["seed"] in by_seed:
                    d = r["after"][key] - by_seed[r["seed"]][key]
                    print(f"  {r['backend']} {r['mode']} seed {r['seed']}: minus the built-in run's = {d:+.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
