"""Check a teacher/student pair before a long run: ``opd-check-vocab TEACHER STUDENT``.

Runs the trainer's own start-up check (:func:`megatron_opd.trainer.setup.load_vocabulary`: tokenizers in any
format, the one vocabulary check, stop ids) on two model folders, Hugging Face or dist_ckpt, without building
either model (``python -m megatron_opd.check_vocab`` is the same command). Exit status 0 when the trainer would
accept the pair, 1 with the reason when it would refuse it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_opd import quiet


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the check, print its verdict; the exit status."""
    parser = argparse.ArgumentParser(prog="opd-check-vocab", description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher", help="teacher folder (teacher.path): Hugging Face or dist_ckpt")
    parser.add_argument("student", help="student folder (student.path): Hugging Face or dist_ckpt")
    parser.add_argument("--teacher-tokenizer", help="teacher.tokenizer: folder with the teacher's tokenizer files")
    parser.add_argument("--student-tokenizer", help="student.tokenizer: folder with the student's tokenizer files")
    args = parser.parse_args(argv)
    quiet.install(rank=0, level=logging.WARNING)  # the chat-template warning still shows

    from megatron_opd.checkpoint.source import model_architecture
    from megatron_opd.models.hf_io import CheckpointError
    from megatron_opd.trainer.config import StudentConfig, TeacherConfig, TrainConfig
    from megatron_opd.trainer.setup import load_vocabulary
    from megatron_opd.vocab import TokenizerError

    cfg = TrainConfig(
        student=StudentConfig(path=args.student, tokenizer=args.student_tokenizer),
        teacher=TeacherConfig(path=args.teacher, tokenizer=args.teacher_tokenizer),
    )
    try:
        vocab = load_vocabulary(cfg)
        teacher_rows = model_architecture(args.teacher, "teacher.path").vocab_size
        student_rows = model_architecture(args.student, "student.path").vocab_size
    except (TokenizerError, CheckpointError, ValueError, OSError) as err:
        print(f"refused: {err}", file=sys.stderr)
        return 1
    padded = max(teacher_rows, student_rows) > vocab.vocab_size
    print(
        f"ok: teacher and student share a {vocab.vocab_size}-token vocabulary (embedding rows: teacher "
        f"{teacher_rows}, student {student_rows}{'; rows past the vocabulary are padding, never used' if padded else ''}"
        f"); responses stop on ids {list(vocab.stop_token_ids)}, padding id {vocab.pad_token_id}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
