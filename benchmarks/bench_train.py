"""Distillation step time, response tokens/s and peak RSS of our trainer (TP=1, TP=2) against TRL's GKDTrainer.

    python benchmarks/bench_train.py                          # ~4-6 minutes on 2 cores (+ ~3 min the first time)
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_train.py  # the same, OpenMP threads sleep instead of spinning
    python benchmarks/bench_train.py --threads 1 --tp 1       # one thread per run (no TP=2 row)
    python benchmarks/bench_train.py --steps 20 --rounds 1 --max-new-tokens 64 --json out.json
    python benchmarks/bench_train.py --no-trl                 # our rows only
    python benchmarks/bench_train.py --shape small            # issue #40's shape (below), one thread each

One run, same work on both sides: the tiny qwen3 teacher (4 layers) and student (2 layers) of
``megatron_opd.testing.distill_fixture``, the same prompt token ids (encoded once by our ``PromptEncoder``),
prompts per step, response length, stop token, sampling temperature, generalized JSD with the same beta
(mixture ``beta * teacher + (1 - beta) * student`` on both sides), fully on-policy (TRL ``lmbda=1``), fp32,
Adam with the same learning rate and clipping, and the same total number of torch threads.

- Ours: ``python -m torch.distributed.run --standalone --nproc-per-node TP -m megatron_opd.train ...`` with
  ``OMP_NUM_THREADS = threads / TP``. Step time = the trainer's own per-step wall time (data, rollout, teacher,
  update, weight sync; from ``metrics.jsonl``: response tokens / ``tokens_per_s``).
- TRL: ``benchmarks/_trl_gkd_worker.py`` in TRL's own venv (``--trl-venv``, created with
  ``pip install torch==2.13.0 trl==1.16.0 transformers==<ours>`` when missing; the row is skipped if that fails).
  Step time = ``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback`` (generation, student and teacher
  forward, backward, optimizer).

Every row runs ``--rounds`` times, the rows interleaved (load from other jobs hits them alike); medians over
the steps after ``--warmup`` of every round. Response tokens/s = a step's generated response tokens (the stop
token included) / its wall time. Peak RSS = the kernel's ``VmHWM`` of each process of the run's tree, polled
every 50 ms and frozen when the last training step is logged (ours then saves a final checkpoint; TRL saves
none); "total" adds the launcher's and the training processes' peaks (an upper bound of their simultaneous
peak), the round with the highest total.

``--shape small`` is the shape of issue #40's report: 2-layer 128-wide teacher and student, 32 prompts of ~10
tokens per step, 16 new tokens, dense JSD, one thread per run, TP=1 (it sets those defaults; flags still override).

On a machine whose cores other jobs also use, OpenMP's default spin-waiting makes multi-threaded runs of tiny
models erratic (single steps 10-100x slower); ``OMP_WAIT_POLICY=PASSIVE`` (inherited by every run) or
``--threads 1`` avoid it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "_trl_gkd_worker.py"
DEFAULT_TRL_VENV = REPO / "build" / "venv-trl"  # build/ is git-ignored
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"  # the CPU wheel on this machine's registry; never a CUDA build


# --shape: the fixture's models and the defaults of the flags that size a step.
SHAPES = {
    "fixture": {
        "models": {},
        "defaults": {},
        "title": "Tiny qwen3 teacher (4 layers) -> student (2 layers), hidden 64",
    },
    "small": {
        "models": {"teacher_layers": 2, "hidden_size": 128, "intermediate_size": 256},
        "defaults": {"prompts_per_step": 32, "max_new_tokens": 16, "threads": 1, "tp": "1"},
        "title": "Issue #40's shape: qwen3 teacher (2 layers) -> student (2 layers), hidden 128",
    },
}


@dataclass
class Run:
    """One row: per-step figures after warm-up, and the peak RSS of each process of the run."""

    name: str
    layout: str
    step_s: list[float] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    response_tokens: list[float] = field(default_factory=list)
    peak_rss: dict[str, int] = field(default_factory=dict)
    """Process label -> VmHWM bytes, up to the last training step."""
    peak_rss_final: dict[str, int] = field(default_factory=dict)
    """The same at the process tree's exit (ours: includes the final checkpoint save)."""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)
    error: str | None = None

    def med(self, values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    @property
    def tokens_per_s(self) -> list[float]:
        return [t / s for t, s in zip(self.response_tokens, self.step_s)]

    @property
    def workers(self) -> dict[str, int]:
        """Peaks of the training processes (ranks; TRL's single process)."""
        return {k: v for k, v in self.peak_rss.items() if k.startswith(("rank", "trl"))}

    @property
    def total_rss(self) -> int:
        """Launcher + training processes; dist_checkpointing's save helpers (started by the final checkpoint,
        sometimes seen by the last poll) are left out, kept in ``peak_rss``."""
        return sum(v for k, v in self.peak_rss.items() if k == "launcher" or k in self.workers)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "layout": self.layout,
            "error": self.error,
            "step_s_median": self.med(self.step_s),
            "rollout_s_median": self.med(self.rollout_s),
            "rest_s_median": self.med([s - r for s, r in zip(self.step_s, self.rollout_s)]),
            "response_tokens_per_step_mean": statistics.fmean(self.response_tokens) if self.response_tokens else None,
            "response_tokens_per_s_median": self.med(self.tokens_per_s),
            "peak_rss_bytes": self.peak_rss,
            "peak_rss_bytes_final": self.peak_rss_final,
            "peak_rss_per_worker_max_bytes": max(self.workers.values(), default=None),
            "peak_rss_total_bytes": self.total_rss if self.peak_rss else None,
            "wall_s": self.wall_s,
            "step_s": self.step_s,
            "rollout_s": self.rollout_s,
            "response_tokens": self.response_tokens,
            **self.extra,
        }


def merge_rounds(rounds: list[Run]) -> Run:
    """One row from its rounds: steps pooled; peak RSS of the round with the largest total."""
    failed = next((r for r in rounds if r.error is not None), None)
    if failed is not None:
        return failed
    first = rounds[0]
    top = max(rounds, key=lambda r: r.total_rss)
    merged = Run(first.name, first.layout, peak_rss=top.peak_rss, peak_rss_final=top.peak_rss_final)
    for r in rounds:
        merged.step_s += r.step_s
        merged.rollout_s += r.rollout_s
        merged.response_tokens += r.response_tokens
        for key, value in r.extra.items():
            if isinstance(value, list):
                merged.extra[key] = merged.extra.get(key, []) + value
            else:
                merged.extra.setdefault(key, value)
    merged.wall_s = sum(r.wall_s for r in rounds)
    merged.extra["rounds"] = len(rounds)
    merged.extra["peak_rss_bytes_by_round"] = [r.peak_rss for r in rounds]
    return merged


# ---- process-tree peak RSS ------------------------------------------------------------------------------------


def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def _label(proc) -> str:
    """launcher / rank<N> / trl / other:<name>, from the process's command line and environment."""
    try:
        cmd = " ".join(proc.cmdline())
        if "torch.distributed.run" in cmd:
            return "launcher"
        if "megatron_opd.train" in cmd:
            env = proc.environ()
            return f"rank{env.get('RANK', '?')}"
        if "_trl_gkd_worker" in cmd:
            return "trl"
        for helper in ("resource_tracker", "forkserver", "spawn_main"):
            if helper in cmd:
                return f"{helper}:{proc.pid}"
        return f"other:{proc.pid}:{cmd[:60]}"
    except Exception:  # the process ended while being looked at
        return f"other:{proc.pid}"


def run_and_watch(cmd: list[str], env: dict[str, str], log_path: Path, training_done) -> tuple[int, dict, dict, float]:
    """Run ``cmd`` (output to ``log_path``) while polling its process tree's VmHWM every 50 ms.

    Returns the exit code, the peaks up to the moment ``training_done()`` first held (or the exit), the peaks at
    the exit, and the wall time."""
    import psutil

    peaks: dict[int, tuple[str, int]] = {}
    frozen: dict[str, int] | None = None
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        root = psutil.Process(proc.pid)
        while True:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for p in tree:
                hwm = _vm_hwm(p.pid)
                if hwm is None:
                    continue
                label = peaks[p.pid][0] if p.pid in peaks else ""
                if not label or label.startswith("other:"):  # just forked: the command line may still be the parent's
                    label = _label(p)
                peaks[p.pid] = (label, max(hwm, peaks.get(p.pid, ("", 0))[1]))
            if frozen is None and training_done():
                frozen = _by_label(peaks)
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    wall = time.perf_counter() - start
    final = _by_label(peaks)
    return proc.returncode, frozen if frozen is not None else final, final, wall


def _by_label(peaks: dict[int, tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for label, hwm in peaks.values():
        out[label] = max(out.get(label, 0), hwm)
    return dict(sorted(out.items()))


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


# ---- our trainer ------------------------------------------------------------------------------------------------


def run_ours(fixture, args, tp: int, work: Path) -> Run:
    run = Run(f"megatron-opd TP={tp}", f"{tp} proc x {args.threads // tp} thr")
    out = work / f"ours_tp{tp}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = fixture.overrides(
        out,
        **{
            "data.eval_files": "[]",
            "train.steps": args.steps,
            "train.prompts_per_step": args.prompts_per_step,
            "train.micro_batch_size": args.prompts_per_step,  # one micro-batch, as TRL's single forward
            "train.max_seq_len": args.max_seq_len,
            "rollout.max_new_tokens": args.max_new_tokens,
            "rollout.temperature": args.temperature,
            "loss.kind": "jsd",
            "loss.beta": args.beta,
            "optim.lr": args.lr,
            "optim.clip_grad": 1.0,
            "parallel.tensor_model_parallel_size": tp,
            "logging.tensorboard": False,
            "export_hf": False,
            "seed": args.seed,
        },
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
    cmd += ["-m", "megatron_opd.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads // tp), "GLOO_SOCKET_IFNAME": "lo"}
    metrics = out / "metrics.jsonl"

    def done() -> bool:
        try:
            return sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= args.steps
        except FileNotFoundError:
            return False

    print(f"running: {run.name} ({' '.join(cmd[:6])} ... OMP_NUM_THREADS={env['OMP_NUM_THREADS']})", file=sys.stderr)
    code, run.peak_rss, run.peak_rss_final, run.wall_s = run_and_watch(cmd, env, work / f"ours_tp{tp}.log", done)
    run.extra["command"] = f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} python " + " ".join(cmd[1:])
    if code != 0:
        run.error = f"exit code {code}; log tail:\n{_tail(work / f'ours_tp{tp}.log')}"
        return run
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens_per_s" in r][args.warmup :]
    sequences = args.prompts_per_step  # rollout.n = 1, one data-parallel rank
    for r in rows:
        tokens = r["response_length"] * sequences
        run.response_tokens.append(tokens)
        run.step_s.append(tokens / r["tokens_per_s"])
        run.rollout_s.append(r["time/rollout"])
    run.extra["teacher_s"] = [r["time/teacher"] for r in rows]
    run.extra["update_s"] = [r["time/update"] for r in rows]
    run.extra["loss"] = [r["loss"] for r in rows]
    return run


# ---- TRL ----------------------------------------------------------------------------------------------------------


def ensure_trl_venv(venv: Path, transformers_version: str) -> tuple[Path | None, str]:
    """TRL's venv python (installed when missing), or None and why not."""
    py = venv / "bin" / "python"
    probe = (
        "import torch, trl.experimental.gkd; assert torch.version.cuda is None, 'CUDA torch'; print(trl.__version__)"
    )

    def usable() -> tuple[bool, str]:
        if not py.exists():
            return False, "no venv"
        r = subprocess.run(
            [str(py), "-c", probe], capture_output=True, text=True, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
        )
        return r.returncode == 0, (r.stdout + r.stderr).strip()[-500:]

    ok, why = usable()
    if ok:
        return py, why
    print(f"installing TRL {TRL_VERSION} into {venv} ({why}); a few minutes ...", file=sys.stderr)
    log = venv.parent / f"{venv.name}-install.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", f"torch=={TORCH_VERSION}", f"trl=={TRL_VERSION}",
         f"transformers=={transformers_version}", "psutil"],
    ]  # fmt: skip
    with open(log, "w") as f:
        for cmd in steps:
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                return None, f"`{' '.join(cmd)}` failed (see {log})"
    ok, why = usable()
    return (py, why) if ok else (None, f"TRL venv unusable after install: {why}")


def run_trl(fixture, args, prompt_ids, pad_id: int, stop_ids: list[int], work: Path, transformers_version: str) -> Run:
    run = Run("TRL GKDTrainer", f"1 proc x {args.threads} thr")
    py, info = ensure_trl_venv(Path(args.trl_venv), transformers_version)
    if py is None:
        run.error = f"skipped: {info}"
        return run
    spec = {
        "student": fixture.student,
        "teacher": fixture.teacher,
        "prompt_ids": prompt_ids,
        "pad_token_id": pad_id,
        "stop_token_ids": stop_ids,
        "prompts_per_step": args.prompts_per_step,
        "max_new_tokens": args.max_new_tokens,
        "max_seq_len": args.max_seq_len,
        "beta": args.beta,
        "temperature": args.temperature,
        "lr": args.lr,
        "steps": args.steps,
        "threads": args.threads,
        "seed": args.seed,
    }
    spec_path, result_path = work / "trl_spec.json", work / "trl_result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    cmd = [str(py), str(WORKER), str(spec_path), str(result_path)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TRL_EXPERIMENTAL_SILENCE": "1"}
    env.pop("PYTHONPATH", None)
    print(f"running: {run.name} ({py}, {args.threads} threads)", file=sys.stderr)
    code, run.peak_rss, run.peak_rss_final, run.wall_s = run_and_watch(
        cmd, env, work / "trl.log", lambda: result_path.exists()
    )
    run.extra["command"] = f"OMP_NUM_THREADS={args.threads} {py} {WORKER.relative_to(REPO)} SPEC.json RESULT.json"
    if code != 0 or not result_path.exists():
        run.error = f"exit code {code}; log tail:\n{_tail(work / 'trl.log')}"
        return run
    res = json.loads(result_path.read_text())
    w = args.warmup
    run.step_s = res["step_seconds_inner"][w:]
    run.rollout_s = res["generation_seconds"][w:]
    run.response_tokens = [float(t) for t in res["response_tokens"][w:]]
    run.extra.update(
        versions=res["versions"],
        threads=res["threads"],
        step_s_with_data_and_logging=res["step_seconds"][w:],
        loss=res["loss"][w:],
        self_reported_peak_rss_bytes=res["peak_rss_bytes"],
    )
    return run


# ---- report -------------------------------------------------------------------------------------------------------


def table(runs: list[Run]) -> str:
    mib = 2**20
    trl = next((r for r in runs if r.name.startswith("TRL") and r.error is None), None)
    lines = [
        "| run | processes x threads | step time median (s) | rollout median (s) | teacher + update median (s) "
        "| response tokens / step | response tokens/s (median) | peak RSS per process (MiB) | peak RSS total (MiB) "
        "| step speed vs TRL | tokens/s vs TRL | peak RSS total vs TRL |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if r.error is not None:
            lines.append(f"| {r.name} | {r.layout} | {r.error.splitlines()[0]} |" + " |" * 9)
            continue
        s = r.summary()
        per_proc = ", ".join(f"{k} {v / mib:.0f}" for k, v in r.peak_rss.items() if k == "launcher" or k in r.workers)
        total = s["peak_rss_total_bytes"]
        if trl is not None:
            t = trl.summary()
            ratios = (
                f"{t['step_s_median'] / s['step_s_median']:.2f}x | "
                f"{s['response_tokens_per_s_median'] / t['response_tokens_per_s_median']:.2f}x | "
                f"{total / t['peak_rss_total_bytes']:.2f}x"
            )
        else:
            ratios = "- | - | -"
        lines.append(
            f"| {r.name} | {r.layout} | {s['step_s_median']:.3f} | {s['rollout_s_median']:.3f} | "
            f"{s['rest_s_median']:.3f} | {s['response_tokens_per_step_mean']:.0f} | "
            f"{s['response_tokens_per_s_median']:.0f} | {per_proc} | {total / mib:.0f} | {ratios} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every row, interleaved; steps pooled")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step (one sample each)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest response")
    parser.add_argument("--max-seq-len", type=int, default=256, help="prompt + response limit (the fixture's context)")
    parser.add_argument("--beta", type=float, default=0.5, help="generalized JSD beta (teacher weight of the mixture)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in total per run (TP ranks share them)")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes of our rows")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL row")
    parser.add_argument("--trl-venv", default=str(DEFAULT_TRL_VENV), help="TRL's own venv (created when missing)")
    parser.add_argument("--json", metavar="OUT", help="also write every figure and per-step value here")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the fixture, logs and run folders")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="fixture", help="models and work per step")
    shape = parser.parse_known_args()[0].shape
    parser.set_defaults(**SHAPES[shape]["defaults"])
    args = parser.parse_args()
    tps = [int(x) for x in args.tp.split(",") if x]
    for tp in tps:
        if args.threads % tp:
            parser.error(f"--threads {args.threads} is not divisible by TP={tp}")
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")

    import torch
    import transformers
    from transformers import AutoTokenizer

    from megatron_opd.data.prompts import PromptEncoder, load_prompts
    from megatron_opd.testing.distill_fixture import make_distill_fixture
    from megatron_opd.vocab import eos_token_ids

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_train_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    try:
        fixture = make_distill_fixture(work / "fixture", **SHAPES[shape]["models"])
        tokenizer = AutoTokenizer.from_pretrained(fixture.student)
        _, prompt_ids = load_prompts([fixture.train_file], PromptEncoder(tokenizer), "data.train_files")
        stop_ids = eos_token_ids(fixture.student, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)

        # Rounds interleave the rows, so that load from other jobs on the machine hits them alike.
        by_row: dict[str, list[Run]] = {}
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr)
            rows = [run_ours(fixture, args, tp, work) for tp in tps]
            if not args.no_trl:
                rows.append(run_trl(fixture, args, prompt_ids, pad_id, stop_ids, work, transformers.__version__))
            for r in rows:
                by_row.setdefault(r.name, []).append(r)
        runs = [merge_rounds(rounds) for rounds in by_row.values()]
        elapsed = time.perf_counter() - started
        load_after = os.getloadavg()

        import psutil

        machine = (
            f"{platform.machine()}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; load average "
            f"{load_before[0]:.1f} before, {load_after[0]:.1f} after"
        )
        print(
            f"\n{SHAPES[shape]['title']}, vocab 1000 rows "
            f"({len(tokenizer)} tokens), fp32; {args.prompts_per_step} prompts/step, <= {args.max_new_tokens} new "
            f"tokens, temperature {args.temperature}, JSD beta {args.beta}, {args.rounds} rounds x {args.steps} steps "
            f"(medians over the last {args.steps - args.warmup} of each round), {args.threads} threads per run. "
            f"{machine}. "
            f"Whole benchmark {elapsed:.0f} s.\n"
        )
        print(table(runs))
        for r in runs:
            if r.error is not None:
                print(f"\n{r.name}: {r.error}")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "config": vars(args),
                        "machine": machine,
                        "tokenizer_tokens": len(tokenizer),
                        "benchmark_s": elapsed,
                        "runs": [r.summary() for r in runs],
                    },
                    indent=1,
                )
            )
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
