"""A tiny teacher/student pair with a shared tokenizer and prompt files, for trainer tests and benchmarks.

The tokenizer has fewer tokens (a few hundred) than the models' 1000 embedding rows: the padded-embedding path
(ids at or above the tokenizer size are never sampled, scored or trained) runs in every trainer test.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DistillFixture:
    teacher: str
    student: str
    train_file: str
    eval_file: str

    def overrides(self, output_dir: str | os.PathLike, **extra: object) -> list[str]:
        """Command-line overrides of a short distillation run on this pair."""
        values: dict[str, object] = {
            "student.path": self.student,
            "teacher.path": self.teacher,
            "data.train_files": self.train_file,
            "data.eval_files": self.eval_file,
            "train.prompts_per_step": 4,
            "train.micro_batch_size": 2,
            "rollout.max_new_tokens": 6,
            "rollout.n": 1,
            "optim.lr": 1e-3,
            "eval.max_prompts": 4,
            "logging.progress_bar": False,
            "output_dir": str(output_dir),
        }
        values.update(extra)
        return [f"{k}={v}" for k, v in values.items()]


def make_distill_fixture(
    root: str | os.PathLike,
    *,
    num_prompts: int = 32,
    padded_embeddings: bool = True,
    tied_student: bool = True,
    teacher_layers: int = 4,
    **model_overrides: object,
) -> DistillFixture:
    """Write ``root/teacher`` (4 layers), ``root/student`` (2 layers), tokenizer files in both, and prompts.

    ``padded_embeddings=False`` gives the models exactly the tokenizer's rows (vLLM normalises over every row).
    ``tied_student``: the student's input and output embeddings are one matrix, like most small Qwen and Llama
    students (the teacher's are untied).
    """
    from transformers import AutoTokenizer

    from megatron_opd.models.families import qwen3
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

    root = Path(root)
    rows = 1000
    if not padded_embeddings:
        rows = len(AutoTokenizer.from_pretrained(make_tiny_tokenizer(root / "tokenizer", vocab_size=1000)))
    dirs = {}
    student = {"num_hidden_layers": 2, "tie_word_embeddings": tied_student}
    for name, seed, overrides in (("teacher", 0, {"num_hidden_layers": teacher_layers}), ("student", 1, student)):
        overrides = {**model_overrides, **overrides}
        dirs[name] = make_tiny_hf_model(qwen3.FAMILY.name, root / name, seed=seed, vocab_size=rows, **overrides)
        make_tiny_tokenizer(dirs[name], vocab_size=1000)
    words = ("tensor", "pipeline", "teacher", "student", "vocabulary", "divergence", "sample", "token")
    for split, n, offset in (("train", num_prompts, 0), ("eval", 8, 1000)):
        with open(root / f"{split}.jsonl", "w") as f:
            for i in range(n):
                prompt = f"{words[i % len(words)]} {i + offset} {words[(i * 3 + 1) % len(words)]}"
                f.write(json.dumps({"prompt": prompt, "answer": str(i)}) + "\n")
    return DistillFixture(
        str(dirs["teacher"]), str(dirs["student"]), str(root / "train.jsonl"), str(root / "eval.jsonl")
    )
