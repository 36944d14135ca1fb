"""What any remote-teacher transport carries, and the interface the fault-tolerant client drives.

The client (:mod:`megatron_opd.teacher.client`) owns splitting, fan-out over replicas, timeouts, retries and
reply validation; a transport only moves one request to one server and back. The ZeroMQ transport to the
Megatron teacher server is :mod:`megatron_opd.teacher.zmq_transport`, the HTTP one to a vLLM server is
:mod:`megatron_opd.teacher.vllm_transport` (each a ``TransportFactory`` building one ``Transport`` per address).

Errors say whether a retry can help: ``TransportError`` (timeout, lost connection, malformed reply, a server-side
failure) is retried, elsewhere if another replica is alive; ``RequestRefusedError`` (wrong token, wrong protocol
version, an invalid request) is not.

Shape legend: ``N`` sequences, ``S`` positions, ``K`` top-k, ``R`` requested ids per position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_opd.config import comma_list

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Log-probability dtypes a reply can carry (ids always travel as int32)."""


class TeacherError(RuntimeError):
    """Base of every remote-teacher failure."""


class TransportError(TeacherError):
    """One attempt at one server failed in a way a retry (there or on another replica) can fix."""


class RequestRefusedError(TeacherError):
    """The server refused the request (token, protocol version, invalid request): retrying cannot help."""


class TeacherUnavailableError(TeacherError):
    """A batch could not be scored after every retry; the message names the servers and the batch."""


@dataclass
class ScoreRequest:
    """Score ``tokens`` ``[N, S]``: the top-``k`` at ``temperature`` per position, and log-probs at ``request_ids``."""

    tokens: torch.Tensor
    """``[N, S]`` integer token ids."""
    k: int
    """Top-k per position (``loss.topk``; at most the server's ``--topk``)."""
    temperature: float = 1.0
    """Applied by the server to the teacher's logits before the top-k and the log-softmax."""
    request_ids: torch.Tensor | None = None
    """``[N, S, R]`` ids whose log-probabilities are wanted (e.g. the sampled next token), or None."""
    wire_dtype: str = "fp32"
    """Log-probability dtype of the reply: one of ``WIRE_DTYPES``."""
    transfer: str = "topk"
    """``topk``: the top-``k`` and requested log-probabilities; ``hidden``: the final hidden states instead (``k``,
    ``temperature`` and ``request_ids`` unused: the trainer forms the logits with the teacher's output layer)."""
    vocabulary: str = ""
    """The fingerprint (``vocabulary.fingerprint``, 64 hex digits) of the vocabulary ``tokens`` and ``request_ids``
    are ids of: a server refuses ids of another. The client fills in the one it checked at connect."""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.tokens.shape[0]), int(self.tokens.shape[1])

    @property
    def num_requested(self) -> int:
        return 0 if self.request_ids is None else int(self.request_ids.shape[-1])


@dataclass
class ScoreReply:
    """The teacher's answer to a ``ScoreRequest``: ids most probable first, log-probs in the wire dtype (or, for
    ``transfer=hidden``, only ``hidden``)."""

    topk_ids: torch.Tensor | None = None
    """``[N, S, K]`` integer global token ids."""
    topk_logprobs: torch.Tensor | None = None
    """``[N, S, K]`` log-probabilities at ``topk_ids`` (normalised over the whole vocabulary)."""
    requested_logprobs: torch.Tensor | None = None
    """``[N, S, R]`` log-probabilities at the request's ``request_ids``."""
    hidden: torch.Tensor | None = None
    """``[N, S, H]`` final hidden states (after the final norm), the answer to ``transfer=hidden``."""


_INFO_INTS = ("protocol", "vocab_size", "embedding_rows", "max_topk", "max_seq_len", "max_batch_tokens",
              "max_message_bytes", "max_requested")  # fmt: skip


@dataclass
class ServerInfo:
    """What a server tells a client at connect (the hello reply): limits and the vocabulary to check."""

    protocol: int
    vocab_size: int
    """Real tokens; top-k ids are below it."""
    embedding_rows: int
    """Rows of the teacher's embedding (may exceed ``vocab_size``: padded embeddings)."""
    max_topk: int
    max_seq_len: int
    max_batch_tokens: int
    """Most ``N * S`` positions one request may carry (the client splits batches below it)."""
    max_message_bytes: int
    max_requested: int
    """Most requested ids per position."""
    vocab_fingerprint: str
    """SHA-256 of the tokenizer summary: every replica must report the one the vocabulary check accepted."""
    model: str = ""
    tokenizer: dict[str, Any] | None = field(default=None, repr=False)
    """The tokenizer summary (:mod:`megatron_opd.teacher.vocabulary`), sent only when the hello asks for it."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, info: Any) -> ServerInfo:
        """Parse the hello reply's JSON object; a ``ValueError`` names the first missing or mistyped field."""
        if not isinstance(info, dict):
            raise ValueError(f"server info must be a JSON object, got {type(info).__name__}")
        for name in _INFO_INTS:
            value = info.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"server info field {name!r} must be a non-negative integer, got {value!r}")
        if not isinstance(info.get("vocab_fingerprint"), str):
            raise ValueError("server info field 'vocab_fingerprint' must be a string")
        tokenizer = info.get("tokenizer")
        if tokenizer is not None and not isinstance(tokenizer, dict):
            raise ValueError("server info field 'tokenizer' must be an object or absent")
        known = {*_INFO_INTS, "vocab_fingerprint", "model", "tokenizer"}
        return cls(
            **{name: info[name] for name in _INFO_INTS},
            vocab_fingerprint=info["vocab_fingerprint"],
            model=str(info.get("model", "")),
            tokenizer=tokenizer,
            extra={k: v for k, v in info.items() if k not in known},
        )

    def to_dict(self, with_tokenizer: bool) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _INFO_INTS}
        out.update(self.extra, vocab_fingerprint=self.vocab_fingerprint, model=self.model)
        if with_tokenizer and self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        return out


class Transport(Protocol):
    """One connection to one teacher server, used by one thread at a time.

    After any ``TransportError`` the client calls ``close()`` and builds a fresh transport for the next attempt
    (a ZeroMQ socket that timed out must never be reused). A transport whose connection is made in the background
    also has ``wait_connected(timeout_s) -> bool`` (the ZeroMQ one): the client waits on it before the hello, to
    tell a server that accepts no connection (down, restarting) from one that is slow to answer, and
    ``closed_while_idle() -> bool``: the client replaces a cached connection that closed between requests (a server
    restart) without counting a failure.
    """

    address: str

    def hello(self, *, with_tokenizer: bool, timeout_s: float) -> ServerInfo:
        """The server's limits and vocabulary fingerprint (and its tokenizer summary when asked)."""
        ...

    def score(self, request: ScoreRequest, timeout_s: float) -> ScoreReply:
        """Send one request and wait at most ``timeout_s`` for its reply (not yet validated against the request)."""
        ...

    def close(self) -> None:
        """Drop the connection (idempotent)."""
        ...


def parse_address(address: str, field: str = "teacher.address") -> tuple[str, int]:
    """``host:port`` or ``[v6-host]:port`` -> ``(host, port)``; a ``ValueError`` naming ``field`` otherwise."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{field}: {address!r} is not host:port (e.g. 127.0.0.1:5555 or [::1]:5555)")
    return host.strip("[]"), int(port)


def split_addresses(addresses: str, field: str = "teacher.address") -> list[str]:
    """``host:port,host:port`` -> the list of replicas (each checked)."""
    out = comma_list(addresses)
    if not out:
        raise ValueError(f"{field} is empty: give host:port of the teacher server (replicas: host:port,host:port)")
    for address in out:
        parse_address(address, field)
    return out


TransportFactory = Callable[[str], Transport]
"""Builds a transport to ``host:port`` (the client calls it again to replace a failed one)."""
