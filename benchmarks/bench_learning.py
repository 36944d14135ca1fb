"""Runs that learn, per rollout back end: held-out divergence to the teacher before and after a short distillation.

    python benchmarks/bench_learning.py                       # ~5 minutes on 2 cores (vLLM rows skip without vllm)
    python benchmarks/bench_learning.py --seeds 1,2,3,4,5,6,7,8 --vllm-seeds 1,2
    python benchmarks/bench_learning.py --code /tmp/prefix --runs vllm:zero_step_off   # another checkout's trainer

Each run is ``python -m megatron_opd.train`` under torchrun (student TP=2, 2 processes) on the tied-student pair of
``megatron_opd.testing.distill_fixture`` with the settings of ``tests/test_async_training.py`` (``--steps`` steps,
4 prompts x ``rollout.n`` 2 per step, lr 1e-3, ``--eval-prompts`` held-out prompts). The measure is
``eval/divergence_teacher_samples``: the per-token divergence to the teacher on the teacher's own greedy answers to
the held-out prompts, made once per run, so it is comparable across runs and back ends. It is evaluated before the
first and after the last step.

The built-in sampler in ``zero_step_off`` runs once per ``--seeds`` seed: the spread of its final value (and of its
fall: the value before training does not depend on the seed) is what a rollout back end's run is held to. The vLLM
modes run with ``--vllm-seeds``. ``--code DIR`` runs the trainer of another checkout (e.g. a ``git worktree`` of an
older commit: its ``cwd`` and ``PYTHONPATH``), on this checkout's fixture; only keys both understand are passed.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("zero_step_off", "one_step_off", "two_step_off")
METRIC = "eval/divergence_teacher_samples"


def train(pair, out_dir: Path, code: Path, backend: str, mode: str, seed: int, steps: int, eval_prompts: int) -> dict:
    """One run of ``code``'s trainer; its evaluations, the monitor's worst value if logged, and the wall time."""
    from megatron_opd.testing.multiprocess import find_free_port, kill_tree

    overrides = pair.overrides(
        out_dir, **{"parallel.tensor_model_parallel_size": 2, "train.steps": steps, "rollout.backend": backend,
                    "rollout.n": 2, "scheduler.mode": mode, "eval.max_prompts": eval_prompts, "seed": seed,
                    "export_hf": False},
    )  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               f"--master-port={find_free_port()}", "-m", "megatron_opd.train", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(code)}
    env.pop("MEGATRON_OPD_FAULT", None)
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_tree(proc.pid)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} {mode} seed {seed} failed ({proc.returncode}):\n{out[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if METRIC in r]
    diffs = [r["rollout/logprob_diff_mean"] for r in rows if "rollout/logprob_diff_mean" in r]
    return {"backend": backend, "mode": mode, "seed": seed, "initial": evals[0][METRIC], "final": evals[-1][METRIC],
            "loss_first": next(r["loss"] for r in rows if "loss" in r),
            "loss_last": [r["loss"] for r in rows if "loss" in r][-1],
            "logprob_diff_mean": max(diffs) if diffs else None, "seconds": seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--seeds", default="1,2,3,4,5", help="built-in zero_step_off runs, one per seed")
    parser.add_argument("--vllm-seeds", default="1", help="vLLM runs of every mode, one per seed")
    parser.add_argument("--runs", default=None, help="only these BACKEND:MODE (comma-separated), every seed")
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose trainer runs (default: this)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    import importlib.util

    from megatron_opd.testing.distill_fixture import make_distill_fixture

    seeds = [int(s) for s in args.seeds.split(",")]
    vllm_seeds = [int(s) for s in args.vllm_seeds.split(",")]
    plan = [("builtin", "zero_step_off", s) for s in seeds]
    if importlib.util.find_spec("vllm") is not None:
        plan += [("vllm", m, s) for s in vllm_seeds for m in MODES]
    if args.runs:
        wanted = {tuple(r.split(":")) for r in args.runs.split(",")}
        plan = [(b, m, s) for b, m, s in plan if (b, m) in wanted]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        pair = make_distill_fixture(Path(tmp) / "pair")
        for backend, mode, seed in plan:
            results.append(train(pair, Path(tmp) / f"{backend}-{mode}-{seed}", args.code.resolve(), backend, mode,
                                 seed, args.steps, args.eval_prompts))  # fmt: skip
            print(json.dumps(results[-1]), flush=True)

    code = "this checkout" if args.code.resolve() == REPO else str(args.code)
    print(f"\n{args.steps} steps, {args.eval_prompts} held-out prompts, trainer of {code}; {METRIC}:")
    print(
        "| back end | mode | seed | before | after | fall | fall % | loss step 1 → last | max logprob_diff_mean | s |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for r in results:
        fall = r["initial"] - r["final"]
        diff = "—" if r["logprob_diff_mean"] is None else f"{r['logprob_diff_mean']:.1e}"
        print(f"| {r['backend']} | {r['mode']} | {r['seed']} | {r['initial']:.5f} | {r['final']:.5f} | {fall:.5f} "
              f"| {100 * fall / r['initial']:.1f} | {r['loss_first']:.4f} → {r['loss_last']:.4f} | {diff} "
              f"| {r['seconds']:.0f} |")  # fmt: skip
    reference = [r for r in results if r["backend"] == "builtin"]
    if len(reference) >= 2:
        finals = [r["final"] for r in reference]
        falls = [r["initial"] - r["final"] for r in reference]
        sd = statistics.stdev(finals)
        print(f"\nbuilt-in over {len(reference)} seeds: after {statistics.mean(finals):.5f} ± {sd:.5f} (sample sd), "
              f"range {min(finals):.5f}-{max(finals):.5f}; fall {statistics.mean(falls):.5f} "
              f"(min {min(falls):.5f}, {100 * min(falls) / reference[0]['initial']:.1f}% of before)")  # fmt: skip
        by_seed = {r["seed"]: r["final"] for r in reference}
        for r in results:
            if r["backend"] != "builtin" and r["seed"] in by_seed:
                d = r["final"] - by_seed[r["seed"]]
                print(
                    f"  {r['backend']} {r['mode']} seed {r['seed']}: after − built-in's = {d:+.5f} ({d / sd:+.1f} sd)"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
