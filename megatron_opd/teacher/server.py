"""The teacher server's front end on rank 0: a ZeroMQ ROUTER, request checks, dynamic batching, replies.

Requests from any number of clients are checked as they arrive (token, protocol version, limits, id ranges) and
queued; whenever the model is free, queued requests with the same temperature are batched together, at most
``max_batch_tokens`` positions in one forward. A packing scorer (THD) gets each request's rows at their own length
and computes nothing for the padding between requests; otherwise the rows are right-padded to the longest (a causal
model's scores at earlier positions do not see the padding). Each batch is scored once with the largest ``k`` and number of requested ids among them, and each client
gets its own slice back in the wire dtype it asked for. Anything malformed gets an error reply (or, past the
message-size limit, is cut off by libzmq) and never reaches the model, so one bad client cannot disturb the others.

The model behind it is a ``BatchScorer``: on a multi-rank server, :mod:`megatron_opd.teacher.serve` broadcasts each
batch to every rank and runs the sharded forward; tests plug in small stand-ins.

Shape legend: ``N`` sequences, ``S`` positions, ``K`` top-k, ``R`` requested ids per position.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_opd.interfaces import TeacherScores
from megatron_opd.teacher import wire
from megatron_opd.teacher.transport import ScoreReply, ScoreRequest, ServerInfo
from megatron_opd.teacher.vocabulary import fingerprint
from megatron_opd.teacher.zmq_transport import endpoint

logger = logging.getLogger(__name__)

FAULT_ENV = "MEGATRON_OPD_TEACHER_FAULT"
"""``exit_at_request:N``: rank 0 dies when the N-th score request arrives, before answering it (fault tests)."""


def fault_request_from_env() -> int | None:
    """The request count of ``MEGATRON_OPD_TEACHER_FAULT=exit_at_request:N`` (None when unset)."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    name, _, count = value.partition(":")
    if name != "exit_at_request" or not count.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r}: expected exit_at_request:N")
    return int(count)


class BatchScorer(Protocol):
    """The model: scores one batch (every rank of a sharded server takes part)."""

    packing: bool
    """Whether ``score`` skips the padding past ``lengths`` (then the batch's budget counts real positions)."""

    def score(
        self,
        tokens_NS: torch.Tensor,
        request_ids_NSR: torch.Tensor | None,
        k: int,
        temperature: float,
        lengths: list[int] | None = None,
        transfer: str = "topk",
    ) -> TeacherScores:
        """Top-``k`` ids and log-probs at ``temperature`` per position (and at ``request_ids_NSR``), on the CPU;
        ``lengths``: each row's real positions (scores past them are any valid ones). ``transfer="hidden"`` (only
        where the server's info has ``hidden_size``): the final hidden states ``dense_hidden`` instead."""
        ...

    def heartbeat(self) -> None:
        """Called while idle (a sharded scorer keeps its other ranks' collectives from timing out)."""
        ...


@dataclass
class ServerLimits:
    """What one request may ask; the client learns these from the hello reply and splits batches to fit."""

    max_topk: int = 256
    """Largest ``k`` (``--topk``)."""
    max_seq_len: int = 4096
    """Longest sequence (the teacher's context)."""
    max_batch_tokens: int = 65536
    """Most positions in one forward, padding counted unless the scorer packs (a request may carry at most this
    many; smaller ones are batched)."""
    max_message_bytes: int = 256 << 20
    """Largest request (libzmq cuts off a longer one) and largest reply."""
    max_requested: int = 1024
    """Most requested ids per position."""
    batch_wait_s: float = 0.002
    """How long to wait for more requests once one is queued, to batch them together."""


def describe_server(
    limits: ServerLimits,
    *,
    vocab_size: int,
    embedding_rows: int,
    tokenizer: dict,
    model: str,
    extra: dict | None = None,
    hidden_size: int | None = None,
    output_weight_sumsq: float | None = None,
) -> ServerInfo:
    """The hello reply of a server with ``limits`` serving a model and its tokenizer summary. ``hidden_size``: the
    server also answers ``transfer=hidden``; ``output_weight_sumsq`` (the sum of squares of the output layer's
    rows of real tokens) lets a trainer check that it loaded the same output layer."""
    extra = dict(extra or {})
    if hidden_size is not None:
        extra.update(hidden_size=hidden_size, output_weight_sumsq=output_weight_sumsq)
    return ServerInfo(
        protocol=wire.VERSION,
        vocab_size=vocab_size,
        embedding_rows=embedding_rows,
        max_topk=limits.max_topk,
        max_seq_len=limits.max_seq_len,
        max_batch_tokens=limits.max_batch_tokens,
        max_message_bytes=limits.max_message_bytes,
        max_requested=limits.max_requested,
        vocab_fingerprint=fingerprint(tokenizer),
        model=model,
        tokenizer=tokenizer,
        extra=extra,
    )


@dataclass
class _Pending:
    identity: bytes
    request_id: int
    request: ScoreRequest


class _Fault(Exception):
    """Raised by the default fault action (in-process servers of tests)."""


def _default_fault() -> None:
    raise _Fault("fault injection")


class TeacherServer:
    """Rank 0's request loop. ``serve()`` runs until ``stop`` is set (or a fault hook fires)."""

    def __init__(
        self,
        scorer: BatchScorer,
        info: ServerInfo,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: bytes | None = None,
        limits: ServerLimits | None = None,
        fault_at_request: int | None = None,
        on_fault: Callable[[], None] = _default_fault,
    ) -> None:
        self.scorer = scorer
        self.limits = limits or ServerLimits()
        self.info = info
        self.token = token or None
        self.fault_at_request = fault_at_request
        self.on_fault = on_fault
        self.requests = 0
        """Score requests accepted so far."""
        self.answered = 0
        """Score requests answered so far."""
        self._queue: deque[_Pending] = deque()
        self._info_json = {  # encoded once: the tokenizer summary of a large vocabulary is megabytes
            flag: json.dumps(info.to_dict(with_tokenizer=flag), separators=(",", ":"), ensure_ascii=False).encode()
            for flag in (False, True)
        }
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, int(":" in host))
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        self._socket.bind(endpoint(host, port) if port else endpoint(host, 0).rsplit(":", 1)[0] + ":*")
        self.port = int(self._socket.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )

    # ---- the loop --------------------------------------------------------------------------------------------

    def serve(self, stop: threading.Event | None = None) -> None:
        """Answer requests until ``stop`` is set; the socket is closed on the way out (also on a fault)."""
        stop = stop or threading.Event()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not stop.is_set():
                events = dict(poller.poll(0 if self._queue else 100))
                if self._monitor in events:
                    self._log_monitor()
                if self._socket in events:
                    self._receive_all()
                    if self._queue and self.limits.batch_wait_s > 0:
                        time.sleep(self.limits.batch_wait_s)  # let concurrent clients' requests join the batch
                        self._receive_all()
                if self._queue:
                    self._run_batch()
                else:
                    self.scorer.heartbeat()
        finally:
            self.close()

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._context.term()

    def _log_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # Normal when a client exits; it is also how libzmq drops a message over --max-message-bytes.
                logger.info("a client connection closed (client exit, or a message over the size limit was dropped)")
            else:
                logger.warning("rejected a connection that does not speak ZeroMQ (handshake failed)")

    def _receive_all(self) -> None:
        while self._socket.poll(0):
            frames = self._socket.recv_multipart(copy=True)
            self._handle(frames)

    def _reply(self, identity: bytes, body: bytes) -> None:
        self._socket.send_multipart([identity, body], copy=False)

    def _error(self, identity: bytes, request_id: int, code: wire.ErrorCode, message: str) -> None:
        logger.warning("request %d refused: %s", request_id, message)
        self._reply(identity, wire.encode_error(request_id, code, message))

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._error(identity, 0, wire.ErrorCode.BAD_REQUEST, f"expected one message frame, got {len(frames) - 1}")
            return
        try:
            message = wire.decode(frames[1], self.limits.max_message_bytes)
        except wire.VersionError as err:
            self._error(identity, err.request_id or 0, wire.ErrorCode.VERSION, f"{err}; upgrade the older side")
            return
        except wire.WireError as err:
            self._error(identity, err.request_id or 0, wire.ErrorCode.BAD_REQUEST, f"malformed request: {err}")
            return
        if isinstance(message, wire.Ping):
            self._reply(identity, wire.encode_pong(message.request_id))
            return
        if not isinstance(message, (wire.Hello, wire.Score)):
            self._error(
                identity,
                message.request_id,
                wire.ErrorCode.BAD_REQUEST,
                f"a client cannot send {type(message).__name__}",
            )
            return
        if self.token is not None and not hmac.compare_digest(message.token, self.token):
            self._error(
                identity,
                message.request_id,
                wire.ErrorCode.UNAUTHORIZED,
                "wrong or missing token: teacher.token_file must hold the token of the server's --token-file",
            )
            return
        if isinstance(message, wire.Hello):
            self._reply(identity, wire.encode_info(message.request_id, self._info_json[message.with_tokenizer]))
            return
        problem = self._check(message.request)
        if problem is not None:
            self._error(identity, message.request_id, *problem)
            return
        self.requests += 1
        if self.fault_at_request is not None and self.requests >= self.fault_at_request:
            logger.error("fault injection: exit at score request %d", self.requests)
            self.on_fault()
        self._queue.append(_Pending(identity, message.request_id, message.request))

    def _check(self, request: ScoreRequest) -> tuple[wire.ErrorCode, str] | None:
        """Why this request cannot be scored (None when it can): limits first, then values."""
        lim, vocab = self.limits, self.info.vocab_size
        n, s = request.shape
        r = request.num_requested
        if request.vocabulary != self.info.vocab_fingerprint:
            return wire.ErrorCode.BAD_REQUEST, (
                f"the request's ids are of vocabulary {request.vocabulary[:12]}, this teacher's is "
                f"{self.info.vocab_fingerprint[:12]} ({self.info.model}): tokenize with the teacher's tokenizer "
                "(teacher.tokenizer; loss.cross_tokenizer for a teacher with another one)"
            )
        if request.transfer == "hidden":
            h = self.info.extra.get("hidden_size")
            if h is None:
                return wire.ErrorCode.BAD_REQUEST, "this server does not send hidden states (teacher.transfer=hidden)"
            if wire.hidden_size(n, s, h, request.wire_dtype) > lim.max_message_bytes:
                return wire.ErrorCode.LIMIT, f"the reply would exceed --max-message-bytes={lim.max_message_bytes}"
        elif request.k > min(lim.max_topk, vocab):
            return wire.ErrorCode.LIMIT, f"k={request.k} exceeds the server's --topk={lim.max_topk} ({vocab} tokens)"
        if s > lim.max_seq_len:
            return wire.ErrorCode.LIMIT, f"{s} positions exceed the teacher's context of {lim.max_seq_len}"
        if n * s > lim.max_batch_tokens:
            return wire.ErrorCode.LIMIT, f"N*S={n * s} positions exceed --max-batch-tokens={lim.max_batch_tokens}"
        if r > lim.max_requested:
            return wire.ErrorCode.LIMIT, f"{r} requested ids per position exceed the server's {lim.max_requested}"
        if (
            request.transfer == "topk"
            and wire.scores_size(n, s, request.k, r, request.wire_dtype) > lim.max_message_bytes
        ):
            return wire.ErrorCode.LIMIT, f"the reply would exceed --max-message-bytes={lim.max_message_bytes}"
        if not (math.isfinite(request.temperature) and request.temperature > 0):
            return wire.ErrorCode.BAD_REQUEST, f"temperature must be finite and > 0, got {request.temperature}"
        for name, ids in (("tokens", request.tokens), ("request_ids", request.request_ids)):
            if ids is None:
                continue
            bad = (ids < 0) | (ids >= vocab)
            if bool(bad.any()):
                where = tuple(int(i) for i in bad.nonzero()[0])
                return wire.ErrorCode.BAD_REQUEST, (
                    f"{name}{list(where)} = {int(ids[where])} is not an id of the teacher's {vocab}-token vocabulary"
                )
        return None

    # ---- batching --------------------------------------------------------------------------------------------

    def _take_batch(self) -> list[_Pending]:
        """The oldest request and every queued one with its transfer and temperature that fits the token budget."""
        first = self._queue.popleft()
        batch, rows, width = [first], first.request.shape[0], first.request.shape[1]
        real = rows * width  # positions with packing: each request's rows at their own width
        rest: deque[_Pending] = deque()
        while self._queue:
            p = self._queue.popleft()
            n, s = p.request.shape
            cost = real + n * s if self.scorer.packing else (rows + n) * max(width, s)
            alike = p.request.transfer == first.request.transfer and p.request.temperature == first.request.temperature
            if alike and cost <= self.limits.max_batch_tokens:
                batch.append(p)
                rows, width, real = rows + n, max(width, s), real + n * s
            else:
                rest.append(p)
        self._queue = rest
        return batch

    def _run_batch(self) -> None:
        batch = self._take_batch()
        rows = sum(p.request.shape[0] for p in batch)
        width = max(p.request.shape[1] for p in batch)
        k = max(p.request.k for p in batch)
        r = max(p.request.num_requested for p in batch)
        tokens = torch.zeros(rows, width, dtype=torch.int64)
        lengths = [p.request.shape[1] for p in batch for _ in range(p.request.shape[0])]
        request_ids = torch.zeros(rows, width, r, dtype=torch.int64) if r else None
        lo = 0
        for p in batch:
            n, s = p.request.shape
            tokens[lo : lo + n, :s] = p.request.tokens
            if p.request.request_ids is not None:
                request_ids[lo : lo + n, :s, : p.request.num_requested] = p.request.request_ids  # type: ignore[index]
            lo += n
        t0 = time.perf_counter()
        transfer = batch[0].request.transfer
        try:
            scores = self.scorer.score(tokens, request_ids, k, batch[0].request.temperature, lengths, transfer)
        except Exception as err:
            for p in batch:
                self._error(p.identity, p.request_id, wire.ErrorCode.INTERNAL, f"scoring failed: {err}")
            raise
        logger.debug(
            "scored %d requests, %d x %d positions, k=%d in %.3f s",
            len(batch),
            rows,
            width,
            k,
            time.perf_counter() - t0,
        )
        lo = 0
        for p in batch:
            n, s = p.request.shape
            if transfer == "hidden":
                reply = ScoreReply(hidden=scores.dense_hidden[lo : lo + n, :s])  # type: ignore[index]
                self.answered += 1  # before the reply: a client that has its answer sees it counted
                self._reply(p.identity, wire.encode_hidden(p.request_id, reply, p.request.wire_dtype))
                lo += n
                continue
            pr = p.request.num_requested
            requested = None
            if pr:
                requested = scores.requested_logprobs[lo : lo + n, :s, :pr]  # type: ignore[index]
            reply = ScoreReply(
                scores.topk_ids[lo : lo + n, :s, : p.request.k],  # type: ignore[index]
                scores.topk_logprobs[lo : lo + n, :s, : p.request.k],  # type: ignore[index]
                requested,
            )
            self.answered += 1
            self._reply(p.identity, wire.encode_scores(p.request_id, reply, p.request.wire_dtype))
            lo += n
