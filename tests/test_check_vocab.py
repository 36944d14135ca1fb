"""``python -m megatron_opd.check_vocab TEACHER STUDENT``: the trainer's vocabulary check before a long run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")

from megatron_opd.check_vocab import main  # noqa: E402
from megatron_opd.testing.real_tokenizers import mistral_sentencepiece_model, write_mistral_tokenizer  # noqa: E402
from megatron_opd.testing.tiny_models import tiny_hf_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _model_folder(path: Path, version: str, rows: int) -> Path:
    """config.json (no weights: the check never builds the model) and Mistral's tokenizer files."""
    tiny_hf_config("llama", vocab_size=rows).save_pretrained(path)
    return write_mistral_tokenizer(path, version)


def test_matching_pair_passes_with_padding_and_stop_ids(tmp_path, capsys):
    teacher = _model_folder(tmp_path / "teacher", "v3", rows=32768 + 128)
    student = _model_folder(tmp_path / "student", "v3", rows=32768)
    assert main([str(teacher), str(student)]) == 0
    out = capsys.readouterr().out
    assert "ok: teacher and student share a 32768-token vocabulary" in out
    assert "teacher 32896, student 32768" in out and "stop on ids [2]" in out


def test_different_vocabularies_exit_1_naming_the_first_difference(tmp_path):
    import sentencepiece

    teacher = _model_folder(tmp_path / "teacher", "v2", rows=32768)
    student = _model_folder(tmp_path / "student", "v3", rows=32768)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_opd.check_vocab", str(teacher), str(student)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    v2, v3 = (
        sentencepiece.SentencePieceProcessor(model_file=str(mistral_sentencepiece_model(v))) for v in ("v2", "v3")
    )
    i = next(i for i in range(v2.vocab_size()) if v2.id_to_piece(i) != v3.id_to_piece(i))
    expected = f"id {i} is {v2.id_to_piece(i)!r} for the teacher and {v3.id_to_piece(i)!r} for the student"
    assert proc.stderr.startswith("refused: ") and expected in proc.stderr


def test_missing_tokenizer_is_named(tmp_path, capsys):
    student = _model_folder(tmp_path / "student", "v3", rows=32768)
    teacher = tmp_path / "teacher"
    tiny_hf_config("llama", vocab_size=32768).save_pretrained(teacher)
    assert main([str(teacher), str(student)]) == 1
    assert "no tokenizer files" in capsys.readouterr().err
