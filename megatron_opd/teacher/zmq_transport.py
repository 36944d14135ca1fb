"""ZeroMQ transport to the Megatron teacher server: one DEALER socket per (thread, replica), never reused after a failure.

The server's rank 0 holds a ROUTER socket; each client thread talks to each replica through its own DEALER (ZeroMQ
sockets are not thread-safe). A DEALER carries a request id in every message instead of REQ's strict
send/receive alternation, so a reply that arrives late is recognised and dropped, and a timed-out socket is
simply closed and replaced (``close()``; the client builds a fresh transport for the next attempt).

A transport serves one connection. A socket monitor reports when it is up (ZeroMQ handshake done) and when it closes:
a server that exits or is killed closes its TCP connections at once, so a request in flight fails then, not after
``teacher.timeout_s`` (which is left for servers that are alive but slow); and a connection that closed since the
hello is never used again (DEALER would silently reconnect to whatever now listens on the port, unchecked).
"""

from __future__ import annotations

import logging
import secrets
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_opd.teacher import wire
from megatron_opd.teacher.transport import (
    RequestRefusedError,
    ScoreReply,
    ScoreRequest,
    ServerInfo,
    TransportError,
    parse_address,
)

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def endpoint(host: str, port: int) -> str:
    """The ZeroMQ TCP endpoint of ``host:port`` (IPv6 hosts in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ZmqTransport:
    """One DEALER connection to the teacher server at ``address``."""

    def __init__(self, address: str, *, context: zmq.Context, token: bytes = b"", max_message_bytes: int) -> None:
        self.address = address
        host, port = parse_address(address)
        self._endpoint = endpoint(host, port)
        self._ipv6 = ":" in host
        self._context = context
        self._token = token
        self._max_bytes = max_message_bytes
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._up = False
        """The connection is up (handshake done) and has not closed."""
        self._lost = False
        """A connection was up and closed: whatever was in flight on it is gone."""

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, int(self._ipv6))
            # A backstop for memory; replies between the limit and twice it get a clear error below instead.
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._max_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(self._endpoint)
            self._socket = sock
        return self._socket

    def _read_events(self, timeout_ms: int = 0) -> None:
        """Apply the monitor's pending connection events, waiting up to ``timeout_ms`` for the first."""
        while self._monitor.poll(timeout_ms):  # type: ignore[union-attr]
            event = recv_monitor_message(self._monitor)["event"]  # type: ignore[arg-type]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self._lost:
                self._up = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._up, self._lost = False, True
            timeout_ms = 0

    def closed_while_idle(self) -> bool:
        """Whether the connection closed since it was last used (a server restart): nothing was in flight, so the
        caller opens a fresh one instead of counting a failure."""
        if self._socket is None:
            return False
        self._read_events()
        return self._lost

    def _check_connection(self) -> None:
        self._read_events()
        if self._lost:
            raise TransportError(
                f"the connection to teacher server {self.address} closed (the server exited, was killed or restarted; "
                "or a message exceeded a size limit)"
            )

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether the server accepts the connection (handshake done) within ``timeout_s``; False once it closed."""
        self._connected()
        deadline = time.monotonic() + timeout_s
        self._read_events()
        while not (self._up or self._lost) and (remaining := deadline - time.monotonic()) > 0:
            self._read_events(max(1, int(remaining * 1000)))
        return self._up

    def _roundtrip(self, body: bytes, request_id: int, timeout_s: float) -> wire.Message:
        sock = self._connected()
        self._check_connection()
        deadline = time.monotonic() + timeout_s
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            sock.send(body, copy=False)
        except zmq.Again:
            raise TransportError(f"teacher server {self.address}: could not send within {timeout_s:.1f} s") from None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            ready = dict(poller.poll(max(1, int(remaining * 1000)))) if remaining > 0 else {}
            if not ready:
                raise TransportError(f"no reply from teacher server {self.address} within {timeout_s:.1f} s")
            if sock not in ready:  # a connection event; a closed connection fails the request now
                self._check_connection()
                continue
            frames = sock.recv_multipart(copy=True)
            size = sum(len(f) for f in frames)
            if size > self._max_bytes:
                raise TransportError(
                    f"teacher server {self.address} sent a reply of {size} bytes, over the limit of "
                    f"{self._max_bytes} (teacher.max_message_bytes)"
                )
            if len(frames) != 1:
                raise TransportError(f"malformed reply from teacher server {self.address}: {len(frames)} frames")
            try:
                message = wire.decode(frames[0], self._max_bytes)
            except wire.WireError as err:
                raise TransportError(f"malformed reply from teacher server {self.address}: {err}") from None
            if message.request_id != request_id:
                logger.debug("dropped a stale reply (request id %d) from %s", message.request_id, self.address)
                continue
            if isinstance(message, wire.Error):
                text = f"teacher server {self.address} refused the request: {message.message}"
                if message.code == wire.ErrorCode.INTERNAL:
                    raise TransportError(text)
                raise RequestRefusedError(text)
            return message

    def hello(self, *, with_tokenizer: bool, timeout_s: float) -> ServerInfo:
        request_id = secrets.randbits(63)
        message = self._roundtrip(wire.encode_hello(request_id, self._token, with_tokenizer), request_id, timeout_s)
        if not isinstance(message, wire.Info):
            raise TransportError(f"teacher server {self.address} answered a hello with {type(message).__name__}")
        try:
            return ServerInfo.from_dict(message.info)
        except ValueError as err:
            raise TransportError(f"malformed hello reply from teacher server {self.address}: {err}") from None

    def score(self, request: ScoreRequest, timeout_s: float) -> ScoreReply:
        request_id = secrets.randbits(63)
        message = self._roundtrip(wire.encode_score(request_id, self._token, request), request_id, timeout_s)
        expected = wire.Hidden if request.transfer == "hidden" else wire.Scores
        if not isinstance(message, expected):
            raise TransportError(
                f"teacher server {self.address} answered a {request.transfer} score request with "
                f"{type(message).__name__}"
            )
        if message.wire_dtype != request.wire_dtype:
            raise TransportError(
                f"teacher server {self.address} replied in {message.wire_dtype}, the request asked {request.wire_dtype}"
            )
        return message.reply

    def ping(self, timeout_s: float) -> None:
        """Raise ``TransportError`` unless the server answers a health check within ``timeout_s``."""
        request_id = secrets.randbits(63)
        message = self._roundtrip(wire.encode_ping(request_id), request_id, timeout_s)
        if not isinstance(message, wire.Pong):
            raise TransportError(f"teacher server {self.address} answered a ping with {type(message).__name__}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)  # type: ignore[union-attr]
            self._socket.close(linger=0)
            self._socket = self._monitor = None


class ZmqTransportFactory:
    """Builds ``ZmqTransport`` s sharing one ZeroMQ context (the client calls it once per thread and replica)."""

    def __init__(self, *, token: bytes = b"", max_message_bytes: int = 256 << 20) -> None:
        self.context = zmq.Context()
        self.token = token
        self.max_message_bytes = max_message_bytes

    def __call__(self, address: str) -> ZmqTransport:
        return ZmqTransport(address, context=self.context, token=self.token, max_message_bytes=self.max_message_bytes)

    def close(self) -> None:
        """Terminate the context (every transport must be closed first; the client does that)."""
        if not self.context.closed:
            self.context.term()


def wait_for_server(address: str, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
    """Block until the teacher server at ``address`` answers a health check (for launchers and tests)."""
    factory = ZmqTransportFactory(max_message_bytes=1 << 20)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            transport = factory(address)
            try:
                transport.ping(timeout_s=min(poll_s * 4, max(deadline - time.monotonic(), 0.01)))
                return
            except TransportError as err:
                if time.monotonic() >= deadline:
                    raise TransportError(f"teacher server {address} not ready within {timeout_s:.0f} s") from err
                time.sleep(poll_s)
            finally:
                transport.close()
    finally:
        factory.close()
