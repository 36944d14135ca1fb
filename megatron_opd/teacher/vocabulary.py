"""The teacher's tokenizer as it travels to clients: a JSON summary, its fingerprint, and a read-only stand-in.

A remote teacher's tokenizer files are not on the trainer's machine, yet the trainer's one vocabulary check
(:func:`megatron_opd.vocab.check_vocab`) must compare it with the student's. The server sends a summary of exactly
what that check reads (token -> id, named special tokens, added tokens, chat template, length); the client wraps it
in ``RemoteTokenizer``, which the check accepts like a transformers tokenizer. The summary's SHA-256 pins every
replica (and every reconnect) to the vocabulary that was checked.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""The named special tokens the vocabulary check compares."""


def tokenizer_summary(tokenizer: Any) -> dict[str, Any]:
    """What the vocabulary check reads of ``tokenizer``, as a JSON-able dict."""
    special = {}
    for attr in SPECIAL_TOKEN_ATTRS:
        value = getattr(tokenizer, attr, None)
        special[attr] = None if value is None else str(value)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    added = [[int(i), str(tok), bool(getattr(tok, "special", False))] for i, tok in sorted(decoder.items())]
    template = getattr(tokenizer, "chat_template", None)
    return {
        "size": len(tokenizer),
        "vocab": {str(token): int(i) for token, i in tokenizer.get_vocab().items()},
        "special": special,
        "added": added,
        "chat_template": template if isinstance(template, (str, dict)) else None,
    }


def fingerprint(summary: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a tokenizer summary."""
    canonical = json.dumps(summary, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class _AddedToken:
    """``str()`` and ``.special``: all the vocabulary check reads of transformers' ``AddedToken``."""

    def __init__(self, content: str, special: bool) -> None:
        self.content, self.special = content, special

    def __str__(self) -> str:
        return self.content

    def __repr__(self) -> str:
        return f"AddedToken({self.content!r}, special={self.special})"


class RemoteTokenizer:
    """A teacher server's tokenizer for the vocabulary check; it cannot encode or decode text."""

    def __init__(self, summary: dict[str, Any], source: str) -> None:
        self.source = source
        size, vocab, special, added = (summary.get(k) for k in ("size", "vocab", "special", "added"))
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"{source}: tokenizer summary field 'size' must be a non-negative integer")
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise ValueError(f"{source}: tokenizer summary field 'vocab' must map token strings to integer ids")
        if not isinstance(special, dict) or not all(v is None or isinstance(v, str) for v in special.values()):
            raise ValueError(f"{source}: tokenizer summary field 'special' must map names to strings or null")
        if not isinstance(added, list) or not all(
            isinstance(a, list) and len(a) == 3 and isinstance(a[0], int) and isinstance(a[1], str) for a in added
        ):
            raise ValueError(f"{source}: tokenizer summary field 'added' must be a list of [id, content, special]")
        self._size = size
        self._vocab = dict(vocab)
        for attr in SPECIAL_TOKEN_ATTRS:
            setattr(self, attr, special.get(attr))
        self.added_tokens_decoder = {i: _AddedToken(content, bool(flag)) for i, content, flag in added}
        self.chat_template = summary.get("chat_template")

    def __len__(self) -> int:
        return self._size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __repr__(self) -> str:
        return f"RemoteTokenizer({self.source}, {self._size} tokens)"
