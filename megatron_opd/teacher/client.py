"""The one fault-tolerant client for remote teachers: futures, splitting, fan-out, timeouts, retries, validation.

``TeacherClient.score(tokens, request_ids)`` returns a ``Future`` at once (so a scheduler can overlap it with other
work). The batch is split by rows into pieces that fit the server's limits (``--max-batch-tokens``, message size)
and at least one per live replica; a small thread pool sends them. Each piece:

- goes to the next live replica (round robin); a replica that times out, drops the connection or sends an invalid
  reply is marked dead for an exponential back-off (``backoff_s * 2**(failures-1)``, at most ``backoff_max_s``) and
  the piece is retried at once on another live replica, or after the back-off when none is left;
- uses a fresh connection after any failure (a ZeroMQ socket that timed out is never reused), re-checked with a
  hello: limits, and the vocabulary fingerprint the start-up check accepted (a restarted server must serve the
  same vocabulary);
- fails at once when the server's connection closes while it waits (a killed server), and, on a fresh connection
  to a server that accepts none (down or restarting), gives up within ``PROBE_S`` while another replica is up, or
  waits up to ``timeout_s`` for the restart when none is: ``timeout_s`` is for servers that are alive but slow;
- is validated before it is accepted (shapes equal the request's, ids in range and distinct, log-probabilities
  finite, <= 0 and sorted);
- after ``retries`` failed retries raises ``TeacherUnavailableError`` naming the servers, the batch and the rows:
  no batch is ever silently dropped, and each piece's result is taken exactly once.

A request the server refuses (wrong token, protocol version, invalid request) raises at once: retrying cannot help.
The transport is pluggable (``transport_factory``): the ZeroMQ one talks to ``megatron_opd.teacher.serve``, the
HTTP one (:mod:`megatron_opd.teacher.vllm_transport`) to vLLM's OpenAI-compatible server.

Shape legend: ``N`` sequences, ``S`` positions, ``K`` top-k, ``R`` requested ids per position.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron_opd.interfaces import TeacherScores
from megatron_opd.server_wait import StartupWait
from megatron_opd.teacher import wire
from megatron_opd.teacher.transport import (
    WIRE_DTYPES,
    RequestRefusedError,
    ScoreReply,
    ScoreRequest,
    ServerInfo,
    TeacherUnavailableError,
    Transport,
    TransportError,
    TransportFactory,
)
from megatron_opd.teacher.vocabulary import RemoteTokenizer, fingerprint

logger = logging.getLogger(__name__)

LOGPROB_TOLERANCE = 1e-4
"""Slack for ``log-prob <= 0`` and sortedness checks (rounding in the server's dtype)."""

PROBE_S = 1.0
"""How long a fresh connection to a replica that accepts none is waited for while another replica is up; also the
step of the start-up wait."""


@dataclass
class _Piece:
    """Rows ``lo:hi`` of batch ``batch`` and their request."""

    batch: int
    lo: int
    hi: int
    total_rows: int
    request: ScoreRequest

    def describe(self) -> str:
        s = self.request.shape[1]
        return f"batch {self.batch} (rows {self.lo}..{self.hi - 1} of {self.total_rows}, {s} positions)"


def check_reply(request: ScoreRequest, reply: ScoreReply, vocab_size: int, hidden_size: int | None = None) -> None:
    """Raise ``ValueError`` unless ``reply`` answers ``request``: shapes, id range and uniqueness, log-prob values
    (hidden states: shape ``[N, S, hidden_size]`` and finite)."""
    n, s = request.shape
    if request.transfer == "hidden":
        if reply.hidden is None or tuple(reply.hidden.shape) != (n, s, hidden_size):
            got = None if reply.hidden is None else tuple(reply.hidden.shape)
            raise ValueError(f"hidden has shape {got}, the request needs {(n, s, hidden_size)}")
        if not bool(torch.isfinite(reply.hidden.float()).all()):
            raise ValueError("hidden holds NaN or infinite values")
        return
    k, r = request.k, request.num_requested
    if tuple(reply.topk_ids.shape) != (n, s, k):
        raise ValueError(f"topk_ids has shape {tuple(reply.topk_ids.shape)}, the request needs {(n, s, k)}")
    if tuple(reply.topk_logprobs.shape) != (n, s, k):
        raise ValueError(f"topk_logprobs has shape {tuple(reply.topk_logprobs.shape)}, the request needs {(n, s, k)}")
    if r == 0 and reply.requested_logprobs is not None and reply.requested_logprobs.numel():
        raise ValueError("requested_logprobs were sent but none were requested")
    if r and (reply.requested_logprobs is None or tuple(reply.requested_logprobs.shape) != (n, s, r)):
        got = None if reply.requested_logprobs is None else tuple(reply.requested_logprobs.shape)
        raise ValueError(f"requested_logprobs has shape {got}, the request needs {(n, s, r)}")
    ids = reply.topk_ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"top-k ids outside the teacher's vocabulary [0, {vocab_size}): {int(ids.min())}..{int(ids.max())}"
        )
    if k > 1 and bool((ids.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("a position's top-k ids repeat an id")
    for name in ("topk_logprobs", "requested_logprobs"):
        values = getattr(reply, name)
        if values is None or not values.numel():
            continue
        values = values.float()
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{name} holds NaN or infinite values")
        if float(values.max()) > LOGPROB_TOLERANCE:
            raise ValueError(f"{name} holds positive log-probabilities (max {float(values.max()):.3g})")
    if k > 1 and bool((reply.topk_logprobs.float().diff(dim=-1) > LOGPROB_TOLERANCE).any()):
        raise ValueError("topk_logprobs are not sorted, most probable first")


def _rows_per_piece(
    info: ServerInfo, s: int, k: int, r: int, wire_dtype: str, own_max_bytes: int, hidden_size: int | None = None
) -> int:
    """Most rows one request may carry under the server's token and message limits and the client's own
    (``hidden_size``: the replies are hidden states)."""
    by_tokens = info.max_batch_tokens // s

    def reply_size(n: int) -> int:
        if hidden_size is not None:
            return wire.hidden_size(n, s, hidden_size, wire_dtype)
        return wire.scores_size(n, s, k, r, wire_dtype)

    reply_row = reply_size(1) - reply_size(0)
    request_row = wire.score_size(1, s, r, b"") - wire.score_size(0, s, r, b"")
    header = wire.score_size(0, s, r, b"x" * wire.MAX_TOKEN_BYTES) + reply_size(0)
    by_reply = (min(info.max_message_bytes, own_max_bytes) - header) // reply_row
    by_request = (info.max_message_bytes - header) // request_row
    return min(by_tokens, by_reply, by_request)


class TeacherClient:
    """``TeacherBackend`` over one or more teacher-server replicas: their top-k, or with ``transfer="hidden"`` their
    final hidden states (``supports_dense``: the trainer forms the logits with the teacher's output layer)."""

    def __init__(
        self,
        addresses: list[str],
        transport_factory: TransportFactory,
        *,
        topk: int,
        temperature: float = 1.0,
        wire_dtype: str = "fp32",
        timeout_s: float = 300.0,
        retries: int = 8,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        connect_timeout_s: float = 600.0,
        max_in_flight: int | None = None,
        max_message_bytes: int = 256 << 20,
        expected_fingerprint: str | None = None,
        transfer: str = "topk",
    ) -> None:
        if not addresses:
            raise ValueError("teacher.address: give at least one host:port")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"teacher.wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
        if transfer not in ("topk", "hidden"):
            raise ValueError(f"teacher.transfer must be topk or hidden, got {transfer!r}")
        self.transfer = transfer
        self.supports_dense = transfer == "hidden"
        """Hidden states let the loss form the teacher's logits (``loss.mode=dense``); top-k does not."""
        self.addresses = list(dict.fromkeys(addresses))
        self.factory = transport_factory
        self.supports_requested_logprobs: bool = getattr(transport_factory, "supports_requested_logprobs", True)
        """Whether the servers score requested ids (the student's top-k of ``loss.support=union``)."""
        self.topk, self.temperature, self.wire_dtype = topk, temperature, wire_dtype
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.backoff_max_s, self.connect_timeout_s = backoff_s, backoff_max_s, connect_timeout_s
        self.max_message_bytes = max_message_bytes
        self._fingerprint = expected_fingerprint
        self._info: ServerInfo | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=max_in_flight or 2 * len(self.addresses), thread_name_prefix="teacher-client"
        )
        self._lock = threading.Lock()
        self._local = threading.local()
        self._open: list[Transport] = []
        self._failures = dict.fromkeys(self.addresses, 0)
        self._dead_until = dict.fromkeys(self.addresses, 0.0)
        self._round_robin = itertools.count()
        self._batches = itertools.count()
        self.stats = {"requests": 0, "retries": 0, "reconnects": 0}
        """Pieces answered, attempts retried, and connections replaced (for logs and tests)."""

    # ---- connections ---------------------------------------------------------------------------------------

    def _verify(self, address: str, info: ServerInfo) -> None:
        """Pin every replica to one vocabulary and check the request fits its limits."""
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = info.vocab_fingerprint
            expected = self._fingerprint
        if self.transfer == "hidden" and not isinstance(info.extra.get("hidden_size"), int):
            why = info.extra.get("no_hidden")
            fix = (
                "use teacher.transfer=topk"
                if why
                else ("serve the teacher with this version's megatron_opd.teacher.serve, or use teacher.transfer=topk")
            )
            raise RequestRefusedError(
                f"teacher server {address} does not send hidden states"
                f"{f' ({why})' if why else ''}, which teacher.transfer=hidden needs; {fix}"
            )
        if info.vocab_fingerprint != expected:
            raise RequestRefusedError(
                f"teacher server {address} serves a different vocabulary (fingerprint {info.vocab_fingerprint[:12]}) "
                f"than the one checked at start-up ({expected[:12]}); every replica in teacher.address must serve the "
                "same teacher"
            )
        if self.topk > min(info.max_topk, info.vocab_size):
            raise RequestRefusedError(
                f"loss.topk={self.topk} exceeds what teacher server {address} allows (--topk={info.max_topk}, "
                f"{info.vocab_size} tokens); lower loss.topk or restart the server with a larger --topk"
            )
        with self._lock:
            if self._info is None:
                self._info = info

    def _transport(self, address: str, wait_s: float | None = None, hello_timeout_s: float | None = None) -> Transport:
        """This thread's verified connection to ``address`` (a fresh one after a failure); a fresh one waits up to
        ``wait_s`` (default ``timeout_s``) for the server to accept it, then ``hello_timeout_s`` for the hello."""
        cache = self._local.__dict__.setdefault("transports", {})
        if address in cache:
            closed = getattr(cache[address], "closed_while_idle", None)
            if closed is None or not closed():
                return cache[address]
            # This thread's connection to a replica that restarted since its last request: a fresh one, no back-off
            # (otherwise each worker's stale connection kept a restarted replica out for a back-off).
            self._drop(address)
        transport = self.factory(address)
        with self._lock:
            self._open.append(transport)
        try:
            self._await_connection(transport, self.timeout_s if wait_s is None else wait_s)
            hello = transport.hello(with_tokenizer=False, timeout_s=hello_timeout_s or self.timeout_s)
            self._verify(address, hello)
        except BaseException:
            self._discard(transport)
            raise
        cache[address] = transport
        return transport

    def _await_connection(self, transport: Transport, wait_s: float) -> None:
        """Wait until ``transport``'s server accepts the connection (transports that connect lazily return at once).

        A server that is down or restarting accepts none: while another replica is up (its last request succeeded)
        this gives up after ``PROBE_S``, so the request moves there; when none is, it waits for the restart."""
        wait = getattr(transport, "wait_connected", None)
        if wait is None:
            return
        deadline = time.monotonic() + wait_s
        while not wait(min(PROBE_S, max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline or self._other_up(transport.address):
                raise TransportError(
                    f"teacher server {transport.address} accepts no connection (not running, or restarting)"
                )

    def _other_up(self, address: str) -> bool:
        with self._lock:
            return any(a != address and self._failures[a] == 0 for a in self.addresses)

    def _discard(self, transport: Transport) -> None:
        transport.close()
        with self._lock:
            if transport in self._open:
                self._open.remove(transport)

    def _drop(self, address: str) -> None:
        cache = self._local.__dict__.setdefault("transports", {})
        if address in cache:
            self._discard(cache.pop(address))
            with self._lock:
                self.stats["reconnects"] += 1

    def _mark_dead(self, address: str) -> float:
        with self._lock:
            self._failures[address] += 1
            wait = min(self.backoff_s * 2 ** (self._failures[address] - 1), self.backoff_max_s)
            self._dead_until[address] = time.monotonic() + wait
            return wait

    def _mark_alive(self, address: str) -> None:
        with self._lock:
            self._failures[address] = 0
            self._dead_until[address] = 0.0

    def _pick(self, avoid: str | None) -> str:
        """The next live replica (not ``avoid`` if another is live); waits out the shortest back-off if none is."""
        while True:
            with self._lock:
                now = time.monotonic()
                live = [a for a in self.addresses if self._dead_until[a] <= now]
                if len(live) > 1 and avoid in live:
                    live.remove(avoid)
                if live:
                    return live[next(self._round_robin) % len(live)]
                wait = min(self._dead_until.values()) - now
            time.sleep(max(wait, 0.0))

    def connect(self) -> ServerInfo:
        """Wait (up to ``connect_timeout_s``, logging progress) until a replica answers a hello; returns its limits."""
        if self._info is not None:
            return self._info
        waiting = StartupWait(
            f"teacher server at {','.join(self.addresses)}", self.connect_timeout_s, "teacher.connect_timeout_s"
        )
        errors: dict[str, str] = {}
        while True:
            for address in self.addresses:
                try:
                    left = max(waiting.remaining(), 0.1)
                    self._transport(address, wait_s=min(PROBE_S, left), hello_timeout_s=min(self.timeout_s, left))
                    self._mark_alive(address)
                    return self._info  # type: ignore[return-value]
                except TransportError as err:
                    errors[address] = str(err)
                    self._mark_dead(address)
            waiting.progress("; ".join(errors.values()))
            if waiting.expired():
                raise TeacherUnavailableError(
                    f"no teacher server answered within teacher.connect_timeout_s={self.connect_timeout_s:g} s: "
                    + "; ".join(f"{a}: {e}" for a, e in errors.items())
                    + " (check teacher.address and that the server is running)"
                )
            waiting.sleep(self.backoff_s)

    def vocabulary(self) -> tuple[RemoteTokenizer, ServerInfo]:
        """The server's tokenizer (for the vocabulary check) from the first replica that answers; pins its fingerprint."""
        self.connect()
        last: Exception | None = None
        for address in self.addresses:
            transport = self.factory(address)
            try:
                self._await_connection(transport, PROBE_S)  # a replica that is down is skipped, not waited for
                info = transport.hello(with_tokenizer=True, timeout_s=self.timeout_s)
            except TransportError as err:
                last = err
                continue
            finally:
                transport.close()
            if info.tokenizer is None:
                raise RequestRefusedError(f"teacher server {address} sent no tokenizer summary")
            if fingerprint(info.tokenizer) != info.vocab_fingerprint:
                raise RequestRefusedError(
                    f"teacher server {address}: the tokenizer summary does not match its fingerprint"
                )
            self._verify(address, info)
            try:
                return RemoteTokenizer(info.tokenizer, f"teacher server {address}"), info
            except ValueError as err:
                raise RequestRefusedError(str(err)) from None
        raise TeacherUnavailableError(f"no teacher server sent its tokenizer: {last}")

    @property
    def hidden_size(self) -> int | None:
        """With ``transfer="hidden"``: the servers' hidden size (once connected); None for top-k."""
        if self.transfer != "hidden" or self._info is None:
            return None
        return self._info.extra["hidden_size"]

    # ---- scoring -------------------------------------------------------------------------------------------

    def score(
        self, tokens: torch.Tensor, request_ids: torch.Tensor | None = None, lengths: list[int] | None = None
    ) -> Future[TeacherScores]:
        """Score ``tokens`` ``[N, S]`` (and log-probs at ``request_ids`` ``[N, S, R]``); a future of the scores.

        With ``lengths`` (each row's real tokens) the rows are sorted by length and each request is cut to its
        longest row, so the padding sent and scored is what similar lengths leave (a packing server then skips
        the rest); the scores come back in the caller's order, ``[N, S, ...]``."""
        if tokens.dim() != 2 or tokens.dtype.is_floating_point:
            raise ValueError(f"tokens must be an integer [N, S] tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        n, s = tokens.shape
        if request_ids is not None and (request_ids.dim() != 3 or tuple(request_ids.shape[:2]) != (n, s)):
            raise ValueError(f"request_ids must be [N, S, R] = [{n}, {s}, R], got {tuple(request_ids.shape)}")
        if request_ids is not None and request_ids.shape[-1] == 0:
            request_ids = None
        if lengths is not None and (len(lengths) != n or not all(1 <= length <= s for length in lengths)):
            raise ValueError(f"lengths must hold {n} values in 1..{s}, got {list(lengths)[:8]}")
        order = None
        if lengths is not None:  # longest first, so each request's rows have similar lengths
            order = torch.tensor(sorted(range(n), key=lambda i: -lengths[i]))
            tokens, lengths = tokens[order], [lengths[i] for i in order.tolist()]
            request_ids = None if request_ids is None else request_ids[order]
        batch = next(self._batches)
        outer: Future[TeacherScores] = Future()
        if n == 0 or s == 0:
            outer.set_exception(ValueError(f"batch {batch} is empty ({n} sequences of {s} positions)"))
            return outer
        try:
            pieces = self._split(batch, tokens.cpu(), None if request_ids is None else request_ids.cpu(), lengths)
        except Exception as err:  # noqa: BLE001 - surfaced through the future like every other failure
            outer.set_exception(err)
            return outer
        parts: list[ScoreReply | None] = [None] * len(pieces)
        left = [len(pieces)]
        guard = threading.Lock()

        def finished(i: int, future: Future) -> None:
            with guard:
                if outer.done():
                    return
                if future.cancelled():
                    outer.set_exception(TeacherUnavailableError(f"batch {batch}: the teacher client was closed"))
                    return
                if future.exception() is not None:
                    outer.set_exception(future.exception())
                    return
                parts[i] = future.result()
                left[0] -= 1
                if left[0] == 0:
                    outer.set_result(_concat(parts, s, order))  # type: ignore[arg-type]

        for i, piece in enumerate(pieces):
            self._pool.submit(self._score_piece, piece).add_done_callback(lambda f, i=i: finished(i, f))
        return outer

    def _split(
        self, batch: int, tokens: torch.Tensor, request_ids: torch.Tensor | None, lengths: list[int] | None
    ) -> list[_Piece]:
        info = self.connect()
        n, s = tokens.shape
        s = s if lengths is None else max(lengths)  # what is sent: each piece is cut to its longest row
        r = 0 if request_ids is None else int(request_ids.shape[-1])
        if s > info.max_seq_len:
            raise ValueError(
                f"batch {batch}: {s} positions exceed the teacher server's context of {info.max_seq_len} (with "
                "teacher.prompt_template, the teacher's own prompt counts): lower rollout.max_new_tokens or "
                "train.max_seq_len, or shorten the prompts"
            )
        if r > info.max_requested:
            raise ValueError(
                f"batch {batch}: {r} requested ids per position exceed the {info.max_requested} of teacher "
                f"{info.model or self.addresses[0]} (a vLLM teacher scores only the token each position predicts)"
            )
        if r and self.transfer == "hidden":
            raise ValueError(
                f"batch {batch}: teacher.transfer=hidden takes no requested ids (the loss forms the logits)"
            )
        rows = _rows_per_piece(info, s, self.topk, r, self.wire_dtype, self.max_message_bytes, self.hidden_size)
        if rows < 1:
            raise ValueError(
                f"batch {batch}: one sequence of {s} positions does not fit the teacher server's limits "
                f"(--max-batch-tokens={info.max_batch_tokens}, --max-message-bytes={info.max_message_bytes}) or "
                f"teacher.max_message_bytes={self.max_message_bytes}; raise them"
            )
        count = max(math.ceil(n / rows), min(n, len(self.addresses)))
        bounds = [round(i * n / count) for i in range(count + 1)]
        pieces = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            w = s if lengths is None else max(lengths[lo:hi])  # the piece's longest row
            ids = None if request_ids is None else request_ids[lo:hi, :w]
            request = ScoreRequest(tokens[lo:hi, :w], self.topk, self.temperature, ids, self.wire_dtype, self.transfer,
                                   vocabulary=self._fingerprint or "")  # fmt: skip
            pieces.append(_Piece(batch, lo, hi, n, request))
        return pieces

    def _score_piece(self, piece: _Piece) -> ScoreReply:
        errors: list[str] = []
        address: str | None = None
        for attempt in range(self.retries + 1):
            address = self._pick(avoid=address)
            try:
                transport = self._transport(address)
                reply = transport.score(piece.request, self.timeout_s)
                try:
                    check_reply(piece.request, reply, self._info.vocab_size, self.hidden_size)  # type: ignore[union-attr]
                except ValueError as err:
                    raise TransportError(f"teacher server {address} sent an invalid reply: {err}") from None
            except RequestRefusedError as err:
                self._drop(address)
                raise RequestRefusedError(f"{err} ({piece.describe()})") from None
            except TransportError as err:
                self._drop(address)
                wait = self._mark_dead(address)
                errors.append(str(err))
                with self._lock:
                    self.stats["retries"] += 1
                if attempt < self.retries:
                    logger.warning("%s: %s; retrying (back-off %.1f s for that server)", piece.describe(), err, wait)
                continue
            self._mark_alive(address)
            with self._lock:
                self.stats["requests"] += 1
            return reply
        raise TeacherUnavailableError(
            f"teacher {piece.describe()} was not scored after {self.retries + 1} attempts on "
            f"{', '.join(self.addresses)}; last errors: {' | '.join(errors[-3:])}"
        )

    def close(self) -> None:
        """Stop the workers, close every connection, then the transport factory (idempotent)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            transports, self._open = self._open, []
        for transport in transports:
            transport.close()
        close_factory = getattr(self.factory, "close", None)
        if close_factory is not None:
            close_factory()


def _concat(parts: list[ScoreReply], seq_len: int, order: torch.Tensor | None) -> TeacherScores:
    """Pieces in row order -> one ``TeacherScores`` ``[N, seq_len, ...]`` (int64 ids, float32 log-probabilities).

    A piece cut to its longest row is widened by repeating its last position (valid scores of padding that nothing
    trains); rows sorted by ``order`` go back to the caller's order."""

    def cat(values: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        widened = [v[:, torch.arange(seq_len).clamp(max=v.shape[1] - 1)] for v in values]
        out = torch.cat(widened, dim=0).to(dtype)
        return out if order is None else out[torch.argsort(order)]

    if parts[0].hidden is not None:
        return TeacherScores(dense_hidden=cat([p.hidden for p in parts], torch.float32))  # type: ignore[misc]
    requested = None
    if parts[0].requested_logprobs is not None:
        requested = cat([p.requested_logprobs for p in parts], torch.float32)  # type: ignore[misc]
    return TeacherScores(
        topk_ids=cat([p.topk_ids for p in parts], torch.int64),
        topk_logprobs=cat([p.topk_logprobs for p in parts], torch.float32),
        requested_logprobs=requested,
    )
