"""The teacher server's binary wire format: one self-describing frame per message, no pickle anywhere.

Every message starts with a 16-byte header (little-endian)::

    offset  size  field
    0       4     magic  b"OPDT"
    4       2     protocol version (3)
    6       1     message type (``MessageType``)
    7       1     flags (HELLO: bit 0 = send the tokenizer summary; SCORE: bit 0 = request ids follow,
                  bit 1 = reply with hidden states)
    8       8     request id (chosen by the client, echoed in the reply)

followed by the fields of its type and raw little-endian arrays (see ``docs/teacher.md`` for every layout).
Arrays are read with ``numpy.frombuffer`` after the exact byte count implied by the shapes has been checked
against the message length, so a lying header can never make the reader allocate more than the message holds.
Decoding errors raise ``WireError`` naming the field; a request whose header was readable carries its request id
so the server can address the error reply.

Version 2 added ``transfer=hidden``: a SCORE with flag bit 1 is answered by a HIDDEN message holding the final
hidden states, from which the trainer forms the teacher's logits itself (exact dense distillation).

Version 3: a SCORE names the vocabulary its ids are in (the 32-byte SHA-256 fingerprint of the teacher's
tokenizer summary) and the server refuses ids of another vocabulary. Requests are in the teacher's own ids: with a
teacher of another tokenizer (``loss.cross_tokenizer``) the trainer re-tokenizes for it and maps the reply back,
and ids built with the wrong tokenizer are refused rather than scored as another text.

Shape legend: ``N`` sequences, ``S`` positions, ``K`` top-k, ``R`` requested ids per position, ``H`` hidden size.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from megatron_opd.teacher.transport import ScoreReply, ScoreRequest

MAGIC = b"OPDT"
VERSION = 3
MAX_TOKEN_BYTES = 1024
"""Longest authentication token."""

FLAG_WITH_TOKENIZER = 1
FLAG_HAS_REQUESTED = 1
FLAG_HIDDEN = 2

HEADER = struct.Struct("<4sHBBQ")
TOKEN_LEN = struct.Struct("<H")
SCORE_FIELDS = struct.Struct("<BxxxIdIII32s")  # dtype, k, temperature, N, S, R, vocabulary fingerprint
SCORES_FIELDS = struct.Struct("<BxxxIIII")  # dtype, N, S, K, R
HIDDEN_FIELDS = struct.Struct("<BxxxIII")  # dtype, N, S, H
ERROR_FIELDS = struct.Struct("<HI")  # code, message length
INFO_FIELDS = struct.Struct("<I")  # JSON length


class MessageType(IntEnum):
    HELLO = 1
    INFO = 2
    SCORE = 3
    SCORES = 4
    ERROR = 5
    PING = 6
    PONG = 7
    HIDDEN = 8


class ErrorCode(IntEnum):
    BAD_REQUEST = 1
    """Malformed or invalid request (retrying the same bytes cannot help)."""
    UNAUTHORIZED = 2
    VERSION = 3
    LIMIT = 4
    """Over one of the server's limits (message size, tokens, top-k, requested ids)."""
    INTERNAL = 5
    """The server failed while scoring; another replica (or a retry) may succeed."""


DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
# numpy has no bfloat16: bf16 travels as its raw 16 bits and is viewed back.
_NUMPY_OF = {"fp32": "<f4", "fp16": "<f2", "bf16": "<i2"}
_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


class WireError(ValueError):
    """Bytes that are not a valid message; ``field`` names what was wrong."""

    def __init__(self, field: str, message: str, request_id: int | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.request_id = request_id


class VersionError(WireError):
    """A well-formed header of another protocol version."""


@dataclass
class Hello:
    request_id: int
    token: bytes
    with_tokenizer: bool


@dataclass
class Info:
    request_id: int
    info: dict[str, Any]


@dataclass
class Score:
    request_id: int
    token: bytes
    request: ScoreRequest


@dataclass
class Scores:
    request_id: int
    reply: ScoreReply
    wire_dtype: str


@dataclass
class Hidden:
    request_id: int
    reply: ScoreReply
    wire_dtype: str


@dataclass
class Error:
    request_id: int
    code: int
    message: str


@dataclass
class Ping:
    request_id: int


@dataclass
class Pong:
    request_id: int


Message = Hello | Info | Score | Scores | Hidden | Error | Ping | Pong


def itemsize(wire_dtype: str) -> int:
    """Bytes per log-probability in ``wire_dtype``."""
    return _ITEMSIZE[wire_dtype]


def scores_size(n: int, s: int, k: int, r: int, wire_dtype: str) -> int:
    """Exact bytes of a SCORES reply of these shapes (the client splits batches so replies fit the limits)."""
    return HEADER.size + SCORES_FIELDS.size + n * s * (k * (4 + _ITEMSIZE[wire_dtype]) + r * _ITEMSIZE[wire_dtype])


def hidden_size(n: int, s: int, h: int, wire_dtype: str) -> int:
    """Exact bytes of a HIDDEN reply of these shapes."""
    return HEADER.size + HIDDEN_FIELDS.size + n * s * h * _ITEMSIZE[wire_dtype]


def score_size(n: int, s: int, r: int, token: bytes) -> int:
    """Exact bytes of a SCORE request of these shapes."""
    return HEADER.size + TOKEN_LEN.size + len(token) + SCORE_FIELDS.size + 4 * n * s * (1 + r)


# ---- encoding ------------------------------------------------------------------------------------------------


def _header(kind: MessageType, flags: int, request_id: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(kind), flags, request_id)


def _token(token: bytes) -> bytes:
    if len(token) > MAX_TOKEN_BYTES:
        raise WireError("token", f"{len(token)} bytes, at most {MAX_TOKEN_BYTES}")
    return TOKEN_LEN.pack(len(token)) + token


def _int32_bytes(x: torch.Tensor, field: str) -> bytes:
    x = x.detach().to("cpu", torch.int64)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) > np.iinfo(np.int32).max):
        raise WireError(field, "ids must be in [0, 2**31)")
    return x.numpy().astype("<i4").tobytes()


def _float_bytes(x: torch.Tensor, wire_dtype: str) -> bytes:
    x = x.detach().to("cpu")
    if wire_dtype == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    if wire_dtype == "fp16":
        # Clamp to fp16's range so a very unlikely token stays finite rather than becoming -inf.
        x = x.float().clamp(min=float(torch.finfo(torch.float16).min))
    return x.numpy().astype(_NUMPY_OF[wire_dtype]).tobytes()


def encode_hello(request_id: int, token: bytes, with_tokenizer: bool) -> bytes:
    return _header(MessageType.HELLO, FLAG_WITH_TOKENIZER if with_tokenizer else 0, request_id) + _token(token)


def encode_info(request_id: int, info: dict[str, Any] | bytes) -> bytes:
    """An INFO reply; ``info`` as a dict or as its UTF-8 JSON already encoded (servers cache it)."""
    body = info if isinstance(info, bytes) else json.dumps(info, separators=(",", ":"), ensure_ascii=False).encode()
    return _header(MessageType.INFO, 0, request_id) + INFO_FIELDS.pack(len(body)) + body


def encode_score(request_id: int, token: bytes, request: ScoreRequest) -> bytes:
    """A SCORE request (tokens and request ids as int32)."""
    if request.wire_dtype not in DTYPE_CODES:
        raise WireError("dtype", f"must be one of {sorted(DTYPE_CODES)}, got {request.wire_dtype!r}")
    if request.tokens.dim() != 2:
        raise WireError("tokens", f"must be [N, S], got shape {tuple(request.tokens.shape)}")
    n, s = request.shape
    r = request.num_requested
    if request.request_ids is not None and tuple(request.request_ids.shape) != (n, s, r):
        raise WireError("request_ids", f"must be [N, S, R] = [{n}, {s}, R], got {tuple(request.request_ids.shape)}")
    if request.transfer not in ("topk", "hidden"):
        raise WireError("transfer", f"must be 'topk' or 'hidden', got {request.transfer!r}")
    if request.transfer == "hidden" and r:
        raise WireError("request_ids", "a hidden-state request takes no requested ids (the trainer forms the logits)")
    try:
        vocabulary = bytes.fromhex(request.vocabulary)
    except ValueError:
        vocabulary = b""
    if len(vocabulary) != 32:
        raise WireError("vocabulary", f"must be a 64-hex-digit fingerprint, got {request.vocabulary!r}")
    flags = (FLAG_HAS_REQUESTED if r else 0) | (FLAG_HIDDEN if request.transfer == "hidden" else 0)
    parts = [
        _header(MessageType.SCORE, flags, request_id),
        _token(token),
        SCORE_FIELDS.pack(DTYPE_CODES[request.wire_dtype], request.k, float(request.temperature), n, s, r, vocabulary),
        _int32_bytes(request.tokens, "tokens"),
    ]
    if r:
        parts.append(_int32_bytes(request.request_ids, "request_ids"))
    return b"".join(parts)


def encode_scores(request_id: int, reply: ScoreReply, wire_dtype: str) -> bytes:
    """A SCORES reply: ids int32, log-probabilities (top-k, then requested) in ``wire_dtype``."""
    n, s, k = (int(d) for d in reply.topk_ids.shape)
    r = 0 if reply.requested_logprobs is None else int(reply.requested_logprobs.shape[-1])
    flags = FLAG_HAS_REQUESTED if r else 0
    parts = [
        _header(MessageType.SCORES, flags, request_id),
        SCORES_FIELDS.pack(DTYPE_CODES[wire_dtype], n, s, k, r),
        _int32_bytes(reply.topk_ids, "topk_ids"),
        _float_bytes(reply.topk_logprobs, wire_dtype),
    ]
    if r:
        parts.append(_float_bytes(reply.requested_logprobs, wire_dtype))
    return b"".join(parts)


def encode_hidden(request_id: int, reply: ScoreReply, wire_dtype: str) -> bytes:
    """A HIDDEN reply: the final hidden states ``[N, S, H]`` in ``wire_dtype``."""
    n, s, h = (int(d) for d in reply.hidden.shape)
    return b"".join(
        [
            _header(MessageType.HIDDEN, 0, request_id),
            HIDDEN_FIELDS.pack(DTYPE_CODES[wire_dtype], n, s, h),
            _float_bytes(reply.hidden, wire_dtype),
        ]
    )


def encode_error(request_id: int, code: ErrorCode, message: str) -> bytes:
    text = message.encode("utf-8")[:4096]
    return _header(MessageType.ERROR, 0, request_id) + ERROR_FIELDS.pack(int(code), len(text)) + text


def encode_ping(request_id: int) -> bytes:
    return _header(MessageType.PING, 0, request_id)


def encode_pong(request_id: int) -> bytes:
    return _header(MessageType.PONG, 0, request_id)


# ---- decoding ------------------------------------------------------------------------------------------------


class _Reader:
    """Walks a message, checking every read against its length."""

    def __init__(self, data: bytes, offset: int, request_id: int) -> None:
        self.data, self.offset, self.request_id = data, offset, request_id

    def fail(self, field: str, message: str) -> WireError:
        return WireError(field, message, self.request_id)

    def take(self, size: int, field: str) -> memoryview:
        if self.offset + size > len(self.data):
            left = len(self.data) - self.offset
            raise self.fail(field, f"needs {size} bytes at offset {self.offset}, the message has {left} left")
        view = memoryview(self.data)[self.offset : self.offset + size]
        self.offset += size
        return view

    def unpack(self, fmt: struct.Struct, field: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, field))

    def token(self) -> bytes:
        (length,) = self.unpack(TOKEN_LEN, "token length")
        if length > MAX_TOKEN_BYTES:
            raise self.fail("token length", f"{length} bytes, at most {MAX_TOKEN_BYTES}")
        return bytes(self.take(length, "token"))

    def array(self, count: int, wire: str, field: str) -> torch.Tensor:
        """``count`` little-endian values of ``wire`` (``int32`` or a wire float dtype) as a tensor."""
        size = 4 if wire == "int32" else _ITEMSIZE[wire]
        raw = self.take(count * size, field)
        little = np.dtype("<i4" if wire == "int32" else _NUMPY_OF[wire])
        out = torch.from_numpy(np.frombuffer(raw, dtype=little).astype(little.newbyteorder("="), copy=True))
        return out.view(torch.bfloat16) if wire == "bf16" else out

    def end(self) -> None:
        if self.offset != len(self.data):
            raise self.fail("length", f"{len(self.data) - self.offset} unexpected bytes after the last field")


def _dtype_name(code: int, reader: _Reader) -> str:
    if code not in _DTYPE_NAMES:
        raise reader.fail("dtype", f"unknown code {code} (known: {_DTYPE_NAMES})")
    return _DTYPE_NAMES[code]


def _positive(value: int, field: str, reader: _Reader, minimum: int = 1) -> int:
    if value < minimum:
        raise reader.fail(field, f"must be >= {minimum}, got {value}")
    return value


def _requested_flag(flags: int, r: int, reader: _Reader) -> None:
    has_requested = bool(flags & FLAG_HAS_REQUESTED)
    if has_requested != (r > 0):
        raise reader.fail("R", f"R={r} but the requested-ids flag is {'set' if has_requested else 'clear'}")


def decode(data: bytes, max_bytes: int) -> Message:
    """Parse one message of at most ``max_bytes``; raises ``WireError`` (``VersionError``) naming the field."""
    if len(data) > max_bytes:
        raise WireError("length", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < HEADER.size:
        raise WireError("header", f"{len(data)} bytes, a header needs {HEADER.size}")
    magic, version, kind, flags, request_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("magic", f"expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != VERSION:
        raise VersionError("version", f"protocol version {version}, this side speaks {VERSION}", request_id)
    reader = _Reader(data, HEADER.size, request_id)
    if kind == MessageType.HELLO:
        token = reader.token()
        reader.end()
        return Hello(request_id, token, bool(flags & FLAG_WITH_TOKENIZER))
    if kind == MessageType.INFO:
        (length,) = reader.unpack(INFO_FIELDS, "info length")
        raw = bytes(reader.take(length, "info"))
        reader.end()
        try:
            info = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise reader.fail("info", f"not UTF-8 JSON ({err})") from None
        if not isinstance(info, dict):
            raise reader.fail("info", "must be a JSON object")
        return Info(request_id, info)
    if kind == MessageType.SCORE:
        token = reader.token()
        code, k, temperature, n, s, r, vocabulary = reader.unpack(SCORE_FIELDS, "score fields")
        dtype = _dtype_name(code, reader)
        transfer = "hidden" if flags & FLAG_HIDDEN else "topk"
        _positive(k, "k", reader, minimum=0 if transfer == "hidden" else 1)
        _positive(n, "N", reader)
        _positive(s, "S", reader)
        _requested_flag(flags, r, reader)
        if transfer == "hidden" and r:
            raise reader.fail("R", f"R={r}: a hidden-state request takes no requested ids")
        tokens = reader.array(n * s, "int32", "tokens").view(n, s)
        request_ids = reader.array(n * s * r, "int32", "request_ids").view(n, s, r) if r else None
        reader.end()
        request = ScoreRequest(tokens, k, temperature, request_ids, dtype, transfer, bytes(vocabulary).hex())
        return Score(request_id, token, request)
    if kind == MessageType.SCORES:
        code, n, s, k, r = reader.unpack(SCORES_FIELDS, "scores fields")
        dtype = _dtype_name(code, reader)
        _requested_flag(flags, r, reader)
        ids = reader.array(n * s * k, "int32", "topk_ids").view(n, s, k)
        logprobs = reader.array(n * s * k, dtype, "topk_logprobs").view(n, s, k)
        requested = reader.array(n * s * r, dtype, "requested_logprobs").view(n, s, r) if r else None
        reader.end()
        return Scores(request_id, ScoreReply(ids, logprobs, requested), dtype)
    if kind == MessageType.HIDDEN:
        code, n, s, h = reader.unpack(HIDDEN_FIELDS, "hidden fields")
        dtype = _dtype_name(code, reader)
        hidden = reader.array(n * s * h, dtype, "hidden").view(n, s, h)
        reader.end()
        return Hidden(request_id, ScoreReply(hidden=hidden), dtype)
    if kind == MessageType.ERROR:
        code, length = reader.unpack(ERROR_FIELDS, "error fields")
        text = bytes(reader.take(length, "error message")).decode("utf-8", errors="replace")
        reader.end()
        return Error(request_id, code, text)
    if kind in (MessageType.PING, MessageType.PONG):
        reader.end()
        return Ping(request_id) if kind == MessageType.PING else Pong(request_id)
    raise reader.fail("message type", f"unknown type {kind}")
