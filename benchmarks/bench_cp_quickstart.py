"""The quick start's distillation at context parallelism, CP=2 against CP=1 on the same 2 ranks, whole runs as composed.

    python benchmarks/bench_cp_quickstart.py                      # teacher + 7 runs of 300 steps, ~20 min on 2 cores
    python benchmarks/bench_cp_quickstart.py --teacher-run /tmp/qs/teacher --task /tmp/qs/task --steps 150
    python benchmarks/bench_cp_quickstart.py --seeds 1 --no-resume --json out.json

The quick start's task and models (``tools/make_quickstart_task.py``: digit reversal, a 6.6x smaller student with
tied embeddings) and its teacher (SFT with ``examples/quickstart/teacher_sft.yaml`` at TP=2, trained here once unless
``--teacher-run`` names one). The student distils with ``examples/quickstart/distil.yaml`` under torchrun with two
ranks in both layouts, so that only the layout differs:

- ``CP=1``: TP=1, data-parallel size 2 (each rank 32 of the step's 64 prompts, whole sequences);
- ``CP=2``: TP=1, ``parallel.context_parallel_size=2``, data-parallel size 1 (each rank half of every sequence).

Both with ``rollout.backend=vllm``, ``train.packing=false`` (CP needs unpacked batches), ``train.micro_batch_size=32``
(a divisor of the 32 prompts per rank at DP=2), evaluation on ``data.eval_files`` (256 held-out prompts, every
``--eval-every`` steps and before the first and after the last) and checkpoints every ``--checkpoint-every`` steps,
one run per ``--seeds`` seed and layout. ``--steps`` shortens the run on the quick start's 300-step learning-rate
schedule (``optim.lr_decay_steps``). One more CP=2 run (``--resume-seed``, default the first seed) is killed right
after the checkpoint of step ``--kill-after`` (the fault hook ``MEGATRON_OPD_FAULT=kill_after_step:N``: every rank
exits with its vLLM engine, as under a job kill) and started again with the same command: it resumes from that
checkpoint and runs to the end; its final evaluation is printed next to the uninterrupted run of the same seed.

The measures, read from each run's ``metrics.jsonl``: held-out accuracy (``eval/accuracy``) and the per-token
divergence to the teacher on the student's own answers (``eval/divergence_own_samples``) and on the teacher's answers
(``eval/divergence_teacher_samples``, the same tokens in every run), at the first and at the last evaluation; and
wall time. Each layout's mean ± sample standard deviation over the seeds; CP=2 is "within the seed spread" of CP=1
on a measure when the difference of the means is at most twice the larger of the two standard deviations.

The jobs run this checkout's trainer (``PYTHONPATH``), one at a time, in ``--workdir`` (outside the repository);
each one's log is ``WORKDIR/<run>.log``. A run whose folder already holds a finished run (a final evaluation at
``--steps``) is reused, so an interrupted benchmark continues where it stopped; ``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "examples" / "quickstart" / "distil.yaml"
ACCURACY, OWN, FIXED = "eval/accuracy", "eval/divergence_own_samples", "eval/divergence_teacher_samples"
LAYOUTS = {
    "CP=1": ["parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=1"],
    "CP=2": ["parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=2"],
}


def launch(config: Path, overrides: list[str], log: Path, fault: str | None = None) -> int:
    """One trainer job under torchrun (two ranks, one OpenMP thread each, this checkout's code) in the folder above
    its ``output_dir``; its exit code."""
    from megatron_opd.quickstart import _stop_with_this_process
    from megatron_opd.testing.multiprocess import find_free_port

    out_dir = Path(next(o for o in overrides if o.startswith("output_dir=")).split("=", 1)[1])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    env.pop("MEGATRON_OPD_FAULT", None)
    if fault:
        env["MEGATRON_OPD_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={find_free_port()}",
           "-m", "megatron_opd.train", "--config", str(config), *overrides]  # fmt: skip
    with log.open("a") as f:
        f.write(f"\n$ {'MEGATRON_OPD_FAULT=' + fault + ' ' if fault else ''}{' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=out_dir.parent, env=env, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=_stop_with_this_process)  # fmt: skip
        return proc.wait()


def evals(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if ACCURACY in r]


def tail(log: Path, n: int = 30) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-n:])


def teacher(args, work: Path) -> tuple[Path, Path]:
    """The task and the teacher's run folder: made and trained here, or ``--task`` / ``--teacher-run``."""
    task = (args.task or work / "task").resolve()
    if not (task / "train.jsonl").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_quickstart_task.py"), str(task)], cwd=REPO,
                       check=True)  # fmt: skip
    if args.teacher_run is not None:
        return task, args.teacher_run.resolve()
    run = work / "teacher"
    if not [r for r in evals(run) if r["step"] == 300]:
        shutil.rmtree(run, ignore_errors=True)
        print("teacher: supervised fine-tuning on the task (the quick start's step 1, TP=2)", flush=True)
        code = launch(REPO / "examples" / "quickstart" / "teacher_sft.yaml",
                      [f"student.path={task / 'teacher-init'}", f"data.train_files={task / 'train.jsonl'}",
                       f"data.eval_files={task / 'eval.jsonl'}", f"output_dir={run}",
                       "parallel.tensor_model_parallel_size=2"], work / "teacher.log")  # fmt: skip
        if code != 0:
            raise SystemExit(f"{tail(work / 'teacher.log')}\nthe teacher's SFT failed (exit code {code})")
    return task, run


def distil(args, work: Path, task: Path, teacher_run: Path, layout: str, seed: int, kill_after: int | None) -> dict:
    """One distillation run (killed after step ``kill_after`` and resumed, when given); its row of the table."""
    name = f"{layout.replace('=', '')}-seed{seed}" + ("-resumed" if kill_after else "")
    out_dir, log = work / name, work / f"{name}.log"
    row = {"layout": layout + (f", killed after step {kill_after} and resumed" if kill_after else ""), "seed": seed,
           "run": str(out_dir)}  # fmt: skip
    if not args.fresh and (out_dir / "wall_s").exists() and [r for r in evals(out_dir) if r["step"] == args.steps]:
        print(f"{name}: reusing the finished run in {out_dir}", flush=True)
        return finished(row, out_dir, log, float((out_dir / "wall_s").read_text()), kill_after)
    shutil.rmtree(out_dir, ignore_errors=True)
    log.unlink(missing_ok=True)
    overrides = [f"student.path={task / 'student-init'}", f"teacher.path={teacher_run / 'hf'}",
                 f"data.train_files={task / 'train.jsonl'}", f"data.eval_files={task / 'eval.jsonl'}",
                 f"output_dir={out_dir}", *LAYOUTS[layout], "train.packing=false", "train.micro_batch_size=32",
                 "rollout.backend=vllm", f"train.steps={args.steps}", f"optim.lr_decay_steps={args.schedule_steps}",
                 f"eval.every={args.eval_every}", f"checkpoint.every={args.checkpoint_every}", f"seed={seed}",
                 "export_hf=false", "logging.progress_bar=false"]  # fmt: skip
    print(f"{name}: distilling ({log})", flush=True)
    start = time.perf_counter()
    if kill_after:
        code = launch(CONFIG, overrides, log, fault=f"kill_after_step:{kill_after}")
        if code == 0:
            return {**row, "error": f"the run was not killed after step {kill_after} (exit code 0)"}
        latest = out_dir / "checkpoints" / "latest"
        row["killed"] = {"exit_code": code, "latest": latest.read_text().strip() if latest.exists() else None}
        print(f"{name}: killed after step {kill_after} (exit code {code}, latest checkpoint "
              f"{row['killed']['latest']}); starting the same command again", flush=True)  # fmt: skip
    code = launch(CONFIG, overrides, log)
    seconds = time.perf_counter() - start
    if code != 0:
        return {**row, "error": f"exit code {code}:\n{tail(log)}", "seconds": seconds}
    rows = evals(out_dir)
    if not rows or rows[-1]["step"] != args.steps:
        return {**row, "error": f"no final evaluation at step {args.steps} in metrics.jsonl", "seconds": seconds}
    row = finished(row, out_dir, log, seconds, kill_after)
    if "error" not in row:
        (out_dir / "wall_s").write_text(f"{seconds:.1f}\n")
    return row


def finished(row: dict, out_dir: Path, log: Path, seconds: float, kill_after: int | None) -> dict:
    """A finished run's row: its evaluations (the first, each periodic one, the last) from ``metrics.jsonl`` and,
    for a killed-and-resumed run, the checkpoint it resumed from (its log)."""
    rows = evals(out_dir)
    by_step = {r["step"]: r for r in rows}  # a step evaluated twice (before a kill and after the resume): the last
    row = {**row, "before": rows[0], "after": rows[-1], "evals": list(by_step.values()), "seconds": seconds}
    if kill_after:
        text = log.read_text(errors="replace")
        row["resumed_from"] = next((ln.split("resumed from", 1)[1].strip() for ln in text.splitlines()
                                    if "resumed from" in ln), None)  # fmt: skip
        if row["resumed_from"] is None:
            return {**row, "error": "the second start did not resume from a checkpoint"}
    return row


def stat(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary(results: list[dict], layout: str) -> dict:
    """Over a layout's uninterrupted runs: (mean, sample sd) of each measure at each evaluated step, of the wall
    time, and the number of runs."""
    runs = [r for r in results if r["layout"] == layout and "after" in r]
    if not runs:
        return {}
    steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    out = {"n": len(runs), "seconds": stat([r["seconds"] for r in runs]), "steps": steps}
    for step in steps:
        for key in (ACCURACY, OWN, FIXED):
            out[step, key] = stat([next(e[key] for e in r["evals"] if e["step"] == step) for r in runs])
    return out


def table(results: list[dict], args) -> tuple[str, bool]:
    """The markdown table of the runs and of each layout's mean ± sd, the spread check, the resumed run."""
    stats = {layout: summary(results, layout) for layout in LAYOUTS}
    steps = next((s["steps"] for s in stats.values() if s), [0, args.steps])
    at = " / ".join(str(s) for s in steps)
    lines = [f"{args.steps} steps of the quick start's distillation (learning-rate schedule of {args.schedule_steps} "
             f"steps), 2 ranks, vLLM rollouts, checkpoints every {args.checkpoint_every} steps; held-out (256 "
             f"prompts) at steps {at}:", "",
             "| layout | seed | accuracy | divergence, teacher's answers | divergence, own answers | wall s |",
             "| --- | ---: | --- | --- | --- | ---: |"]  # fmt: skip
    for r in results:
        if "error" in r:
            first = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
            lines.append(f"| {r['layout']} | {r['seed']} | FAILED: {first} | | | {r.get('seconds', 0):.0f} |")
            continue
        ev = {e["step"]: e for e in r["evals"]}
        cells = [" / ".join(fmt.format(ev[s][key]) if s in ev else "—" for s in steps)
                 for key, fmt in ((ACCURACY, "{:.1%}"), (FIXED, "{:.4f}"), (OWN, "{:.4f}"))]  # fmt: skip
        lines.append(f"| {r['layout']} | {r['seed']} | {' | '.join(cells)} | {r['seconds']:.0f} |")
    for layout, s in stats.items():
        if s:
            cells = [" / ".join(fmt.format(*s[step, key]) for step in steps)
                     for key, fmt in ((ACCURACY, "{:.1%} ± {:.1%}"), (FIXED, "{:.4f} ± {:.4f}"),
                                      (OWN, "{:.4f} ± {:.4f}"))]  # fmt: skip
            lines.append(f"| **{layout}, mean ± sd** | {s['n']} seeds | {' | '.join(cells)} | "
                         f"{s['seconds'][0]:.0f} ± {s['seconds'][1]:.0f} |")  # fmt: skip
    ok = all("error" not in r for r in results)
    one, two = stats["CP=1"], stats["CP=2"]
    if one and two:
        lines.append("")
        for step in [s for s in steps if s > 0]:
            parts = []
            for key in (ACCURACY, FIXED, OWN):
                diff, bound = two[step, key][0] - one[step, key][0], 2 * max(one[step, key][1], two[step, key][1])
                within = abs(diff) <= bound
                ok = ok and within
                parts.append(f"{key.split('/')[1]} {diff:+.4f} (bound {bound:.4f}{'' if within else ', OUTSIDE'})")
            lines.append(f"- step {step}, CP=2 mean minus CP=1 mean (bound: 2 x the larger sd): " + ", ".join(parts))
    for r in results:
        if "resumed" in r["layout"] and "after" in r:
            ref = next((x for x in results if x["layout"] == "CP=2" and x["seed"] == r["seed"] and "after" in x), None)
            if ref is not None:
                same = all(r["after"][k] == ref["after"][k] for k in (ACCURACY, OWN, FIXED))
                lines.append(f"- resumed ({r.get('resumed_from')}) vs uninterrupted, CP=2 seed {r['seed']}, step "
                             f"{args.steps}: accuracy {r['after'][ACCURACY]:.1%} vs {ref['after'][ACCURACY]:.1%}, "
                             f"divergence on the teacher's answers {r['after'][FIXED]:.6f} vs "
                             f"{ref['after'][FIXED]:.6f}, on its own {r['after'][OWN]:.6f} vs {ref['after'][OWN]:.6f}"
                             f" ({'identical' if same else 'different'})")  # fmt: skip
    return "\n".join(lines), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_cp_quickstart"), help="outside the repo")
    parser.add_argument("--task", type=Path, help="a quick start's task folder (default: made in WORKDIR/task)")
    parser.add_argument("--teacher-run", type=Path, help="a quick start's teacher run (its hf/ is the teacher)")
    parser.add_argument("--seeds", default="1,2,3", help="one run per seed and layout")
    parser.add_argument("--steps", type=int, default=None, help="distillation steps (default: the config's 300)")
    parser.add_argument("--eval-every", type=int, default=None, help="default: a third of --steps")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="default: a third of --steps")
    parser.add_argument("--kill-after", type=int, default=None, help="default: the second checkpoint's step")
    parser.add_argument("--resume-seed", type=int, default=None, help="the killed-and-resumed CP=2 run's seed")
    parser.add_argument("--no-resume", action="store_true", help="no killed-and-resumed run")
    parser.add_argument("--layouts", default="CP=1,CP=2", help="comma-separated, of CP=1 and CP=2")
    parser.add_argument("--fresh", action="store_true", help="rerun runs already finished in WORKDIR")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    args.schedule_steps = yaml.safe_load(CONFIG.read_text())["train"]["steps"]
    args.steps = args.steps or args.schedule_steps
    args.eval_every = args.eval_every or max(1, args.steps // 3)
    args.checkpoint_every = args.checkpoint_every or max(1, args.steps // 3)
    kill_after = args.kill_after or min(2 * args.checkpoint_every, args.steps - 1)
    if kill_after % args.checkpoint_every or not 0 < kill_after < args.steps:
        raise SystemExit(f"--kill-after {kill_after} is not a checkpoint step before {args.steps}")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = args.workdir.resolve()
    if work.is_relative_to(REPO):
        raise SystemExit(f"--workdir {work} is inside the repository: the jobs run outside it")
    work.mkdir(parents=True, exist_ok=True)

    task, teacher_run = teacher(args, work)
    teacher_acc = evals(teacher_run)[-1][ACCURACY]
    print(f"teacher {teacher_run}: held-out accuracy {teacher_acc:.1%}", flush=True)
    plan = [(layout, seed, None) for layout in args.layouts.split(",") for seed in seeds]
    if not args.no_resume and "CP=2" in args.layouts:
        plan.append(("CP=2", args.resume_seed if args.resume_seed is not None else seeds[0], kill_after))
    results = []
    for layout, seed, kill in plan:
        results.append(distil(args, work, task, teacher_run, layout, seed, kill))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "error"} | (
            {"error": results[-1]["error"][-2000:]} if "error" in results[-1] else {})), flush=True)  # fmt: skip
    text, ok = table(results, args)
    print(f"\nteacher held-out accuracy {teacher_acc:.1%}\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"teacher_accuracy": teacher_acc, "runs": results}, indent=2))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
