"""The teacher/student vocabulary check, EOS ids from generation_config.json, and where tokenizers live."""

from __future__ import annotations

import json
import logging
import re

import pytest

from megatron_opd.testing.tiny_models import make_tiny_tokenizer
from megatron_opd.vocab import (
    TokenizerError,
    VocabularyMismatchError,
    check_vocab,
    eos_token_ids,
    tokenizer_dir,
)

_CORPUS_A = (
    "Pack my box with five dozen liquor jugs. Sphinx of black quartz, judge my vow. "
    "How vexingly quick daft zebras jump! The five boxing wizards jump quickly. "
)
_CORPUS_B = (
    "The teacher scores every token the student samples; the divergence per token is the loss. "
    "Tensor parallelism shards the vocabulary, and pipeline parallelism splits the layers. "
)


def _train_bpe(corpus: str, out_dir, vocab_size: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


def _load(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _check(teacher, student, t_rows=None, s_rows=None) -> int:
    return check_vocab(
        teacher,
        student,
        teacher_name="big-teacher",
        student_name="small-student",
        teacher_embedding_rows=len(teacher) if t_rows is None else t_rows,
        student_embedding_rows=len(student) if s_rows is None else s_rows,
    )


def test_identical_tokenizers_pass(tiny_dir):
    teacher, student = _load(tiny_dir), _load(tiny_dir)
    assert _check(teacher, student) == len(student)


def test_padded_embedding_accepted_fewer_rows_refused(tiny_dir):
    teacher, student = _load(tiny_dir), _load(tiny_dir)
    v = len(student)
    # Like Qwen2.5-7B (152,064 rows) teaching 0.5B (151,936 rows) with one 151,665-token tokenizer.
    assert _check(teacher, student, t_rows=v + 128, s_rows=v + 64) == v
    with pytest.raises(
        TokenizerError, match=rf"student 'small-student' has an embedding of {v - 1} rows .* {v} tokens"
    ):
        _check(teacher, student, s_rows=v - 1)
    with pytest.raises(
        VocabularyMismatchError, match=rf"teacher 'big-teacher' has an embedding of 10 rows .* {v} tokens"
    ):
        _check(teacher, student, t_rows=10)


def test_different_corpora_same_size_refused(tmp_path):
    size = 300
    teacher = _train_bpe(_CORPUS_A, tmp_path / "a", vocab_size=size)
    student = _train_bpe(_CORPUS_B, tmp_path / "b", vocab_size=size)
    assert len(teacher) == len(student) == size  # same size: only the token strings tell them apart
    t_vocab, s_vocab = teacher.get_vocab(), student.get_vocab()
    t_by_id = {i: t for t, i in t_vocab.items()}
    s_by_id = {i: t for t, i in s_vocab.items()}
    first = min(i for i in range(size) if t_by_id.get(i) != s_by_id.get(i))
    with pytest.raises(VocabularyMismatchError) as err:
        _check(teacher, student)
    message = str(err.value)
    assert "big-teacher" in message and "small-student" in message
    assert f"id {first} is {t_by_id.get(first)!r} for the teacher and {s_by_id.get(first)!r} for the student" in message


def test_different_sizes_refused(tmp_path, tiny_dir):
    student = _load(tiny_dir)
    teacher = _train_bpe(_CORPUS_A, tmp_path / "small", vocab_size=300)
    with pytest.raises(VocabularyMismatchError, match=rf"has {len(teacher)} tokens and student .* has {len(student)}"):
        _check(teacher, student)


def test_special_token_difference_refused(tiny_dir):
    teacher, student = _load(tiny_dir), _load(tiny_dir)
    teacher.eos_token = "<|im_end|>"  # an instruct teacher ending turns where the base student ends documents
    with pytest.raises(
        VocabularyMismatchError, match=r"differ in eos_token: '<\|im_end\|>' for the teacher and '<\|endoftext\|>'"
    ):
        _check(teacher, student)


def test_chat_template_difference_warns(tiny_dir, caplog):
    teacher, student = _load(tiny_dir), _load(tiny_dir)
    teacher.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="megatron_opd.vocab"):
        assert _check(teacher, student) == len(student)
    assert any("different chat templates" in r.getMessage() for r in caplog.records)


def test_eos_token_ids(tmp_path, tiny_dir):
    tok = _load(tiny_dir)
    eos = tok.eos_token_id
    assert eos_token_ids(tmp_path, tok) == [eos]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, eos, 3]}))
    assert eos_token_ids(tmp_path, tok) == sorted({3, 7, eos})
    # A dist_ckpt keeps it under hf_config/.
    ckpt = tmp_path / "ckpt"
    (ckpt / "hf_config").mkdir(parents=True)
    (ckpt / "hf_config" / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert eos_token_ids(ckpt, tok) == sorted({5, eos})


def test_tokenizer_dir(tmp_path, tiny_dir):
    assert tokenizer_dir(tiny_dir) == tiny_dir
    ckpt = tmp_path / "dist_ckpt"
    (ckpt / "hf_config").mkdir(parents=True)
    (ckpt / "hf_config" / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    assert tokenizer_dir(ckpt) == ckpt / "hf_config"
    with pytest.raises(TokenizerError, match=r"teacher\.path=.*empty.*no tokenizer files"):
        tokenizer_dir(tmp_path / "empty", field="teacher.path")


# ---- SentencePiece tokenizer.model folders (the formats of megatron_opd.tokenizer) ---------------------------------


def _first_piece_difference(teacher_model, student_model) -> tuple[int, str, str]:
    """The first id whose piece differs, read with sentencepiece itself."""
    import sentencepiece

    t = sentencepiece.SentencePieceProcessor(model_file=str(teacher_model))
    s = sentencepiece.SentencePieceProcessor(model_file=str(student_model))
    i = next(i for i in range(t.vocab_size()) if t.id_to_piece(i) != s.id_to_piece(i))
    return i, t.id_to_piece(i), s.id_to_piece(i)


def test_two_sentencepiece_models_of_one_size_refused(tmp_path):
    pytest.importorskip("sentencepiece")
    from megatron_opd.testing.real_tokenizers import train_sentencepiece, write_sentencepiece_tokenizer
    from megatron_opd.tokenizer import load_tokenizer

    size = 400  # 3 specials + 256 byte-fallback pieces + merges: the two corpora give different merges
    teacher_dir = write_sentencepiece_tokenizer(tmp_path / "a", train_sentencepiece(_CORPUS_A.split(". ") * 8, size))
    student_dir = write_sentencepiece_tokenizer(tmp_path / "b", train_sentencepiece(_CORPUS_B.split(". ") * 8, size))
    teacher, student = load_tokenizer(teacher_dir), load_tokenizer(student_dir)
    assert len(teacher) == len(student) == size
    i, t_piece, s_piece = _first_piece_difference(teacher_dir / "tokenizer.model", student_dir / "tokenizer.model")
    with pytest.raises(VocabularyMismatchError) as err:
        _check(teacher, student)
    assert f"id {i} is {t_piece!r} for the teacher and {s_piece!r} for the student" in str(err.value)


def test_real_same_size_vocabularies_refused(tmp_path):
    """Mistral's v2 and v3 tokenizers: both 32,768 tokens, control tokens renamed from id 10 on."""
    pytest.importorskip("mistral_common")
    from megatron_opd.testing.real_tokenizers import mistral_sentencepiece_model, write_mistral_tokenizer
    from megatron_opd.tokenizer import load_tokenizer

    teacher = load_tokenizer(write_mistral_tokenizer(tmp_path / "v2", "v2"))
    student = load_tokenizer(write_mistral_tokenizer(tmp_path / "v3", "v3"))
    assert len(teacher) == len(student) == 32768
    i, t_piece, s_piece = _first_piece_difference(mistral_sentencepiece_model("v2"), mistral_sentencepiece_model("v3"))
    with pytest.raises(VocabularyMismatchError, match=rf"id {i} is {re.escape(repr(t_piece))} for the teacher and "):
        _check(teacher, student)


def test_one_sentencepiece_vocabulary_in_both_formats_passes(tmp_path, caplog):
    """tokenizer.model alone (student) against the tokenizer.json tools/checkpoint writes (teacher's hf_config/)."""
    pytest.importorskip("mistral_common")
    from megatron_opd.checkpoint.hf_to_mcore import copy_hf_side_files
    from megatron_opd.testing.real_tokenizers import write_mistral_tokenizer
    from megatron_opd.tokenizer import load_tokenizer

    student_dir = write_mistral_tokenizer(tmp_path / "student", "v3")
    copy_hf_side_files(student_dir, tmp_path / "teacher")
    assert (tmp_path / "teacher" / "tokenizer.json").is_file() and not (student_dir / "tokenizer.json").exists()
    teacher, student = load_tokenizer(tmp_path / "teacher"), load_tokenizer(student_dir)
    with caplog.at_level(logging.WARNING, logger="megatron_opd.vocab"):
        assert _check(teacher, student, t_rows=32768 + 128, s_rows=32768) == 32768  # padded teacher: accepted
    assert not caplog.records
    teacher.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="megatron_opd.vocab"):
        assert _check(teacher, student) == 32768
    assert any("different chat templates" in r.getMessage() for r in caplog.records)
