"""Cross-tokenizer on-policy distillation: ours (``loss.cross_tokenizer=sampled`` and ``aligned``) against TRL's GOLD.

    python benchmarks/bench_cross_tokenizer.py                           # every row, 500 steps each (see below)
    python benchmarks/bench_cross_tokenizer.py --steps 100 --json out.json
    python benchmarks/bench_cross_tokenizer.py --rows gold,gold-hybrid --workdir runs/bench_ct --keep
    python benchmarks/bench_cross_tokenizer.py --topk 16 --seed 1         # top-k of the aligned row, another seed
    python benchmarks/bench_cross_tokenizer.py --pair cross_space --seeds 1,2,3 --lr-warmups 0,10   # issue #41's pair

Issue #22. The task of ``examples/quickstart.py --cross-tokenizer`` (``tools/make_quickstart_task.py
--teacher-digit-merges doubles``): digit reversal, a student tokenizer with one token per digit and a teacher
tokenizer with a token for each doubled digit ("33"), both byte-level BPE (``megatron_opd.tasks.digits``), which is
what GOLD's cross-tokenizer ULD accepts (checked here; TRL 1.16 raises NotImplementedError otherwise). As in the
quick start, our trainer first fine-tunes the teacher (SFT, 200 steps) and, beside it, warms the student up (125 SFT
steps); every row then starts from that teacher and that student (``WORKDIR/teacher/hf``, ``WORKDIR/student-warmup/
hf``), one run each, one after the other, ``--threads`` torch threads each. The same for every row: prompts
(``train.jsonl``), ``--steps`` steps, and from ``examples/quickstart/distil_cross.yaml`` the prompts per step (one
sample each), the response limit, the sampling temperature, the learning rate and its schedule (linear warm-up,
cosine to ``min_lr``), Adam(W) without weight decay, gradient clipping 1.0, fp32.

``--pair cross_space`` (issue #41): the same task with spaced digits ("reverse 4 0 9 1 2 =" -> "2 1 9 0 4"), a
student tokenizer split into words (one token per digit and its space, 274 ids) and a teacher whose byte-level BPE
merges 40 digit pairs across the space ("5 1", 354 ids; ``testing.real_tokenizers`` ``word`` and ``cross_space``):
76% of the teacher's tokens on spaced answers have a student twin. Teacher SFT 700 steps, student warm-up 350, then
issue #41's run: 100 steps of 32 prompts, lr 2e-4 held after ``--lr-warmups`` warm-up steps. With ``--seeds`` and
``--lr-warmups`` every row runs once per combination and a summary gives the mean held-out accuracy before and after
and the response length at the end over the start.

``--pair boundary`` (issue #51's "Why", rebuilt), ``--pair llama3_mistral`` / ``mistral_llama3`` (real vocabularies,
the held-out check): ``benchmarks/cross_tokenizer_pairs.py`` says what each is. The same run as ``cross_space``
(100 steps of 32 prompts, lr 2e-4); ``boundary``'s teacher learns ``teacher_response`` (a random leading space),
``--no-worker-eval`` leaves TRL's venv out (the trainer's own held-out exact match only). The students start weak
enough that the same-tokenizer control gains in these steps (``boundary`` 25.8%, ``mistral_word`` 21.1%,
``llama3_mistral`` 27.3%; from 55.5%
and 34% it gained +0.02 and -0.004: a pair without headroom cannot show a gain), ``PAIR_SFT``.

Rows:
- ``ours-sampled``: ``loss.mode=sampled loss.cross_tokenizer=sampled loss.kind=reverse_kl`` (sampled reverse KL per
  aligned byte group); ``ours-sampled-fkl`` the same with ``loss.kind=forward_kl`` (the sampled forward KL).
- ``ours-aligned``: the same with ``loss.mode=topk loss.kind=forward_kl loss.topk=--topk loss.cross_tokenizer=aligned``;
  ``ours-aligned-rkl`` with ``loss.kind=reverse_kl``.
- Ours at TP=1 with padded micro-batches (``train.packing=false``, as GOLD's; ``--packing``: packed).
- ``same-tokenizer`` (``--pair cross_space``): the control, a teacher trained like the other one but with the
  student's tokenizer, distilled into the same student by reverse KL on its top ``--topk`` (no alignment): what the
  task lets on-policy distillation gain in these steps. ``same-tokenizer-sampled`` / ``-sampled-fkl``: that teacher
  with ``loss.mode=sampled`` (reverse / forward KL): what the sampled estimators gain when tokenizers are not in the
  way.
- ``labels``: no teacher; the same student, steps, prompts and learning rate on the task's reference answers
  (``loss.kind=sft``): what a teacher that gives only the right next word carries (``--set`` is not applied).
- ``--student-steps``: another student warm-up (issue #41's student started at 48% exact match; 327 steps give 55%),
  in its own ``--workdir``; ``--set KEY=VALUE ...``: extra trainer overrides of our rows, ``--tag`` a suffix of their
  names (runs of another setting side by side in one work folder).
- ``gold``, ``gold-hybrid``: ``benchmarks/_trl_gold_worker.py`` in TRL's venv (``--trl-venv``, installed when
  missing): ``GOLDTrainer`` with ``use_uld_loss=True``, ``lmbda=1`` (fully on-policy), GOLD's defaults for the rest of
  the loss, with and without ``uld_use_hybrid_loss`` (its docstring says what else it sets and why).

Figures:
- s/step: the median over the steps after ``--warmup`` of each step's wall time (ours: ``time/step`` of
  ``metrics.jsonl``, rollout + teacher + update + weight sync, evaluation and checkpoints not included; GOLD:
  ``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback``: generation, teacher, loss, backward, optimizer);
  "vs ours" = that / ``ours-sampled``'s. Response tokens per sample (training samples, the stop token included)
  beside it: a student that stops late costs more per step.
- held-out accuracy before -> after: greedy answers to the 256 ``eval.jsonl`` prompts scored like
  ``megatron_opd.tasks.digits.score`` (ours: the trainer's own ``eval/accuracy``; GOLD: the worker's); the worker's
  figure for every row too (its evaluation of our exported student, ``--eval-only``), a cross-check.
- held-out sequence log-ratio before -> after: the worker's, on every row's final student: one sample per eval
  prompt, the mean of ``log p_teacher(text) - log q_student(sample)`` (0 when the student samples as the teacher
  would; the worker's docstring says exactly how). Ours also logs it on its training samples each step
  (``cross_tokenizer/sequence_log_ratio``): the mean of the last 10 steps is shown.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_train import DEFAULT_TRL_VENV, ensure_trl_venv
from cross_tokenizer_pairs import PAIRS as USER_PAIRS
from cross_tokenizer_pairs import make_pair_task

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "_trl_gold_worker.py"
QUICKSTART = REPO / "examples" / "quickstart"
ROWS = ("ours-sampled", "ours-sampled-fkl", "ours-aligned", "ours-aligned-rkl", "gold", "gold-hybrid",
        "same-tokenizer", "same-tokenizer-sampled", "same-tokenizer-sampled-fkl", "labels")  # fmt: skip
TEACHER_SFT = ["train.steps=200", "optim.lr_warmup_steps=20"]
"""The cross-tokenizer quick start's teacher: 200 SFT steps (examples/quickstart.py)."""
PAIRS = ("doubles", "cross_space", *USER_PAIRS)
PAIR_SFT = {
    "doubles": ([], []),
    "cross_space": (["train.steps=700", "rollout.max_new_tokens=10"],
                    ["train.steps=350", "rollout.max_new_tokens=10"]),
    "boundary": (["train.steps=700", "rollout.max_new_tokens=10", "data.response_key=teacher_response"],
                 ["train.steps=60", "rollout.max_new_tokens=10"]),  # teacher 97.7%, student 25.8% (100 steps: 55.5%,
    # where the control gained +0.02: no headroom)
    **{pair: (["train.steps=400", "rollout.max_new_tokens=16"],
              ["train.steps=100", "rollout.max_new_tokens=16", "eval.every=25"])
       for pair in USER_PAIRS if pair not in ("boundary", "mistral_word", "llama3_mistral")},
    # teacher 100%; the student's cosine warm-up: 100 steps 2.7%, 120 27.3%, 140 80.1% (2026-11-30)
    "llama3_mistral": (["train.steps=400", "rollout.max_new_tokens=16"],
                       ["train.steps=120", "rollout.max_new_tokens=16", "eval.every=120"]),
    "mistral_word": (["train.steps=400", "rollout.max_new_tokens=16", "data.response_key=teacher_response"],
                     ["train.steps=300", "rollout.max_new_tokens=16", "eval.every=100"]),  # student 21.1% (600: 34%)
}  # fmt: skip
"""Extra overrides of the teacher's SFT and the student's warm-up per ``--pair``."""
SPACED_DISTIL = {"prompts_per_step": 32, "max_new_tokens": 10, "lr": 2e-4, "min_lr": 2e-4}
"""``--pair cross_space`` and issue #51's pairs: issue #41's run (32 prompts per step, lr 2e-4 held, answers up to 6
digits + EOS)."""


def make_spaced_task(out: Path, n_train: int = 8000, n_eval: int = 256, seed: int = 0) -> None:
    """Issue #41's pair on the digit task with spaced digits ("reverse 4 0 9 1 2 =" -> "2 1 9 0 4"): a student
    tokenizer split into words (one token per digit with its space) and a teacher whose byte-level BPE merges cross
    spaces (``testing.real_tokenizers``: ``word`` and ``cross_space``), the models of ``tasks.digits``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from megatron_opd.tasks import digits
    from megatron_opd.testing.real_tokenizers import synthetic_tokenizer, write_synthetic_tokenizer

    models = (
        ("teacher-init", "teacher", "cross_space", seed),
        ("student-init", "student", "word", seed + 1),
        ("teacher-word-init", "teacher", "word", seed),
    )  # the control's teacher: the student's tokenizer
    for name, size, kind, s in models:
        folder = write_synthetic_tokenizer(out / name, kind)
        vocab = (len(synthetic_tokenizer(kind)) + 15) // 16 * 16
        config = Qwen3Config(vocab_size=vocab, head_dim=digits.HEAD_DIM, max_position_embeddings=64,
                             rms_norm_eps=1e-6, tie_word_embeddings=size == "student", bos_token_id=0,
                             eos_token_id=0, pad_token_id=0, **digits.MODEL_SIZES[size])  # fmt: skip
        torch.manual_seed(s)
        model = AutoModelForCausalLM.from_config(config).float()
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(folder, safe_serialization=True)

    def spaced(records: list[dict]) -> list[dict]:
        out = []
        for r in records:
            answer = " ".join(r["answer"])
            out.append({"prompt": f"reverse {' '.join(r['answer'][::-1])} =", "answer": answer, "response": answer})
        return out

    eval_records = digits.make_records(n_eval, seed=seed + 1)
    train_records = digits.make_records(n_train, seed=seed + 2, exclude=[r["prompt"] for r in eval_records])
    for name, records in (("train.jsonl", train_records), ("eval.jsonl", eval_records)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in spaced(records)))


@dataclass
class Row:
    """One run: per-step wall times, held-out figures before and after, and where it went wrong."""

    name: str
    step_s: list[float] = field(default_factory=list)
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    heldout_before: dict | None = None
    """The worker's evaluation of the starting student (accuracy, sequence_log_ratio, ...)."""
    heldout_after: dict | None = None
    train_log_ratio_last10: float | None = None
    response_tokens: float | None = None
    """Mean sampled response tokens per sample during training (the stop token included): step times scale with it."""
    wall_s: float = 0.0
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def step_median(self, warmup: int) -> float:
        steps = self.step_s[warmup:] or self.step_s
        return statistics.median(steps) if steps else float("nan")


# ---- the task and the two starting models -------------------------------------------------------------------------


def distil_settings() -> dict:
    """Batch, sampling and learning-rate schedule of the quick start's distillation, shared by every row."""
    import yaml

    cfg = yaml.safe_load((QUICKSTART / "distil_cross.yaml").read_text())
    return {
        "prompts_per_step": int(cfg["train"]["prompts_per_step"]),
        "max_new_tokens": int(cfg["rollout"]["max_new_tokens"]),
        "temperature": float(cfg["rollout"]["temperature"]),
        "lr": float(cfg["optim"]["lr"]),
        "min_lr": float(cfg["optim"]["min_lr"]),
        "lr_warmup_steps": int(cfg["optim"]["lr_warmup_steps"]),
        "eval_max_prompts": int(cfg["eval"]["max_prompts"]),
    }


def schedule_overrides(settings: dict) -> list[str]:
    """The trainer overrides for ``settings`` (``distil_settings``), so that every row runs what the table says; the
    drift watch only warns (the table measures how runs that move away from their teacher end)."""
    return ["train.drift_check=warn", f"train.prompts_per_step={settings['prompts_per_step']}",
            f"train.micro_batch_size={settings['prompts_per_step']}",
            f"rollout.max_new_tokens={settings['max_new_tokens']}", f"optim.lr={settings['lr']}",
            f"optim.min_lr={settings['min_lr']}", f"optim.lr_warmup_steps={settings['lr_warmup_steps']}"]  # fmt: skip


def check_byte_level(folder: Path) -> None:
    """Refuse a tokenizer GOLD's cross-tokenizer ULD cannot take (its test: ByteLevel in the pre-tokenizer or
    decoder, ``trl.experimental.utils.is_byte_level_tokenizer``)."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")) + json.dumps(spec.get("decoder")):
        raise SystemExit(f"{folder}: not a byte-level BPE tokenizer; GOLD's ULD would raise NotImplementedError")


def trainer_command(config: Path, overrides: list[str]) -> list[str]:
    """One trainer process under torchrun (``testing.multiprocess.trainer_command``) on ``config``."""
    from megatron_opd.testing.multiprocess import trainer_command as torchrun_trainer

    return torchrun_trainer(["--config", str(config), *overrides], nproc=1)


def start(cmd: list[str], log: Path, threads: int, extra_env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` with ``threads`` OpenMP threads, its output to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def metric_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def prepare(work: Path, args) -> tuple[Path, Path, Path]:
    """The task, the SFT teacher and the warmed-up student (our trainer, side by side); kept in ``work`` and reused
    by a later run with the same ``--workdir``. Returns the task folder and the two Hugging Face folders."""
    task, teacher, student = work / "task", work / "teacher", work / "student-warmup"
    done = work / "prepared.json"
    if done.exists():
        print(f"reusing the task, teacher and student of {done}", file=sys.stderr)
        return task, teacher / "hf", student / "hf"
    shutil.rmtree(task, ignore_errors=True)
    if args.pair == "cross_space":
        make_spaced_task(task)
    elif args.pair in USER_PAIRS:
        make_pair_task(args.pair, task)
    else:
        subprocess.run([sys.executable, str(REPO / "tools" / "make_quickstart_task.py"), str(task),
                        "--teacher-digit-merges", "doubles"], cwd=REPO, check=True)  # fmt: skip
    if any(row.startswith("gold") for row in args.rows.split(",")):
        for folder in (task / "teacher-init", task / "student-init"):
            check_byte_level(folder)
    data = [f"data.train_files={task / 'train.jsonl'}", f"data.eval_files={task / 'eval.jsonl'}",
            "parallel.tensor_model_parallel_size=1", "logging.tensorboard=false"]  # fmt: skip
    jobs = {
        teacher: trainer_command(QUICKSTART / "teacher_sft.yaml",
                                 [f"student.path={task / 'teacher-init'}", *data, f"output_dir={teacher}",
                                  *TEACHER_SFT, *PAIR_SFT[args.pair][0]]),
        student: trainer_command(QUICKSTART / "student_warmup.yaml",
                                 [f"student.path={task / 'student-init'}", *data, f"output_dir={student}",
                                  *PAIR_SFT[args.pair][1],
                                  *([f"train.steps={args.student_steps}"] if args.student_steps else [])]),
    }  # fmt: skip
    if args.pair != "doubles" and "same-tokenizer" in args.rows:  # either control
        # mistral_word's control learns the student's own template (``response``); boundary's the teacher's
        control = [o for o in PAIR_SFT[args.pair][0] if args.pair != "mistral_word" or "response_key" not in o]
        if args.pair == "mistral_word":  # the word-level teacher learns slower: 400 steps gave 74.6%, 1000 86.3%
            control = [o if o != "train.steps=400" else "train.steps=1000" for o in control]
        jobs[work / "teacher-word"] = trainer_command(
            QUICKSTART / "teacher_sft.yaml",
            [f"student.path={task / 'teacher-word-init'}", *data, f"output_dir={work / 'teacher-word'}",
             *TEACHER_SFT, *control],
        )  # fmt: skip
    print("preparing: teacher SFT and student warm-up (our trainer), side by side", file=sys.stderr)
    procs = {out: start(cmd, work / f"{out.name}.log", args.threads) for out, cmd in jobs.items()}
    for out, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{tail(work / f'{out.name}.log')}\npreparation failed: {' '.join(jobs[out])}")
    accuracy = {out.name: [r for r in metric_rows(out) if "eval/accuracy" in r][-1]["eval/accuracy"] for out in jobs}
    done.write_text(json.dumps({"held_out_accuracy": accuracy}))
    return task, teacher / "hf", student / "hf"


# ---- rows -------------------------------------------------------------------------------------------------------


def run_ours(
    name: str, loss: list[str], paths: tuple[Path, Path | None, Path], settings: dict, args, work: Path
) -> Row:
    """One of our runs from the warmed-up student, then the worker's held-out evaluation of what it exported."""
    task, teacher, student = paths
    row, out = Row(name), work / name
    shutil.rmtree(out, ignore_errors=True)
    overrides = [f"student.path={student}", *([f"teacher.path={teacher}"] if teacher else []),
                 f"data.train_files={task / 'train.jsonl'}",
                 f"data.eval_files={task / 'eval.jsonl'}", f"output_dir={out}", f"train.steps={args.steps}",
                 f"seed={args.seed}", "parallel.tensor_model_parallel_size=1", "logging.tensorboard=false",
                 f"train.packing={str(args.packing).lower()}", *schedule_overrides(settings), *loss]  # fmt: skip
    cmd = trainer_command(QUICKSTART / "distil_cross.yaml", overrides)
    row.extra["command"] = f"OMP_NUM_THREADS={args.threads} python " + " ".join(cmd[1:])
    print(f"running: {name}", file=sys.stderr)
    t0 = time.perf_counter()
    code = start(cmd, work / f"{name}.log", args.threads).wait()
    row.wall_s = time.perf_counter() - t0
    if code != 0:
        row.error = f"exit code {code}; log tail:\n{tail(work / f'{name}.log')}"
        return row
    metrics = metric_rows(out)
    steps = [r for r in metrics if "time/step" in r]
    evals = [r for r in metrics if "eval/accuracy" in r]
    row.step_s = [r["time/step"] for r in steps]
    row.accuracy_before, row.accuracy_after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    ratios = [r["cross_tokenizer/sequence_log_ratio"] for r in steps if "cross_tokenizer/sequence_log_ratio" in r]
    row.train_log_ratio_last10 = statistics.fmean(ratios[-10:]) if ratios else None
    row.response_tokens = statistics.fmean(r["response_length"] for r in steps)
    lengths = [r["response_length"] for r in steps]
    row.extra.update(
        response_length_first=lengths[0],
        response_length_last10=statistics.fmean(lengths[-10:]),
        train_log_ratio_first10=statistics.fmean(ratios[:10]) if ratios else None,
        loss=[r.get("loss") for r in steps],
        rollout_s=[r.get("time/rollout") for r in steps],
        teacher_s=[r.get("time/teacher") for r in steps],
        update_s=[r.get("time/update") for r in steps],
    )
    if not args.worker_eval:
        return row
    held_out = worker_eval(out / "hf", teacher, task, settings, args, work / f"{name}-eval")
    row.heldout_after = held_out.get("eval")
    if "error" in held_out:
        row.error = held_out["error"]
    return row


def run_worker(spec: dict, args, work: Path, eval_only: bool) -> dict:
    """The GOLD worker in TRL's venv: its RESULT, or ``{"error": ...}``."""
    py, info = ensure_trl_venv(Path(args.trl_venv), _transformers_version())
    if py is None:
        return {"error": f"skipped: {info}"}
    work.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log = work / "spec.json", work / "result.json", work / "worker.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    cmd = [str(py), str(WORKER), *(["--eval-only"] if eval_only else []), str(spec_path), str(result_path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(args.threads), TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT).returncode
    if code != 0 or not result_path.exists():
        return {"error": f"worker exit code {code}; log tail:\n{tail(log)}"}
    return json.loads(result_path.read_text())


def worker_spec(student: Path, teacher: Path, task: Path, settings: dict, args) -> dict:
    return {"student": str(student), "teacher": str(teacher), "train_file": str(task / "train.jsonl"),
            "eval_file": str(task / "eval.jsonl"), "steps": args.steps, "seed": args.seed, "threads": args.threads,
            "top_p": 1.0, **settings}  # fmt: skip


def worker_eval(student: Path, teacher: Path, task: Path, settings: dict, args, work: Path) -> dict:
    """The worker's held-out evaluation of ``student`` (``{"eval": {...}}``)."""
    return run_worker(worker_spec(student, teacher, task, settings, args), args, work, eval_only=True)


def run_gold(name: str, hybrid: bool, paths: tuple[Path, Path, Path], settings: dict, args, work: Path) -> Row:
    task, teacher, student = paths
    row, out = Row(name), work / name
    shutil.rmtree(out, ignore_errors=True)
    spec = {**worker_spec(student, teacher, task, settings, args), "hybrid": hybrid, "save_dir": str(out / "hf")}
    print(f"running: {name}", file=sys.stderr)
    t0 = time.perf_counter()
    res = run_worker(spec, args, out, eval_only=False)
    row.wall_s = time.perf_counter() - t0
    row.extra["command"] = f"OMP_NUM_THREADS={args.threads} {args.trl_venv}/bin/python {WORKER.relative_to(REPO)} "
    row.extra["command"] += f"{out / 'spec.json'} {out / 'result.json'}"
    if "error" in res:
        row.error = res["error"]
        return row
    row.step_s = res["step_seconds_inner"]
    row.heldout_before, row.heldout_after = res["eval_before"], res["eval_after"]
    row.accuracy_before, row.accuracy_after = res["eval_before"]["accuracy"], res["eval_after"]["accuracy"]
    row.response_tokens = statistics.fmean(res["response_tokens"]) / settings["prompts_per_step"]
    row.extra.update({k: res[k] for k in ("versions", "gold_settings", "loss", "lr", "generation_seconds",
                                          "response_tokens", "step_seconds", "peak_rss_bytes")})  # fmt: skip
    return row


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# ---- report -------------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row], before: dict | None, warmup: int) -> str:
    """The markdown table: step time, its ratio to ours-sampled, held-out accuracy and sequence log-ratio."""
    base = next((r for r in rows if r.name == "ours-sampled" and r.error is None), None)
    lines = [
        "| row | s/step (median) | vs ours-sampled | response tokens / sample | held-out accuracy before → after "
        "| same, worker's eval | held-out sequence log-ratio before → after | training log-ratio, last 10 steps "
        "| wall (s) |",
        "|---|---:|---:|---:|---|---|---|---:|---:|",
    ]
    b = before or {}
    for r in rows:
        if r.error is not None and not r.step_s:
            lines.append(f"| {r.name} | {r.error.splitlines()[0]} |" + " |" * 7)
            continue
        s = r.step_median(warmup)
        ratio = f"{s / base.step_median(warmup):.2f}x" if base is not None else "-"
        after = r.heldout_after or {}
        lines.append(
            f"| {r.name} | {s:.3f} | {ratio} | {_fmt(r.response_tokens, '.2f')} | {_fmt(r.accuracy_before, '.1%')} → {_fmt(r.accuracy_after, '.1%')} "
            f"| {_fmt(b.get('accuracy'), '.1%')} → {_fmt(after.get('accuracy'), '.1%')} "
            f"| {_fmt(b.get('sequence_log_ratio'), '.2f')} → {_fmt(after.get('sequence_log_ratio'), '.2f')} "
            f"| {_fmt(r.train_log_ratio_last10, '.2f')} | {r.wall_s:.0f} |"
        )
    return "\n".join(lines)


def run_row(row: str, name: str, paths, settings: dict, aligned: list[str], args, work: Path) -> Row:
    """One run of ``row`` (``ROWS``) under ``name``."""
    if row.startswith("gold"):
        return run_gold(name, row == "gold-hybrid", paths, settings, args, work)
    if row == "labels":  # what the reference answers alone give at the same budget: SFT, no teacher, no --set
        task, _, student = paths
        return run_ours(
            name, ["loss.kind=sft", "loss.cross_tokenizer=off"], (task, None, student), settings, args, work
        )
    if row.startswith("same-tokenizer"):  # the controls: a teacher with the student's own tokenizer, no alignment
        task, _, student = paths
        same = ["loss.cross_tokenizer=off", "loss.kind=reverse_kl", "loss.mode=topk", f"loss.topk={args.topk}"]
        if row.startswith("same-tokenizer-sampled"):
            kind = "forward_kl" if row.endswith("-fkl") else "reverse_kl"
            same = ["loss.cross_tokenizer=off", f"loss.kind={kind}", "loss.mode=sampled"]
        return run_ours(name, [*same, *args.set], (task, work / "teacher-word" / "hf", student), settings, args, work)
    sampled = ["loss.mode=sampled", "loss.cross_tokenizer=sampled"]  # named: distil_cross.yaml's setting may change
    loss = {"ours-sampled": [*sampled, "loss.kind=reverse_kl"], "ours-sampled-fkl": [*sampled, "loss.kind=forward_kl"],
            "ours-aligned": [*aligned, "loss.kind=forward_kl"],
            "ours-aligned-rkl": [*aligned, "loss.kind=reverse_kl"]}[row]  # fmt: skip
    return run_ours(name, [*loss, *args.set], paths, settings, args, work)


def summary(results: list[Row]) -> str:
    """Per row over its seeds and warm-ups: mean held-out accuracy before -> after, the mean change, how many runs
    improved, and the response length at the end over the start (``--seeds`` / ``--lr-warmups``)."""
    groups: dict[str, list[Row]] = {}
    for r in results:
        groups.setdefault(r.name.rsplit("-seed", 1)[0], []).append(r)
    lines = ["| row | runs | held-out accuracy before → after (mean) | change (mean, min, max) | improved "
             "| response length, last 10 steps / first step (mean, min) |", "|---|---:|---|---|---:|---|"]  # fmt: skip
    for name, rs in groups.items():
        ok = [r for r in rs if r.accuracy_after is not None]
        if not ok:
            lines.append(f"| {name} | 0 | failed | | | |")
            continue
        change = [r.accuracy_after - r.accuracy_before for r in ok]
        ratio = [r.extra["response_length_last10"] / r.extra["response_length_first"] for r in ok
                 if r.extra.get("response_length_first")] or [float("nan")]  # fmt: skip
        lines.append(
            f"| {name} | {len(ok)} | {statistics.fmean(r.accuracy_before for r in ok):.1%} → "
            f"{statistics.fmean(r.accuracy_after for r in ok):.1%} | {statistics.fmean(change):+.1%} "
            f"({min(change):+.1%}, {max(change):+.1%}) | {sum(c > 0 for c in change)}/{len(ok)} "
            f"| {statistics.fmean(ratio):.2f} ({min(ratio):.2f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=PAIRS, default="doubles",
                        help="doubles: the quick start's pair; cross_space: issue #41's (teacher merges across spaces, "
                        "about a quarter of its tokens without a student twin)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="distillation steps of every row (default: 500, the "
                        "quick start's; 100 with --pair cross_space)")  # fmt: skip
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--topk", type=int, default=16, help="loss.topk of ours-aligned")
    parser.add_argument(
        "--packing", action="store_true",
        help="ours with packed micro-batches (the trainer's default); without: padded, as GOLD's (on CPU the packed "
        "attention runs one call per sequence, which costs more than the padding at this size)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the s/step medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    parser.add_argument("--seed", type=int, default=1234, help="seed of every row's run and of the evaluation")
    parser.add_argument("--seeds", help="comma-separated seeds: every row once per seed (and per --lr-warmups), "
                        "with a summary over them")  # fmt: skip
    parser.add_argument("--lr", type=float, help="optim.lr (and min_lr) of every row instead of the pair's")
    parser.add_argument("--lr-warmups", help="comma-separated optim.lr_warmup_steps: every row once per value")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra trainer overrides of our rows (e.g. loss.sampled_ratio_clip=0)")  # fmt: skip
    parser.add_argument("--student-steps", type=int, help="SFT steps of the student's warm-up (default: the pair's)")
    parser.add_argument("--tag", default="", help="appended to every run's name (runs of another --set side by side)")
    parser.add_argument("--no-worker-eval", dest="worker_eval", action="store_false",
                        help="no held-out evaluation by the GOLD worker (TRL's venv) of our rows: the trainer's own "
                        "eval/accuracy only")  # fmt: skip
    parser.add_argument("--trl-venv", default=str(DEFAULT_TRL_VENV), help="TRL's own venv (created when missing)")
    parser.add_argument("--json", metavar="OUT", help="also write every figure and per-step value here")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder); its task, teacher and "
                        "warmed-up student are reused by a later run")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 500 if args.pair == "doubles" else 100
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_cross_tokenizer_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = os.getloadavg()
    try:
        base = {**distil_settings(), **(SPACED_DISTIL if args.pair != "doubles" else {})}
        if args.pair in USER_PAIRS and args.pair != "boundary":  # answers of up to 5 words, 2-3 Mistral tokens each
            base["max_new_tokens"] = 16
        if args.lr is not None:
            base.update(lr=args.lr, min_lr=args.lr)
        paths = prepare(work, args)
        task, teacher, student = paths
        before = worker_eval(student, teacher, task, base, args, work / "warmup-eval") if args.worker_eval else {}
        aligned = [f"loss.topk={args.topk}", "loss.mode=topk", "loss.cross_tokenizer=aligned"]
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
        warmups = [int(x) for x in args.lr_warmups.split(",")] if args.lr_warmups else [base["lr_warmup_steps"]]
        many = len(seeds) * len(warmups) > 1
        results = []
        for warm in warmups:
            for seed in seeds:
                args.seed, settings = seed, {**base, "lr_warmup_steps": warm}
                tag = args.tag + (f"-warmup{warm}-seed{seed}" if many else "")
                for name in rows:
                    results.append(run_row(name, name + tag, paths, settings, aligned, args, work))
                    if args.json:  # what has finished, in case the rest does not
                        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in results]}, indent=1))
        elapsed = time.perf_counter() - started
        load_after = os.getloadavg()
        machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} thread(s) per run; load average "
                   f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")  # fmt: skip
        pair = {"doubles": "student one token per digit, teacher a token per doubled digit",
                "cross_space": "spaced digits, student one token per digit and its space, teacher merges across "
                "spaces (testing.real_tokenizers word <- cross_space)"}.get(args.pair, f"pair {args.pair} "
                "(benchmarks/cross_tokenizer_pairs.py)")  # fmt: skip
        print(
            f"\nDigit reversal, {pair} (both byte-level BPE); teacher SFT, student warm-up (our trainer); then "
            f"{args.steps} steps of {base['prompts_per_step']} prompts, <= {base['max_new_tokens']} new tokens, "
            f"temperature {base['temperature']}, lr {base['lr']:g} cosine to {base['min_lr']:g} after "
            f"{', '.join(map(str, warmups))} warm-up steps; seeds {', '.join(map(str, seeds))}; medians after step "
            f"{args.warmup}. {machine}. Whole benchmark {elapsed:.0f} s.\n"
        )
        print(table(results, before.get("eval"), args.warmup))
        if many:
            print("\n" + summary(results))
        for r in results:
            if r.error is not None:
                print(f"\n{r.name}: {r.error}")
        if "error" in before:
            print(f"\nheld-out evaluation of the warmed-up student: {before['error']}")
        if args.json:
            report = {
                "config": vars(args),
                "settings": base,
                "machine": machine,
                "benchmark_s": elapsed,
                "heldout_before": before.get("eval"),
                "rows": [{**asdict(r), "step_s_median": r.step_median(args.warmup)} for r in results],
            }
            Path(args.json).write_text(json.dumps(report, indent=1))
    finally:
        if args.keep or args.workdir:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
