"""The one vocabulary check every teacher path goes through, and where tokenizer files and EOS ids live.

Distillation compares the teacher's and the student's distributions id by id, so id ``i`` must be the same
token string in both, with the same special tokens. Embeddings may have more rows than the tokenizer has
tokens (padded for TP or kernels, e.g. Qwen2.5-7B's 152,064 rows against 0.5B's 151,936 for the same
151,665-token tokenizer); the rows past ``len(tokenizer)`` are never real tokens, so losses, top-k and
sampling use ``V = len(tokenizer)``. Tokenizers in every format (``tokenizer.json``, a SentencePiece or tiktoken
``tokenizer.model``) come from :func:`megatron_opd.tokenizer.load_tokenizer`, so the check compares them alike;
``python -m megatron_opd.check_vocab TEACHER STUDENT`` runs it before a long job.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from megatron_opd.model_files import HF_CONFIG_DIR, TokenizerError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Any one of these marks a folder as holding a Hugging Face tokenizer."""

_SPECIAL_ATTRS = ("bos_token", "eos_token", "pad_token", "unk_token")


class VocabularyMismatchError(TokenizerError):
    """The teacher's and the student's vocabularies differ, so their distributions cannot be compared."""


_SAME_FAMILY = (
    "distillation compares the two distributions token by token, so teacher and student need the same "
    "tokenizer: pick models of one family, point teacher.tokenizer / student.tokenizer at the right folders, or "
    "distil across tokenizers with loss.mode=sampled loss.cross_tokenizer=sampled (or loss.mode=topk "
    "loss.cross_tokenizer=aligned; docs/training.md, 'Which cross-tokenizer mode', says on which pairs each gains)"
)


def _id_to_token(vocab: dict[str, int], size: int) -> list[str | None]:
    table: list[str | None] = [None] * size
    for token, i in vocab.items():
        if i >= size:
            table.extend([None] * (i + 1 - size))
            size = i + 1
        table[i] = token
    return table


def _first_difference(
    teacher_vocab: dict[str, int], student_vocab: dict[str, int]
) -> tuple[int, str | None, str | None]:
    size = max(max(teacher_vocab.values(), default=-1), max(student_vocab.values(), default=-1)) + 1
    t_table = _id_to_token(teacher_vocab, size)
    s_table = _id_to_token(student_vocab, size)
    for i, (t, s) in enumerate(zip(t_table, s_table)):
        if t != s:
            return i, t, s
    raise AssertionError("vocabularies differ but no id differs")  # the dicts differ, so some id must


def _added_tokens(tokenizer: Any) -> dict[int, tuple[str, bool]]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): (str(tok), bool(getattr(tok, "special", False))) for i, tok in decoder.items()}


def _describe(added: tuple[str, bool] | None) -> str:
    return "absent" if added is None else f"{added[0]!r} (special={added[1]})"


def check_rows(tokenizer_size: int, rows: int, role: str, name: str) -> None:
    if rows < tokenizer_size:
        raise VocabularyMismatchError(
            f"{role} {name!r} has an embedding of {rows} rows but its tokenizer has {tokenizer_size} tokens, so "
            f"ids {rows}..{tokenizer_size - 1} have no embedding; is {role}.tokenizer the tokenizer of this model?"
        )


def check_vocab(
    teacher_tokenizer: Any,
    student_tokenizer: Any,
    *,
    teacher_name: str,
    student_name: str,
    teacher_embedding_rows: int,
    student_embedding_rows: int,
) -> int:
    """Refuse a teacher whose vocabulary differs from the student's; return the shared size ``V``.

    Token strings are compared through ``get_vocab()`` dicts (one dict comparison for 150k tokens), then the
    named special tokens and the added tokens. Different chat templates only warn: prompts are rendered with
    the student's template and both models score the same ids.
    """
    t_size, s_size = len(teacher_tokenizer), len(student_tokenizer)
    check_rows(t_size, teacher_embedding_rows, "teacher", teacher_name)
    check_rows(s_size, student_embedding_rows, "student", student_name)
    if t_size != s_size:
        raise VocabularyMismatchError(
            f"teacher {teacher_name!r} has {t_size} tokens and student {student_name!r} has {s_size}; {_SAME_FAMILY}"
        )

    t_vocab, s_vocab = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if t_vocab != s_vocab:
        i, t_tok, s_tok = _first_difference(t_vocab, s_vocab)
        raise VocabularyMismatchError(
            f"teacher {teacher_name!r} and student {student_name!r} have different vocabularies: id {i} is "
            f"{t_tok!r} for the teacher and {s_tok!r} for the student; {_SAME_FAMILY}"
        )

    for attr in _SPECIAL_ATTRS:
        t_tok, s_tok = getattr(teacher_tokenizer, attr, None), getattr(student_tokenizer, attr, None)
        t_tok = None if t_tok is None else str(t_tok)
        s_tok = None if s_tok is None else str(s_tok)
        if t_tok != s_tok:
            raise VocabularyMismatchError(
                f"teacher {teacher_name!r} and student {student_name!r} differ in {attr}: {t_tok!r} for the teacher "
                f"and {s_tok!r} for the student; {_SAME_FAMILY}"
            )

    t_added, s_added = _added_tokens(teacher_tokenizer), _added_tokens(student_tokenizer)
    if t_added != s_added:
        i = min(j for j in t_added.keys() | s_added.keys() if t_added.get(j) != s_added.get(j))
        raise VocabularyMismatchError(
            f"teacher {teacher_name!r} and student {student_name!r} differ in added token id {i}: "
            f"{_describe(t_added.get(i))} for the teacher and {_describe(s_added.get(i))} for the student; "
            f"{_SAME_FAMILY}"
        )

    if getattr(teacher_tokenizer, "chat_template", None) != getattr(student_tokenizer, "chat_template", None):
        logger.warning(
            "teacher %r and student %r share a vocabulary but have different chat templates; prompts are rendered "
            "with the student's template, which the teacher scores as given",
            teacher_name,
            student_name,
        )
    return s_size


def eos_token_ids(model_dir: str | os.PathLike, tokenizer: Any) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and all ``eos_token_id`` of generation_config.json.

    Chat models often stop on an end-of-turn token that only generation_config.json lists (e.g. Llama 3's
    ``<|eot_id|>``). A dist_ckpt keeps the file in its ``hf_config/`` folder.
    """
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    folder = Path(model_dir)
    for candidate in (folder / "generation_config.json", folder / HF_CONFIG_DIR / "generation_config.json"):
        if candidate.is_file():
            try:
                config = json.loads(candidate.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise TokenizerError(f"{candidate}: malformed JSON ({err.msg} at line {err.lineno})") from err
            eos = config.get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(i) for i in eos)
            elif eos is not None:
                raise TokenizerError(f"{candidate}: eos_token_id must be an int or a list of ints, got {eos!r}")
            break
    return sorted(ids)


def tokenizer_dir(model_path: str | os.PathLike, field: str = "path") -> Path:
    """The folder with the tokenizer files of ``model_path``: itself, or a dist_ckpt's ``hf_config/``."""
    folder = Path(model_path)
    for candidate in (folder, folder / HF_CONFIG_DIR):
        if any((candidate / name).is_file() for name in TOKENIZER_FILES):
            return candidate
    raise TokenizerError(
        f"{field}={str(model_path)!r}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in it or in its "
        f"{HF_CONFIG_DIR}/ folder; set the matching *.tokenizer key to the folder holding the tokenizer"
    )
