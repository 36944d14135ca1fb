"""The fault-tolerant teacher client against the real server front end (in a thread, with a toy scorer).

Faults are triggered by request counts (``fault_at_request``), never by timers: a server dies on its N-th request
and is restarted on the same port; a replica dies and its requests move to the other; servers that never answer
or answer garbage; random bytes and bad requests sent to a serving server; wrong tokens and vocabularies.
The real Megatron server (a job of ranks) is tested in ``test_teacher_server.py``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future

import pytest
import torch
import zmq

from megatron_opd import server_wait
from megatron_opd.interfaces import TeacherScores
from megatron_opd.teacher import wire
from megatron_opd.teacher.client import TeacherClient
from megatron_opd.teacher.server import ServerLimits
from megatron_opd.teacher.transport import RequestRefusedError, ScoreReply, ScoreRequest, TeacherUnavailableError
from megatron_opd.teacher.vocabulary import fingerprint
from megatron_opd.teacher.zmq_transport import ZmqTransport, ZmqTransportFactory
from megatron_opd.testing.multiprocess import find_free_port, run_distributed
from megatron_opd.testing.teacher_fakes import (
    RawServer,
    ThreadServer,
    ToyScorer,
    ToyServerProcess,
    toy_server_info,
    toy_tokenizer_summary,
)

VOCAB = 50


_CLIENTS: list[TeacherClient] = []


@pytest.fixture
def servers():
    """Servers started by a test, stopped after it (with every client it made, also when it fails)."""
    started: list = []
    yield started
    while _CLIENTS:
        _CLIENTS.pop().close()
    for server in started:
        server.stop()


def _client(addresses, token: bytes = b"", max_message_bytes: int = 1 << 20, **kwargs) -> TeacherClient:
    options = dict(topk=8, timeout_s=2.0, retries=3, backoff_s=0.05, connect_timeout_s=5.0)
    options.update(kwargs)
    factory = ZmqTransportFactory(token=token, max_message_bytes=max_message_bytes)
    _CLIENTS.append(TeacherClient(list(addresses), factory, max_message_bytes=max_message_bytes, **options))
    return _CLIENTS[-1]


def _batch(seed: int, n: int = 4, s: int = 10):
    tokens = torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.roll(tokens, -1, dims=1).unsqueeze(-1)


def _assert_matches(scores, scorer: ToyScorer, tokens, request_ids, k: int, temperature: float, atol: float = 1e-6):
    ref = scorer.logprobs(tokens, temperature)
    ref_values, ref_ids = ref.topk(k, dim=-1)
    assert scores.topk_ids.dtype == torch.int64 and scores.topk_logprobs.dtype == torch.float32
    assert torch.equal(scores.topk_ids, ref_ids)
    torch.testing.assert_close(scores.topk_logprobs.double(), ref_values, atol=atol, rtol=1e-6)
    torch.testing.assert_close(scores.requested_logprobs.double(), ref.gather(-1, request_ids), atol=atol, rtol=1e-6)


class _HeldScorer(ToyScorer):
    """A toy scorer whose first forward after ``armed`` waits for ``release``: what arrives meanwhile queues at the
    server."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release
        self.armed = False
        self.held: bool | None = None  # whether that forward waited until every request was on the wire

    def score(self, *args, **kwargs):
        if self.armed and self.held is None:  # on a saturated machine the wait may time out: answers still checked
            self.held = self.release.wait(30)
        return super().score(*args, **kwargs)


def test_concurrent_clients_are_batched_and_answered_exactly(servers, monkeypatch):
    """4 clients at once, different shapes, k, temperatures and wire dtypes: each gets its own slice back.

    Ordered by events, not a race: each client's one sending thread (``max_in_flight=1``) connects and is answered
    first (the server answers a new connection's hello between forwards, so a held forward must not meet one), then
    the server holds its first forward until all four requests are on the wire, so the other three wait in its queue
    and the same-temperature ones share a forward.
    """
    cases = [(4, 10, 8, 1.0, "fp32"), (3, 17, 16, 1.0, "fp32"), (5, 6, 3, 1.0, "bf16"), (2, 12, 5, 2.0, "fp16")]
    sent, all_sent = [], threading.Event()
    send = ZmqTransport.score

    def counted_send(transport, request, timeout_s):
        sent.append(request)
        if len(sent) == len(cases):  # the last request goes out right after this line
            threading.Timer(0.2, all_sent.set).start()
        return send(transport, request, timeout_s)

    limits = ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=400, batch_wait_s=0.2)
    server = ThreadServer(_HeldScorer(all_sent), limits=limits)
    servers.append(server)
    clients = [
        _client([server.address], topk=k, temperature=t, wire_dtype=dtype, timeout_s=60.0, max_in_flight=1)
        for _, _, k, t, dtype in cases
    ]
    for client in clients:  # each sending thread's own connection, verified before the hold
        client.score(*_batch(99, n=1, s=4)).result(timeout=60)
    warm_up_forwards = server.scorer.batches
    monkeypatch.setattr(ZmqTransport, "score", counted_send)
    server.scorer.armed = True
    results: dict[int, object] = {}

    def one(i: int) -> None:
        n, s = cases[i][:2]
        tokens, request_ids = _batch(i, n, s)
        results[i] = (clients[i].score(tokens, request_ids).result(timeout=60), tokens, request_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert sorted(results) == [0, 1, 2, 3]
    for i, (n, s, k, temperature, dtype) in enumerate(cases):
        scores, tokens, request_ids = results[i]
        assert scores.topk_ids.shape == (n, s, k) and int(scores.topk_ids.max()) < VOCAB  # no padded column
        if dtype == "fp32":
            _assert_matches(scores, server.scorer, tokens, request_ids, k, temperature)
        else:  # ids equal; log-probs within the wire dtype's rounding (relative 2**-8 bf16, 2**-11 fp16)
            ref = server.scorer.logprobs(tokens, temperature)
            values, ids = ref.topk(k, dim=-1)
            assert torch.equal(scores.topk_ids, ids)
            rel = 2**-8 if dtype == "bf16" else 2**-11
            assert ((scores.topk_logprobs.double() - values).abs() <= rel * values.abs() + 1e-6).all()
    # Whatever came first, the queued temperature-1 requests were scored together, in fewer forwards than requests
    # (when all four were on the wire before the first forward ended; CI once saw a client's send late by > 60 s).
    if server.scorer.held:
        assert server.scorer.batches - warm_up_forwards < len(cases), "no dynamic batching happened"


def test_batches_are_split_to_fit_the_server_limits(servers):
    limits = ServerLimits(max_topk=16, max_seq_len=128, max_batch_tokens=64, batch_wait_s=0.0)
    server = ThreadServer(limits=limits)
    servers.append(server)
    client = _client([server.address])
    tokens, request_ids = _batch(0, n=10, s=20)  # 200 positions, 3 rows (60 positions) per request
    scores = client.score(tokens, request_ids).result(timeout=30)
    _assert_matches(scores, server.scorer, tokens, request_ids, 8, 1.0)
    assert client.stats["requests"] == 4
    with pytest.raises(ValueError, match="one sequence of 65 positions does not fit"):
        client.score(*_batch(1, n=1, s=65)).result(timeout=30)
    # Padded past the server's context (a teacher's own, longer prompt padded up): what counts is the real rows.
    wide, wide_ids = _batch(3, n=2, s=136)
    scores = client.score(wide, wide_ids, [30, 12]).result(timeout=30)
    ref = server.scorer.logprobs(wide[:1, :30], 1.0)[0]
    torch.testing.assert_close(scores.topk_logprobs[0, :30].double(), ref.topk(8, dim=-1).values, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="136 positions exceed the teacher server's context of 128"):
        client.score(wide, wide_ids).result(timeout=30)
    client.close()


def test_lengths_cut_each_request_to_its_longest_row_and_scores_come_back_in_order(servers):
    """With each row's length the client sends rows of similar length together, each request only as wide as its
    longest row; the scores return in the caller's order, exact at every real position, valid past it."""
    limits = ServerLimits(max_topk=16, max_seq_len=128, max_batch_tokens=64, batch_wait_s=0.0)
    scorer = ToyScorer()
    scorer.packing = True  # told each row's width: what every request sent, however the server batched them
    server = ThreadServer(scorer, limits=limits)
    servers.append(server)
    client = _client([server.address])
    tokens, request_ids = _batch(2, n=10, s=20)  # 3 rows per request (at 20 positions)
    lengths = [4, 20, 9, 1, 13, 7, 20, 2, 11, 5]
    scores = client.score(tokens, request_ids, lengths).result(timeout=30)
    widths = sorted(width for _, batch_lengths in scorer.seen for width in batch_lengths)
    assert widths == [2, 2, 7, 7, 7, 13, 13, 13, 20, 20]  # rows sorted, then each request cut to its longest
    for row, n in enumerate(lengths):
        ref = server.scorer.logprobs(tokens[row : row + 1, :n], 1.0)[0]
        values, ids = ref.topk(8, dim=-1)
        assert torch.equal(scores.topk_ids[row, :n], ids), row
        torch.testing.assert_close(scores.topk_logprobs[row, :n].double(), values, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(
            scores.requested_logprobs[row, :n].double(), ref.gather(-1, request_ids[row, :n]), atol=1e-6, rtol=1e-6
        )
    assert scores.topk_ids.shape == (10, 20, 8) and torch.isfinite(scores.topk_logprobs).all()
    with pytest.raises(ValueError, match="lengths must hold 10 values in 1..20"):
        client.score(tokens, request_ids, [21] * 10)
    client.close()


def test_hidden_transfer_returns_the_final_hidden_states_split_cut_and_in_order(servers):
    """``transfer="hidden"``: the servers' final hidden states ``[N, S, H]`` (fp32 on the wire: exact), split to the
    reply limits (hidden states are H values a position), cut to each request's longest row, in the caller's order,
    never mixed with top-k requests in one batch; a server without hidden states is refused at connect."""
    limits = ServerLimits(max_topk=16, max_seq_len=128, max_batch_tokens=64, batch_wait_s=0.0)
    server = ThreadServer(ToyScorer(), limits=limits)
    servers.append(server)
    # Replies of at most ~1.2 KB: 2 rows of 20 x 16 fp32 values each; the client splits rows to fit.
    client = _client([server.address], transfer="hidden", max_message_bytes=2600)
    assert client.supports_dense
    tokens, _ = _batch(2, n=7, s=20)
    lengths = [4, 20, 9, 1, 13, 7, 20]
    scores = client.score(tokens, None, lengths).result(timeout=30)
    assert scores.topk_ids is None and scores.dense_hidden.shape == (7, 20, 16)
    for row, n in enumerate(lengths):
        ref = server.scorer.hidden(tokens[row : row + 1, :n])[0].float()
        assert torch.equal(scores.dense_hidden[row, :n], ref), row
    assert client.stats["requests"] >= 4  # the message limit split the batch
    with pytest.raises(ValueError, match="teacher.transfer=hidden takes no requested ids"):
        client.score(tokens, tokens[..., None]).result(timeout=30)
    topk = _client([server.address])  # both kinds from one server, each answered in its own kind
    both = [topk.score(tokens), client.score(tokens)]
    assert both[0].result(timeout=30).topk_ids.shape == (7, 20, 8)
    assert both[1].result(timeout=30).dense_hidden.shape == (7, 20, 16)
    # A server whose scorer has no hidden states (no hidden_size in its info) is refused with the fix.
    plain = ThreadServer(ToyScorer(), limits=limits, hidden_states=False)
    servers.append(plain)
    with pytest.raises(RequestRefusedError, match="does not send hidden states, which teacher.transfer=hidden"):
        _client([plain.address], transfer="hidden").score(tokens).result(timeout=30)


def test_a_packing_scorer_batches_requests_by_their_real_positions():
    """Requests of 2x30 and 6x5 positions: 60 + 30 fit a budget of 90 when packed, not 8 rows x 30 padded."""
    from megatron_opd.teacher.server import TeacherServer, _Pending

    limits = ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=90, batch_wait_s=0.0)
    for packing, batched in ((True, 2), (False, 1)):
        scorer = ToyScorer()
        scorer.packing = packing
        server = TeacherServer(scorer, toy_server_info(scorer, limits), limits=limits)
        try:
            for i, (n, s) in enumerate(((2, 30), (6, 5))):
                request = ScoreRequest(torch.zeros(n, s, dtype=torch.int64), 4, 1.0, None, "fp32")
                server._queue.append(_Pending(b"client", i, request))
            assert len(server._take_batch()) == batched
        finally:
            server.close()


def test_server_killed_and_restarted_answers_every_batch_once(servers):
    server = ThreadServer(fault_at_request=3)  # dies when its 3rd request arrives, before answering it
    port = server.port
    client = _client([server.address], timeout_s=1.0, retries=20, backoff_s=0.05)
    batches = [_batch(i) for i in range(8)]
    futures: list = []
    submitter = threading.Thread(target=lambda: futures.extend(client.score(t, r) for t, r in batches))
    submitter.start()
    server.wait_dead()
    assert server.server.requests == 3
    restarted = ThreadServer(server.scorer, port=port)  # same weights, same port
    servers.append(restarted)
    submitter.join(60)
    for future, (tokens, request_ids) in zip(futures, batches):
        _assert_matches(future.result(timeout=60), server.scorer, tokens, request_ids, 8, 1.0)
    # Those answered before the kill are not sent again; the lost ones are answered after the restart: each once.
    assert len(futures) == 8 and server.server.answered + restarted.server.answered == 8
    assert restarted.server.requests == restarted.server.answered
    assert client.stats["requests"] == 8 and client.stats["retries"] >= 1
    client.close()


def test_dead_replica_is_skipped_and_its_requests_retried_elsewhere(servers):
    scorer = ToyScorer()
    dying = ThreadServer(scorer, fault_at_request=2)
    healthy = ThreadServer(scorer)
    servers.extend([dying, healthy])
    # The default timeout: the in-flight request on the dead replica moves on when its connection closes, not after
    # the timeout, and the other requests go to the live replica at once (its back-off keeps them off the dead one).
    client = _client([dying.address, healthy.address], timeout_s=300.0, retries=4, backoff_s=30.0)
    t0 = time.monotonic()
    for i in range(6):
        tokens, request_ids = _batch(i)  # 4 rows: one piece per replica
        _assert_matches(client.score(tokens, request_ids).result(timeout=60), scorer, tokens, request_ids, 8, 1.0)
    dying.wait_dead()
    assert dying.server.requests == 2 and dying.server.answered + healthy.server.answered == 12
    assert healthy.server.requests == healthy.server.answered
    assert time.monotonic() - t0 < 10, "the client waited on the dead replica"
    client.close()


def test_killed_server_is_noticed_at_once_and_answers_after_its_restart(servers):
    """SIGKILL while a request is in flight, with teacher.timeout_s=300: the client notices within seconds (the TCP
    connection closes), not after the timeout, waits for the restart on the same port, and gets its answer."""
    port = find_free_port()
    slow = ToyServerProcess(port, delay_s=60.0)
    servers.append(slow)
    client = _client([slow.address], timeout_s=300.0, retries=2, backoff_s=0.05)
    tokens, request_ids = _batch(0)
    future = client.score(tokens, request_ids)
    slow.wait_scoring()
    slow.stop()
    killed = time.monotonic()
    while client.stats["retries"] == 0 and time.monotonic() - killed < 30:
        time.sleep(0.01)
    noticed = time.monotonic() - killed
    # Bounds far below the 60 s the server would take, the 300 s timeout and the 30 s wait on the answer: a loaded CI
    # machine stays inside them.
    assert noticed < 20, f"the client noticed the killed server after {noticed:.1f} s"
    servers.append(ToyServerProcess(port))
    restarted = time.monotonic()
    _assert_matches(future.result(timeout=30), ToyScorer(), tokens, request_ids, 8, 1.0)
    assert time.monotonic() - restarted < 20, "the client did not notice the restart within seconds"
    assert client.stats["retries"] == 1 and client.stats["requests"] == 1
    client.close()


def test_replica_restarted_between_requests_is_used_again_without_a_retry(servers):
    """Each worker thread keeps a connection per replica; one restarted while idle is reconnected at its next turn,
    not counted as a failure (that back-off kept a restarted replica out of the last steps of a run)."""
    scorer = ToyScorer()
    restarting, other = ThreadServer(scorer), ThreadServer(scorer)
    servers.extend([restarting, other])
    client = _client([restarting.address, other.address], timeout_s=30.0, retries=4, backoff_s=30.0)
    batches = [_batch(i) for i in range(4)]  # 4 rows: one piece per replica
    for tokens, request_ids in batches:  # every worker thread has connected to both replicas
        client.score(tokens, request_ids).result(timeout=30)
    restarting.stop()
    restarted = ThreadServer(scorer, port=restarting.port)
    servers.append(restarted)
    time.sleep(0.5)  # ZeroMQ reconnects the idle connections in the background
    for tokens, request_ids in batches:
        _assert_matches(client.score(tokens, request_ids).result(timeout=30), scorer, tokens, request_ids, 8, 1.0)
    assert client.stats["retries"] == 0 and client.stats["reconnects"] >= 1
    assert restarted.server.answered == 4, "the restarted replica was kept out"
    client.close()


def test_nobody_listening_stops_start_up_after_connect_timeout_naming_the_address(servers, caplog, monkeypatch):
    """teacher.timeout_s=300 does not stretch the start-up wait; progress is logged while it lasts."""
    monkeypatch.setattr(server_wait, "PROGRESS_EVERY_S", 0.2)
    caplog.set_level(logging.INFO, logger=server_wait.__name__)
    address = f"127.0.0.1:{find_free_port()}"
    client = _client([address], timeout_s=300.0, connect_timeout_s=1.5, backoff_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(TeacherUnavailableError) as info:
        client.connect()
    assert time.monotonic() - t0 < 30  # 1.5 s, not teacher.timeout_s=300 (a loaded machine adds seconds)
    text = str(info.value)
    assert (
        "within teacher.connect_timeout_s=1.5 s" in text and f"{address}: teacher server {address} accepts no" in text
    )
    assert f"waiting for teacher server at {address} (" in caplog.text
    assert "of 1.5 s, teacher.connect_timeout_s)" in caplog.text
    client.close()


def test_start_up_and_scoring_skip_a_replica_that_is_down(servers):
    """A replica listed in teacher.address but not running costs a second at start-up, not teacher.timeout_s."""
    live = ThreadServer()
    servers.append(live)
    down = f"127.0.0.1:{find_free_port()}"
    client = _client([down, live.address], timeout_s=300.0)
    t0 = time.monotonic()
    assert len(client.vocabulary()[0]) == VOCAB
    tokens, request_ids = _batch(0)
    _assert_matches(client.score(tokens, request_ids).result(timeout=30), live.scorer, tokens, request_ids, 8, 1.0)
    assert time.monotonic() - t0 < 10  # about 1 s per look at the down replica: connect, vocabulary, one piece
    client.close()


def _hello_then(score_reply):
    """A raw server that answers hellos properly and score requests with ``score_reply(request_message)``."""
    scorer = ToyScorer()
    info = toy_server_info(scorer, ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=512))

    def respond(body: bytes):
        message = wire.decode(body, 1 << 20)
        if isinstance(message, wire.Hello):
            return wire.encode_info(message.request_id, info.to_dict(message.with_tokenizer))
        server.scores += 1
        return score_reply(message)

    server = RawServer(respond)
    server.scores = 0
    return server


def test_silent_server_gives_the_timeout_error_not_a_hang(servers):
    silent = _hello_then(lambda message: None)
    mute = RawServer(lambda body: None)  # not even a hello
    servers.extend([silent, mute])
    client = _client([silent.address], timeout_s=0.3, retries=2, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(TeacherUnavailableError) as info:
        client.score(*_batch(0, n=3)).result(timeout=30)
    text = str(info.value)
    assert "batch 0 (rows 0..2 of 3, 10 positions)" in text and silent.address in text
    assert "no reply from teacher server" in text and "within 0.3 s" in text
    assert time.monotonic() - t0 < 10 and silent.scores == 3  # the first attempt and 2 retries
    client.close()
    client = _client([mute.address], timeout_s=0.3, connect_timeout_s=1.0)
    with pytest.raises(TeacherUnavailableError, match="no teacher server answered within teacher.connect_timeout_s=1"):
        client.connect()
    client.close()


def _scores(message, reply: ScoreReply, dtype: str = "fp32") -> bytes:
    return wire.encode_scores(message.request_id, reply, dtype)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("garbage", "malformed reply from teacher server"),
        ("truncated", "malformed reply from teacher server"),
        ("wrong_shape", "sent an invalid reply: topk_ids has shape"),
        ("id_out_of_range", "sent an invalid reply: top-k ids outside the teacher's vocabulary [0, 50)"),
        ("nan", "sent an invalid reply: topk_logprobs holds NaN"),
        ("wrong_dtype", "replied in bf16, the request asked fp32"),
        ("oversized", "over the limit of 65536 (teacher.max_message_bytes)"),
    ],
)
def test_malformed_or_oversized_reply_is_rejected(case, expected, servers):
    def reply(message):
        n, s = message.request.shape
        k, r = message.request.k, message.request.num_requested
        ids = torch.arange(k).expand(n, s, k).clone()
        values = -torch.arange(1, k + 1, dtype=torch.float32).expand(n, s, k).clone()
        requested = torch.full((n, s, r), -1.0)
        if case == "garbage":
            return b"\x00" * 40
        if case == "truncated":
            return _scores(message, ScoreReply(ids, values, requested))[:-3]
        if case == "wrong_shape":
            return _scores(message, ScoreReply(ids[:, :-1], values[:, :-1], requested[:, :-1]))
        if case == "id_out_of_range":
            ids[0, 0, 0] = VOCAB
        if case == "nan":
            values[1, 2, 3] = float("nan")
        if case == "oversized":
            return b"x" * 70000
        return _scores(message, ScoreReply(ids, values, requested), "bf16" if case == "wrong_dtype" else "fp32")

    server = _hello_then(reply)
    servers.append(server)
    client = _client([server.address], retries=0, max_message_bytes=65536)
    with pytest.raises(TeacherUnavailableError, match="not scored after 1 attempts") as info:
        client.score(*_batch(0)).result(timeout=30)
    assert expected in str(info.value)
    client.close()


def test_random_bytes_and_bad_requests_leave_the_server_serving(servers):
    limits = ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=512, max_message_bytes=8192, batch_wait_s=0)
    server = ThreadServer(limits=limits)
    servers.append(server)
    host, port = server.address.split(":")
    # Plain TCP junk: not even a ZeroMQ handshake.
    for seed in range(3):
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(seed)).tolist()))
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{server.address}")

    def ask(body: bytes | list[bytes]):
        dealer.send_multipart(body if isinstance(body, list) else [body])
        assert dealer.poll(5000), "the server did not answer"
        return wire.decode(dealer.recv(), 1 << 20)

    tokens, request_ids = _batch(0)
    ours = server.server.info.vocab_fingerprint
    good = wire.encode_score(1, b"", ScoreRequest(tokens, 8, 1.0, request_ids, vocabulary=ours))
    bad_version = good[:4] + (9).to_bytes(2, "little") + good[6:]
    out_of_range = wire.encode_score(3, b"", ScoreRequest(tokens + VOCAB, 8, 1.0, None, vocabulary=ours))
    other_vocabulary = wire.encode_score(7, b"", ScoreRequest(tokens, 8, 1.0, None, vocabulary="0" * 64))
    expectations = [
        (b"random junk that is not a message", wire.ErrorCode.BAD_REQUEST, "malformed request: magic"),
        (good[:-7], wire.ErrorCode.BAD_REQUEST, "malformed request: request_ids"),
        ([good, good], wire.ErrorCode.BAD_REQUEST, "expected one message frame"),
        (bad_version, wire.ErrorCode.VERSION, "protocol version 9"),
        (out_of_range, wire.ErrorCode.BAD_REQUEST, "tokens[0, 0] = "),
        (wire.encode_score(4, b"", ScoreRequest(tokens, 17, 1.0, vocabulary=ours)), wire.ErrorCode.LIMIT, "k=17 exceeds"),
        (wire.encode_score(5, b"", ScoreRequest(tokens, 8, 0.0, vocabulary=ours)), wire.ErrorCode.BAD_REQUEST, "temperature"),
        (other_vocabulary, wire.ErrorCode.BAD_REQUEST, "the request's ids are of vocabulary 000000000000, this teacher's"),
        (wire.encode_scores(6, ScoreReply(tokens[..., None], tokens[..., None].float()), "fp32"),
         wire.ErrorCode.BAD_REQUEST, "a client cannot send Scores"),
    ]  # fmt: skip
    for body, code, text in expectations:
        reply = ask(body)
        assert isinstance(reply, wire.Error) and reply.code == code and text in reply.message, (text, reply)
    # Over --max-message-bytes: libzmq cuts the connection off; no reply, nothing reaches the model.
    dealer.send(b"y" * 10000)
    assert not dealer.poll(500)
    dealer.close(linger=0)
    context.term()
    batches_before = server.scorer.batches
    client = _client([server.address])
    _assert_matches(client.score(tokens, request_ids).result(timeout=30), server.scorer, tokens, request_ids, 8, 1.0)
    assert server.scorer.batches == batches_before + 1 and server.error is None
    client.close()


def test_wrong_token_is_refused(servers):
    server = ThreadServer(token=b"s3cret")
    servers.append(server)
    for token in (b"", b"s3cre", b"s3cret!"):
        client = _client([server.address], token=token)
        with pytest.raises(RequestRefusedError, match="wrong or missing token: teacher.token_file"):
            client.connect()
        client.close()
    client = _client([server.address], token=b"s3cret")
    tokens, request_ids = _batch(0)
    _assert_matches(client.score(tokens, request_ids).result(timeout=30), server.scorer, tokens, request_ids, 8, 1.0)
    client.close()


def test_vocabulary_mismatch_is_refused(servers):
    scorer = ToyScorer()
    same = ThreadServer(scorer)
    other = ThreadServer(scorer, summary=toy_tokenizer_summary(VOCAB, tag="x"))
    servers.extend([same, other])
    checked = fingerprint(toy_tokenizer_summary(VOCAB))
    client = _client([other.address], expected_fingerprint=checked)
    with pytest.raises(RequestRefusedError, match="serves a different vocabulary .* than the one checked at start-up"):
        client.connect()
    client.close()
    # Replicas of different teachers: the second one contacted is refused by name.
    client = _client([same.address, other.address], expected_fingerprint=checked)
    client.connect()
    with pytest.raises(RequestRefusedError, match=f"teacher server {other.address} serves a different vocabulary"):
        client.score(*_batch(0)).result(timeout=30)
    client.close()
    # loss.topk above the server's --topk is refused at connect, naming both.
    client = _client([same.address], topk=17)
    with pytest.raises(RequestRefusedError, match=r"loss.topk=17 exceeds .* \(--topk=16"):
        client.connect()
    client.close()


# ---- the tensor-parallel share of the trainer integration --------------------------------------------------------


class _FixedBackend:
    supports_dense = False

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def score(self, tokens, request_ids=None, lengths=None):
        future = Future()
        if self.fail:
            future.set_exception(TeacherUnavailableError("teacher batch 0 was not scored (test)"))
        else:
            n, s = tokens.shape
            ids = torch.arange(n * s * 3).view(n, s, 3)
            future.set_result(
                TeacherScores(topk_ids=ids, topk_logprobs=-ids.float(), requested_logprobs=-torch.ones(n, s, 1))
            )
        return future


def _shared_body(fail: bool):
    import torch.distributed as dist

    from megatron_opd.teacher.shared import GroupSharedTeacher

    rank = dist.get_rank()
    teacher = GroupSharedTeacher(_FixedBackend(fail) if rank == 0 else None, group=dist.group.WORLD, src=0)
    try:
        scores = teacher.score(torch.zeros(2, 4, dtype=torch.long)).result()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return scores.topk_ids, scores.topk_logprobs, scores.requested_logprobs


def test_group_shared_teacher_broadcasts_scores_and_errors():
    first, second = run_distributed(_shared_body, 2, args=(False,))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert first[0].shape == (2, 4, 3) and first[2].shape == (2, 4, 1)
    errors = run_distributed(_shared_body, 2, args=(True,))
    assert errors[0].startswith("TeacherUnavailableError: teacher batch 0 was not scored")
    assert "the teacher request of rank 0 failed: TeacherUnavailableError: teacher batch 0" in errors[1]


def test_readiness_check(servers):
    from megatron_opd.teacher.transport import TransportError
    from megatron_opd.teacher.zmq_transport import wait_for_server

    server = ThreadServer(token=b"s3cret")  # a health check needs no token
    servers.append(server)
    wait_for_server(server.address, timeout_s=10)
    port = server.port
    server.stop()
    with pytest.raises(TransportError, match=f"127.0.0.1:{port} not ready within 1 s"):
        wait_for_server(f"127.0.0.1:{port}", timeout_s=1, poll_s=0.1)
