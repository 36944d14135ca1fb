"""Which teacher token is which student token, for a top-k divergence on the student's vocabulary
(``loss.cross_tokenizer=aligned``).

Two tokens are the same token when they add the same bytes to the decoded text (:class:`TokenBytes`: "▁" and "Ġ"
are spaces, ``<0xNN>`` one raw byte). Special tokens add no bytes, so they never match by their text, with one
exception: each teacher stop id is the student's first stop id (EOS is EOS).

For the aligned loss a teacher token is also credited to the student token its bytes begin with
(:attr:`VocabularyMap.teacher_to_first`): at a byte offset where both tokenizations have a boundary, the teacher's
probability of "5 1" (one teacher token across a space) is probability the student writes "5" next, which a map of
identical bytes alone would leave unmapped while the teacher's EOS maps whole (continuing under-credited, stopping
not). Of the student tokens its bytes begin with, it is the one the student's tokenizer writes first for those bytes
(mid-text, after its EOS), else the longest: Mistral writes " ember" as "▁em" "ber" though it has "▁emb", so Llama
3's " ember" is credited to "▁em", the token a Mistral student writes there (the longest, "▁emb", it never writes
there; on issue #51's ``llama3_mistral`` pair the aligned loss taught the student such spellings). A teacher token
whose bytes a longer student token extends (" " when the student has " 5") stays unmapped in that table, unless
exactly one student token extends it and it has no student twin (Mistral's "▁v" for a word-level student's
" violet"): the student can write those bytes at a boundary only as that token, so the teacher's
probability of it is credited there (an upper bound: the chain rule's continuation, "iolet", taken as certain).
Otherwise which student token it stands for depends on what the teacher writes after it.

At the answer's first position a teacher fine-tuned with the answer with and without its leading space (a chat
template's boundary) splits one answer's mass between two variants, "1" and " 1"; a student whose template writes
the space is compared with their sum (:attr:`VocabularyMap.teacher_to_first_spaced`: each teacher token read with
the space), which is the teacher's probability of the answer summed over both boundary variants, as the exact
reference (``testing.cross_tokenizer_reference``, "boundary sum") scores it.

A vocabulary may hold one byte string twice (SentencePiece byte fallback: ``<0x41>`` and ``A``). The student side
then keeps the id its tokenizer writes for that text; on the teacher side both ids map to it, and
:meth:`VocabularyMap.map_topk` merges their probabilities into one slot.

Shape legend: ``T`` positions, ``K`` teacher top-k slots.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from megatron_opd.cross_tokenizer.alignment import TokenBytes

_UNMAPPED = -1
_EMPTY_SLOT_ID = 0
"""A valid student id for slots outside the support, so that gathers on them stay in range."""


def _ids_by_bytes(token_bytes: TokenBytes) -> dict[bytes, list[int]]:
    """Every non-special token with bytes, grouped by its bytes (ids ascending)."""
    special = token_bytes._special
    groups: dict[bytes, list[int]] = {}
    for token_id, piece in enumerate(token_bytes._table):
        if piece and not special[token_id]:
            groups.setdefault(piece, []).append(token_id)
    return groups


def _encode_mid_text(tokenizer: Any, texts: list[str]) -> list[list[int] | None]:
    """Each text's ids as ``tokenizer`` writes it mid-text, in one batched call: encoded after its EOS (else BOS), whose
    ids are then dropped; None where no such token exists or the encoding does not start with its ids. A SentencePiece
    tokenizer would otherwise put its dummy-prefix space before a text ("A" -> "▁A")."""
    anchor = tokenizer.eos_token or tokenizer.bos_token
    if not anchor or not texts:
        return [None] * len(texts)
    anchor_ids = list(tokenizer(anchor, add_special_tokens=False)["input_ids"])
    encoded = tokenizer([anchor + text for text in texts], add_special_tokens=False)["input_ids"]
    return [list(ids[len(anchor_ids) :]) if list(ids[: len(anchor_ids)]) == anchor_ids else None for ids in encoded]


def _canonical_id(piece: bytes, ids: list[int], tokenizer: Any | None) -> int:
    """Of several ids with the same bytes, the one ``tokenizer`` writes for that text (alone, else mid-text: see
    :func:`_encode_mid_text`), else the smallest."""
    if tokenizer is None:
        return ids[0]
    try:
        text = piece.decode()
    except UnicodeDecodeError:
        return ids[0]
    for encoded in (list(tokenizer(text, add_special_tokens=False)["input_ids"]), *_encode_mid_text(tokenizer, [text])):
        if encoded is not None and len(encoded) == 1 and encoded[0] in ids:
            return encoded[0]
    return ids[0]


def _extended(piece: bytes, ordered: list[bytes]) -> bool:
    """Whether a longer student token (``ordered``: the student's byte strings sorted) begins with ``piece``."""
    k = bisect.bisect_right(ordered, piece)
    return k < len(ordered) and ordered[k].startswith(piece)


def _first_student_id(
    piece: bytes, student_ids: dict[bytes, int], ordered: list[bytes], written: dict[bytes, bytes] | None = None
) -> int:
    """The student id of the student token ``piece`` begins with: where longer student tokens begin with ``piece``
    (``ordered``: the student's byte strings sorted), the one that does when it is the only one and ``piece`` has no
    twin (the student's only way to write those bytes at a boundary), else -1; where none does, the first token the
    student's tokenizer writes for ``piece`` (``written``: its bytes, a prefix of ``piece``; Mistral writes " ember"
    as "▁em" "ber" though it has "▁emb"), else the longest student token that is a prefix of ``piece``; else -1."""
    k = bisect.bisect_right(ordered, piece)
    extended = _extended(piece, ordered)
    if extended and piece not in student_ids and (k + 1 == len(ordered) or not ordered[k + 1].startswith(piece)):
        return student_ids[ordered[k]]
    if extended:
        return _UNMAPPED
    if piece in student_ids:
        return student_ids[piece]
    if written is not None and piece in written:
        return student_ids[written[piece]]
    for end in range(len(piece), 0, -1):
        found = student_ids.get(piece[:end])
        if found is not None:
            return found
    return _UNMAPPED


def _written_first_tokens(pieces: list[bytes], student: TokenBytes, tokenizer: Any) -> dict[bytes, bytes]:
    """For each piece that decodes as text: the bytes of the first token ``tokenizer`` writes for it mid-text
    (:func:`_encode_mid_text`), where those bytes begin the piece."""
    texts: dict[bytes, str] = {}
    for piece in pieces:
        with contextlib.suppress(UnicodeDecodeError):
            texts[piece] = piece.decode()
    written = {}
    for piece, ids in zip(texts, _encode_mid_text(tokenizer, list(texts.values()))):
        first = student._table[ids[0]] if ids else b""
        if first and piece.startswith(first):
            written[piece] = first
    return written


class VocabularyMap:
    """Teacher token id -> student token id, for tokens whose bytes are identical (built once per run)."""

    def __init__(
        self,
        student: TokenBytes,
        teacher: TokenBytes,
        student_stop_ids: Sequence[int],
        teacher_stop_ids: Sequence[int],
        student_tokenizer: Any | None = None,
    ):
        """``student_tokenizer`` (optional) picks the student id among several with the same bytes (see
        :func:`_canonical_id`; without it the smallest id is taken, which for byte fallback is the ``<0xNN>`` piece)
        and the first student token of a teacher token's bytes (:func:`_written_first_tokens`; without it the
        longest).
        """
        for side, stop_ids, token_bytes in (
            ("student", student_stop_ids, student),
            ("teacher", teacher_stop_ids, teacher),
        ):
            bad = [i for i in stop_ids if not 0 <= i < len(token_bytes)]
            if bad:
                raise ValueError(
                    f"{side} stop id {bad[0]} is outside the vocabulary of tokenizer {token_bytes.name!r} "
                    f"({len(token_bytes)} ids)"
                )
        if teacher_stop_ids and not student_stop_ids:
            raise ValueError(
                f"the teacher has stop ids {list(teacher_stop_ids)} but the student none: the teacher's EOS would "
                "have no student twin"
            )
        self.student_vocab_size = len(student)
        self.student_eos_id = int(student_stop_ids[0]) if student_stop_ids else -1
        """The student id the teacher's stops map to (-1: none)."""
        self.teacher_vocab_size = len(teacher)

        student_ids = {
            piece: ids[0] if len(ids) == 1 else _canonical_id(piece, ids, student_tokenizer)
            for piece, ids in _ids_by_bytes(student).items()
        }
        special = teacher._special
        table = [
            student_ids.get(piece, _UNMAPPED) if piece and not special[token_id] else _UNMAPPED
            for token_id, piece in enumerate(teacher._table)
        ]
        ordered = sorted(student_ids)
        pieces = {piece for token_id, piece in enumerate(teacher._table) if piece and not special[token_id]}
        pieces |= {piece if piece.startswith(b" ") else b" " + piece for piece in pieces}
        # only where the tokenizer's choice is asked: no twin, no longer student token (one batched call, ~3 s at
        # Llama 3's 128k ids)
        pieces = {piece for piece in pieces if piece not in student_ids and not _extended(piece, ordered)}
        written = (
            None if student_tokenizer is None else _written_first_tokens(sorted(pieces), student, student_tokenizer)
        )
        first = [
            _first_student_id(piece, student_ids, ordered, written) if piece and not special[token_id] else _UNMAPPED
            for token_id, piece in enumerate(teacher._table)
        ]
        spaced = [
            _first_student_id(piece if piece.startswith(b" ") else b" " + piece, student_ids, ordered, written)
            if piece and not special[token_id]
            else _UNMAPPED
            for token_id, piece in enumerate(teacher._table)
        ]
        for stop_id in teacher_stop_ids:
            table[int(stop_id)] = first[int(stop_id)] = spaced[int(stop_id)] = int(student_stop_ids[0])
        self.teacher_to_student = torch.tensor(table, dtype=torch.int64)
        """``[teacher vocab size]``: the student id of each teacher id, -1 where the teacher token has no student
        twin."""
        self.teacher_to_first = torch.tensor(first, dtype=torch.int64)
        """``[teacher vocab size]``: the student token a teacher token's bytes begin with (the one the student's
        tokenizer writes first for them, else the longest; the twin where there is one), -1 where a longer student
        token extends the teacher token's bytes or none begins them (see the module docstring)."""
        self.teacher_to_first_spaced = torch.tensor(spaced, dtype=torch.int64)
        """``[teacher vocab size]``: :attr:`teacher_to_first` of each teacher token read with a leading space where it
        has none ("1 2" as " 1 2"): at the answer's first position when the student's template writes the space, the
        teacher's two boundary variants of one answer are one student token (module docstring)."""
        self._tables_on_device: dict[tuple[bool, bool], torch.Tensor] = {}
        self._has_bytes = torch.tensor([bool(piece) and not special[i] for i, piece in enumerate(teacher._table)])

    def mapped_count(self, prefixes: bool = False) -> int:
        """How many teacher ids have a student twin (stop ids included); ``prefixes``: a student token in
        :attr:`teacher_to_first`."""
        return int((self._table(prefixes) != _UNMAPPED).sum())

    def _table(self, prefixes: bool, spaced: bool = False) -> torch.Tensor:
        if spaced:
            return self.teacher_to_first_spaced
        return self.teacher_to_first if prefixes else self.teacher_to_student

    def map_topk(
        self, ids_TK: torch.Tensor, logprobs_TK: torch.Tensor, *, prefixes: bool = False, spaced: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher top-k (ids, log-probs) at some positions -> (student ids, log-probs, support bool), same [T, K] shape.

        ``prefixes``: map by :attr:`teacher_to_first` (the student token each teacher token begins with) instead of
        by identical bytes; ``spaced``: by :attr:`teacher_to_first_spaced`. Teacher ids with the same student id are merged into the first of their slots (log of the
        summed probabilities); the other slots, and those of teacher ids without a twin, are empty: student id 0,
        log-probability ``-inf``, support False. Their mass is left to the loss's tail.
        """
        if ids_TK.shape != logprobs_TK.shape or ids_TK.dim() != 2:
            raise ValueError(
                f"teacher top-k ids {tuple(ids_TK.shape)} and log-probs {tuple(logprobs_TK.shape)} must both be [T, K]"
            )
        out_of_range_TK = (ids_TK < 0) | (ids_TK >= self.teacher_vocab_size)
        if out_of_range_TK.any():  # a device sync, for an error that would otherwise be a silent wrong gather
            bad = int(ids_TK[out_of_range_TK][0])
            raise ValueError(
                f"teacher token id {bad} is outside the teacher vocabulary of the vocabulary map "
                f"({self.teacher_vocab_size} ids)"
            )
        table = self._tables_on_device.get((prefixes, spaced))
        if table is None or table.device != ids_TK.device:
            table = self._tables_on_device[prefixes, spaced] = self._table(prefixes, spaced).to(ids_TK.device)
        student_TK = table[ids_TK.long()]
        out_dtype = logprobs_TK.dtype

        # Sort each row by student id (stable: a group's first slot stays first); equal neighbours are one group.
        student_TK, order_TK = torch.sort(student_TK, dim=1, stable=True)
        dtype = torch.promote_types(logprobs_TK.dtype, torch.float32)
        logprobs_TK = logprobs_TK.to(dtype).gather(1, order_TK)
        starts_TK = torch.ones_like(student_TK, dtype=torch.bool)
        starts_TK[:, 1:] = student_TK[:, 1:] != student_TK[:, :-1]
        group_TK = starts_TK.cumsum(dim=1) - 1

        # logsumexp per group, with the group's max taken out (0 where it is -inf, so -inf - -inf gives no NaN).
        group_max_TK = torch.full_like(logprobs_TK, -torch.inf).scatter_reduce(
            1, group_TK, logprobs_TK, reduce="amax", include_self=True
        )
        shift_TK = torch.where(torch.isfinite(group_max_TK), group_max_TK, 0.0)
        summed_TK = torch.zeros_like(logprobs_TK).scatter_add(
            1, group_TK, torch.exp(logprobs_TK - shift_TK.gather(1, group_TK))
        )
        merged_TK = (shift_TK + torch.log(summed_TK)).gather(1, group_TK)

        support_TK = starts_TK & (student_TK != _UNMAPPED)
        sorted_ids_TK = torch.where(support_TK, student_TK, _EMPTY_SLOT_ID)
        sorted_logprobs_TK = torch.where(support_TK, merged_TK, -torch.inf)
        # Back to the teacher's slot order.
        ids_out_TK = torch.empty_like(sorted_ids_TK).scatter_(1, order_TK, sorted_ids_TK)
        logprobs_out_TK = torch.empty_like(sorted_logprobs_TK).scatter_(1, order_TK, sorted_logprobs_TK)
        support_out_TK = torch.empty_like(support_TK).scatter_(1, order_TK, support_TK)
        return ids_out_TK, logprobs_out_TK.to(out_dtype), support_out_TK

    def coverage(self, teacher_ids: Sequence[int]) -> dict[str, float]:
        """How much of the teacher maps: the share of its ids (special ones left out, stops included) with a twin
        (``twin_ids``) or a first student token (``first_ids``), and the same shares of ``teacher_ids`` (a text's
        tokens, each counted as often as it occurs: ``twin_tokens``, ``first_tokens``)."""
        ids = torch.as_tensor(list(teacher_ids), dtype=torch.int64)
        countable = (self.teacher_to_student != _UNMAPPED) | (self.teacher_to_first != _UNMAPPED) | self._has_bytes
        out = {}
        for name, table in (("twin", self.teacher_to_student), ("first", self.teacher_to_first)):
            mapped = table != _UNMAPPED
            out[f"{name}_ids"] = float(mapped[countable].float().mean())
            out[f"{name}_tokens"] = float(mapped[ids].float().mean()) if ids.numel() else 0.0
        return out
