"""Write the quick start's task: a tokenizer, a teacher and a student to initialise from, and the data.

    python -m megatron_opd.tasks.quickstart_task OUT_DIR     # a checkout: python tools/make_quickstart_task.py

OUT_DIR/tokenizer, OUT_DIR/teacher-init and OUT_DIR/student-init (Hugging Face folders with the tokenizer
files), OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl (held out: no digit string in both). The same seed writes
the same files. ``--teacher-digit-merges doubles`` gives the teacher another tokenizer (a token for each doubled
digit, "00"), for the cross-tokenizer quick start. ``--multi-teacher`` adds a second task, digit sorting: a second
teacher to initialise (OUT_DIR/teacher-sort-init), each task's files (OUT_DIR/{reverse,sort}/{train,eval}.jsonl) and
train.jsonl / eval.jsonl mixing both, each record naming its teacher ("teacher": "reverse" or "sort"). The task and
model sizes live in ``megatron_opd.tasks.digits``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from megatron_opd.models.families import FAMILIES
from megatron_opd.tasks import digits

logger = logging.getLogger(__name__)


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def make_quickstart_task(
    out_dir: Path,
    n_train: int = 8000,
    n_eval: int = 256,
    seed: int = 0,
    teacher_digit_merges: str = "none",
    student_family: str | None = None,
    multi_teacher: bool = False,
    student_size: str = "student",
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    digits.make_tokenizer(out_dir / "tokenizer")
    digits.make_model(out_dir / "teacher-init", "teacher", seed=seed, digit_merges=teacher_digit_merges)
    digits.make_model(out_dir / "student-init", student_size, seed=seed + 1, family=student_family)
    eval_records = digits.make_records(n_eval, seed=seed + 1)
    train_records = digits.make_records(n_train, seed=seed + 2, exclude=[r["prompt"] for r in eval_records])
    if not multi_teacher:
        write_jsonl(out_dir / "train.jsonl", train_records)
        write_jsonl(out_dir / "eval.jsonl", eval_records)
        return
    digits.make_model(out_dir / "teacher-sort-init", "teacher", seed=seed + 3)
    splits = {"reverse": (train_records, eval_records)}
    sort_eval = digits.make_records(n_eval, seed=seed + 4, task="sort")
    sort_train = digits.make_records(n_train, seed=seed + 5, exclude=[r["prompt"] for r in sort_eval], task="sort")
    splits["sort"] = (sort_train, sort_eval)
    for task, (train, held_out) in splits.items():
        (out_dir / task).mkdir(exist_ok=True)
        write_jsonl(out_dir / task / "train.jsonl", train)
        write_jsonl(out_dir / task / "eval.jsonl", held_out)
    for name, index in (("train", 0), ("eval", 1)):  # interleaved: every batch holds both tasks
        pairs = zip(*(splits[task][index] for task in splits))
        write_jsonl(out_dir / f"{name}.jsonl",
                    [dict(r, teacher=task) for pair in pairs for task, r in zip(splits, pair)])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--n-train", type=int, default=8000, help="training records")
    parser.add_argument("--n-eval", type=int, default=256, help="held-out records")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights and the data")
    parser.add_argument(
        "--teacher-digit-merges", choices=sorted(digits.DIGIT_MERGES), default="none",
        help="the teacher's tokenizer: the student's (none) or one with digit merges (pairs, doubles)",
    )  # fmt: skip
    parser.add_argument(
        "--student-family", choices=sorted(FAMILIES),
        help="the student's model family (default: Qwen3, as the teacher); the task and sizes stay the same",
    )  # fmt: skip
    parser.add_argument("--multi-teacher", action="store_true", help="also digit sorting, with its own teacher")
    parser.add_argument(
        "--student-size", choices=sorted(s for s in digits.MODEL_SIZES if s != "teacher"), default="student",
        help="the student's shape (digits.MODEL_SIZES): wide_student is the LoRA quick start's base",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per model saved is enough
    make_quickstart_task(
        args.out_dir,
        args.n_train,
        args.n_eval,
        args.seed,
        args.teacher_digit_merges,
        student_family=args.student_family,
        multi_teacher=args.multi_teacher,
        student_size=args.student_size,
    )
    logger.info("wrote %s: tokenizer, teacher-init, student-init, train.jsonl, eval.jsonl", args.out_dir)


if __name__ == "__main__":
    main()
