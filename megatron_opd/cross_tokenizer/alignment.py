"""Align a student's and a teacher's tokenization of one text into groups that cover the same bytes.

Cross-tokenizer distillation (GOLD) compares, group by group, the student's summed log-probability with the
teacher's: the student samples ids in its vocabulary, the text they decode to is re-tokenized by the teacher, and a
group closes wherever both token streams reach the same byte offset. Offsets are counted in UTF-8 bytes, not
characters, because byte-level BPE and byte fallback split multi-byte characters (half an emoji in one token) and
the two sides need not split them alike. Sampled ids need not be the canonical tokenization of their text; only the
bytes count.

A token's bytes are what the tokenizer's decoder makes of it (:class:`TokenBytes`): byte-level BPE (GPT-2, Qwen,
Llama 3 and tiktoken files as :func:`megatron_opd.tokenizer.load_tokenizer` converts them) and SentencePiece-style
tokenizers ("▁" is a space, ``<0xNN>`` one raw byte). SentencePiece's dummy prefix, the space put before a text's
first token, is not in the text: when one stream starts with one space more than the other and its tokenizer adds
or strips a dummy prefix, that space belongs to the first group.

Special tokens (BOS, EOS, chat markers) decode to no text, so they are zero-byte atoms: at a boundary common to both
streams, the special tokens found there pair up in order (student EOS with teacher EOS, one group each) and one left
without a partner forms a group with an empty range on the other side, for the caller to skip. Sampled bytes that
are not valid UTF-8 (a stray byte-level token, a response cut inside a character) decode to U+FFFD, which is what
the teacher reads: for such a sequence each token counts the bytes of the text a UTF-8 decoder emits for it
(``errors="replace"``), so a token holding half a character adds nothing and joins the group of the token that
completes it, and an invalid byte aligns with the teacher's tokens of the replacement character. Limit: a special token between two boundaries
joins the group around it.
"""

from __future__ import annotations

import bisect
import codecs
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal, NamedTuple

import torch

from megatron_opd.tokenizer import bytes_to_unicode

TokenizerKind = Literal["byte_level", "sentencepiece"]

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A byte-fallback piece: one raw byte, written as SentencePiece writes it."""

_CONTEXT_BYTES = 16
"""Bytes shown on each side of the first difference when two texts do not match."""


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder["type"] == "Sequence":
        return [step for inner in decoder["decoders"] for step in _decoder_steps(inner)]
    return [decoder]


def _adds_dummy_prefix(component: Any) -> bool:
    """Whether a normalizer or pre-tokenizer (JSON) puts a space before the text, as SentencePiece does."""
    if isinstance(component, list):
        return any(_adds_dummy_prefix(c) for c in component)
    if not isinstance(component, dict):
        return False
    kind = component.get("type")
    if kind == "Metaspace":
        return component.get("prepend_scheme", "always" if component.get("add_prefix_space") else "never") != "never"
    if kind == "ByteLevel" and component.get("add_prefix_space"):
        return True
    if kind == "Prepend":
        return True
    return any(_adds_dummy_prefix(c) for c in component.values() if isinstance(c, (list, dict)))


class TokenBytes:
    """The UTF-8 bytes each token id of a tokenizer contributes to its decoded text, one table per vocabulary.

    Built from the tokenizer's own ``tokenizers`` backend (a ``PreTrainedTokenizerFast``, as ``load_tokenizer``
    returns it): the decoder says how token strings become bytes. Special tokens get no bytes and are flagged;
    non-special added tokens get what the decoder makes of their content.
    """

    def __init__(self, tokenizer: Any, name: str | None = None):
        self.name = name or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        spec = json.loads(backend.to_str())
        model_type = (spec.get("model") or {}).get("type")
        if model_type not in ("BPE", "Unigram"):
            raise ValueError(
                f"tokenizer {self.name!r}: a {model_type} model is not supported for cross-tokenizer alignment, only "
                "byte-level BPE and SentencePiece-style (BPE / unigram) tokenizers"
            )
        self.kind: TokenizerKind
        self.kind, piece_bytes, self._strips_prefix = self._read_decoder(spec.get("decoder"))
        self.dummy_prefix = self._strips_prefix or _adds_dummy_prefix(
            [spec.get("normalizer"), spec.get("pre_tokenizer")]
        )
        """Whether the token stream may start with one space the text lacks (SentencePiece's dummy prefix)."""

        added = backend.get_added_tokens_decoder()
        special = {i for i, token in added.items() if token.special}
        special.update(getattr(tokenizer, "all_special_ids", ()))
        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(vocab.values(), default=-1) + 1
        table: list[bytes | None] = [None] * size
        for token, i in vocab.items():
            table[i] = b"" if i in special else piece_bytes(token)
        self._table = table
        self._special = bytes(i in special for i in range(size))
        self._by_bytes: tuple[list[bytes], list[int]] | None = None

    def _read_decoder(self, decoder: dict[str, Any] | None):
        """The tokenizer kind, a token string -> bytes function, and whether the decoder strips a dummy prefix."""
        steps = _decoder_steps(decoder)
        kinds = [step["type"] for step in steps]
        if kinds == ["ByteLevel"]:
            alphabet = {char: byte for byte, char in bytes_to_unicode().items()}

            def byte_level(token: str) -> bytes:
                try:
                    return bytes(map(alphabet.__getitem__, token))
                except KeyError:  # a character outside the alphabet: the decoder keeps the token's own UTF-8
                    return token.encode()

            return "byte_level", byte_level, False

        replace: dict[str, str] = {}
        byte_fallback = fused = strips_prefix = False
        for step in steps:
            kind = step["type"]
            if kind == "Replace" and "String" in step["pattern"] and not fused:
                replace[step["pattern"]["String"]] = step["content"]
            elif kind == "Metaspace" and not fused:
                replace[step["replacement"]] = " "
                scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
                strips_prefix = scheme != "never"
            elif kind == "ByteFallback" and not fused:
                byte_fallback = True
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip" and fused and step["content"] == " " and step["start"] <= 1 and step["stop"] == 0:
                strips_prefix = step["start"] == 1
            else:
                raise ValueError(
                    f"tokenizer {self.name!r}: its decoder ({', '.join(kinds) or 'none'}) is neither byte-level BPE "
                    f"nor SentencePiece-style (step {kind} {json.dumps(step)} is not supported), so the bytes of "
                    "each token are unknown and it cannot be aligned with another tokenizer"
                )
        if " " not in replace.values():
            raise ValueError(
                f"tokenizer {self.name!r}: its decoder ({', '.join(kinds) or 'none'}) has no space marker such as "
                "SentencePiece's '▁', so it is neither byte-level BPE nor SentencePiece-style and cannot be aligned"
            )

        def sentencepiece(token: str) -> bytes:
            if byte_fallback and len(token) == 6 and _BYTE_PIECE.fullmatch(token):
                return bytes([int(token[3:5], 16)])
            for old, new in replace.items():
                token = token.replace(old, new)
            return token.encode()

        return "sentencepiece", sentencepiece, strips_prefix

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` (``b""`` for a special token)."""
        return self.pieces([token_id])[0]

    def is_special(self, token_id: int) -> bool:
        self.pieces([token_id])
        return bool(self._special[token_id])

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes of each id (a ``ValueError`` for an id the tokenizer does not have)."""
        if ids and (min(ids) < 0 or max(ids) >= len(self._table)):
            bad = next(i for i in ids if not 0 <= i < len(self._table))
            raise ValueError(f"token id {bad} is outside the vocabulary of tokenizer {self.name!r} ({len(self)} ids)")
        pieces = [self._table[i] for i in ids]
        if None in pieces:
            bad = ids[pieces.index(None)]
            raise ValueError(f"token id {bad} is not a token of tokenizer {self.name!r} (a gap in its ids)")
        return pieces  # type: ignore[return-value]

    def extensions(self, token_id: int, limit: int) -> list[int]:
        """``token_id`` first, then up to ``limit - 1`` other tokens whose bytes begin with its bytes (in the order
        of their bytes, not by length: past ``limit`` the prefix's probability is short of those left out): what the
        tokenizer could have written at that place had the text gone on."""
        if self._by_bytes is None:  # every token sorted by its bytes: a prefix's extensions are one run
            ordered = sorted((b, i) for i, b in enumerate(self._table) if b)
            self._by_bytes = ([b for b, _ in ordered], [i for _, i in ordered])
        keys, ids = self._by_bytes
        prefix, out = self[token_id], [token_id]
        k = bisect.bisect_left(keys, prefix) if prefix else len(keys)
        while k < len(keys) and len(out) < limit and keys[k].startswith(prefix):
            if ids[k] != token_id:
                out.append(ids[k])
            k += 1
        return out

    def special_flags(self, ids: Sequence[int]) -> list[int]:
        """1 for each special token of ``ids``, 0 for the others."""
        special = self._special
        return [special[i] for i in ids]

    def text(self, ids: Sequence[int]) -> str:
        """The text ``ids`` decode to (special tokens skipped), as the tokenizer decodes it: what the teacher reads."""
        data = b"".join(self.pieces(_as_list(ids)))
        if self._strips_prefix and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")


class Group(NamedTuple):
    """Token index ranges ``[start, end)`` of the student and the teacher that cover the same bytes."""

    student: tuple[int, int]
    teacher: tuple[int, int]

    @property
    def one_sided(self) -> bool:
        """A special token without a partner on the other side: the loss skips it."""
        return self.student[0] == self.student[1] or self.teacher[0] == self.teacher[1]


@dataclass(frozen=True)
class AlignmentStats:
    """Group sizes over the two-sided groups (the ones the loss compares), for logging."""

    num_groups: int
    one_sided_groups: int
    mean_student_tokens: float
    mean_teacher_tokens: float
    one_to_one_share: float


@dataclass(frozen=True)
class Alignment:
    """The groups of one (student, teacher) pair, in order, covering every token of both sequences."""

    groups: list[Group]

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def student_group_index(self) -> torch.Tensor:
        """For each student token, the index of its group (LongTensor of the student's length)."""
        return _group_index([g.student for g in self.groups])

    def teacher_group_index(self) -> torch.Tensor:
        """For each teacher token, the index of its group (LongTensor of the teacher's length)."""
        return _group_index([g.teacher for g in self.groups])

    def stats(self) -> AlignmentStats:
        return alignment_stats([self])


def _group_index(ranges: list[tuple[int, int]]) -> torch.Tensor:
    sizes = torch.tensor([end - start for start, end in ranges], dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(ranges)), sizes)


def alignment_stats(alignments: Iterable[Alignment]) -> AlignmentStats:
    """Group sizes over every two-sided group of ``alignments`` (one-sided groups are only counted)."""
    groups = one_sided = student_tokens = teacher_tokens = one_to_one = 0
    for alignment in alignments:
        for (s0, s1), (t0, t1) in alignment.groups:
            if s0 == s1 or t0 == t1:
                one_sided += 1
                continue
            groups += 1
            student_tokens += s1 - s0
            teacher_tokens += t1 - t0
            one_to_one += s1 - s0 == 1 == t1 - t0
    return AlignmentStats(
        num_groups=groups,
        one_sided_groups=one_sided,
        mean_student_tokens=student_tokens / groups if groups else 0.0,
        mean_teacher_tokens=teacher_tokens / groups if groups else 0.0,
        one_to_one_share=one_to_one / groups if groups else 0.0,
    )


class TextMismatchError(ValueError):
    """The two token sequences do not decode to the same text; ``offset`` is the first differing byte."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def _as_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def decoded_pieces(pieces: list[bytes]) -> list[bytes]:
    """The UTF-8 of the text a decoder emits for each token (``errors="replace"``; what is still pending at the end
    is flushed into the last token that had bytes, never into a special token after it): their concatenation is
    the decoded text's UTF-8, whatever the bytes were."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = [decoder.decode(piece).encode("utf-8") for piece in pieces]
    tail = decoder.decode(b"", final=True).encode("utf-8")
    if tail:
        last = max(i for i, piece in enumerate(pieces) if piece)
        out[last] += tail
    return out


def _as_text(pieces: list[bytes]) -> list[bytes]:
    """``pieces`` as they are when they make valid UTF-8 (boundaries inside a character stay), else
    :func:`decoded_pieces`."""
    try:
        b"".join(pieces).decode("utf-8")
    except UnicodeDecodeError:
        return decoded_pieces(pieces)
    return pieces


def _token_ends(pieces: list[bytes], skip: int) -> list[int]:
    """Cumulative byte offsets at the end of each token, the first ``skip`` bytes (a dummy prefix) not counted."""
    return [max(end - skip, 0) for end in accumulate(map(len, pieces))]


def _mismatch(student: bytes, teacher: bytes, student_name: str, teacher_name: str) -> TextMismatchError:
    offset = next((k for k, (a, b) in enumerate(zip(student, teacher)) if a != b), min(len(student), len(teacher)))
    start, stop = max(offset - _CONTEXT_BYTES, 0), offset + _CONTEXT_BYTES
    return TextMismatchError(
        f"the student's and the teacher's tokens decode to different texts ({len(student)} and {len(teacher)} "
        f"bytes), first differing at byte {offset}: student ({student_name}) {student[start:stop]!r} vs teacher "
        f"({teacher_name}) {teacher[start:stop]!r} (bytes {start}..{stop}); the teacher must tokenize the text the "
        "student's ids decode to",
        offset,
    )


def align(
    student_ids: Sequence[int] | torch.Tensor,
    teacher_ids: Sequence[int] | torch.Tensor,
    student_bytes: TokenBytes,
    teacher_bytes: TokenBytes,
) -> Alignment:
    """Group the two token sequences at the byte offsets where both have a token boundary.

    Raises :class:`TextMismatchError` (a ``ValueError``) when they do not decode to the same text, beyond one
    dummy-prefix space.
    """
    student_ids, teacher_ids = _as_list(student_ids), _as_list(teacher_ids)
    student_pieces = _as_text(student_bytes.pieces(student_ids))
    teacher_pieces = _as_text(teacher_bytes.pieces(teacher_ids))
    student_text, teacher_text = b"".join(student_pieces), b"".join(teacher_pieces)
    student_skip = teacher_skip = 0
    if student_text != teacher_text:
        if student_bytes.dummy_prefix and student_text[:1] == b" " and student_text[1:] == teacher_text:
            student_skip = 1
        elif teacher_bytes.dummy_prefix and teacher_text[:1] == b" " and teacher_text[1:] == student_text:
            teacher_skip = 1
        else:
            if student_bytes.dummy_prefix and student_text[:1] == b" " != teacher_text[:1]:
                student_text = student_text[1:]
            if teacher_bytes.dummy_prefix and teacher_text[:1] == b" " != student_text[:1]:
                teacher_text = teacher_text[1:]
            raise _mismatch(student_text, teacher_text, student_bytes.name, teacher_bytes.name)
    return Alignment(
        _groups(
            _token_ends(student_pieces, student_skip),
            student_bytes.special_flags(student_ids),
            _token_ends(teacher_pieces, teacher_skip),
            teacher_bytes.special_flags(teacher_ids),
        )
    )


def _groups(
    student_ends: list[int], student_special: list[int], teacher_ends: list[int], teacher_special: list[int]
) -> list[Group]:
    """Walk both streams once; both end at the same offset (the texts match), so every group closes."""
    n, m = len(student_ends), len(teacher_ends)
    groups: list[Group] = []
    i = j = 0
    while i < n or j < m:
        # At a common boundary: special tokens here are atoms, paired in order, a lone one in a one-sided group.
        s_special, t_special = i < n and student_special[i], j < m and teacher_special[j]
        if s_special or t_special:
            groups.append(Group((i, i + s_special), (j, j + t_special)))
            i, j = i + s_special, j + t_special
            continue
        start = i, j
        if i == n or j == m:  # the other side has zero-byte tokens left that no group before could take
            while i < n and not student_special[i]:
                i += 1
            while j < m and not teacher_special[j]:
                j += 1
            groups.append(Group((start[0], i), (start[1], j)))
            continue
        student_end, teacher_end = student_ends[i], teacher_ends[j]
        i, j = i + 1, j + 1
        while student_end != teacher_end:
            if student_end < teacher_end:
                student_end = student_ends[i]
                i += 1
            else:
                teacher_end = teacher_ends[j]
                j += 1
        # A token that adds no bytes (an empty piece) joins the group that ends where it stands.
        while i < n and not student_special[i] and student_ends[i] == student_end:
            i += 1
        while j < m and not teacher_special[j] and teacher_ends[j] == teacher_end:
            j += 1
        groups.append(Group((start[0], i), (start[1], j)))
    return groups


def align_batch(
    pairs: Iterable[tuple[Sequence[int] | torch.Tensor, Sequence[int] | torch.Tensor]],
    student_bytes: TokenBytes,
    teacher_bytes: TokenBytes,
) -> list[Alignment]:
    """:func:`align` over many (student ids, teacher ids) pairs, in order; linear in their total bytes."""
    return [align(student, teacher, student_bytes, teacher_bytes) for student, teacher in pairs]
