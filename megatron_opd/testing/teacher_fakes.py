"""Stand-ins for teacher-server tests: a tiny causal scorer, in-thread servers, and misbehaving servers.

The client's fault handling (time-outs, restarts, dead replicas, bad replies) is tested against the real
``TeacherServer`` front end running in a thread with ``ToyScorer`` (no Megatron, milliseconds per batch), and
against raw ZeroMQ sockets that never answer or answer garbage. The Megatron server itself is tested under torchrun.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import zmq

from megatron_opd.interfaces import TeacherScores
from megatron_opd.teacher.server import ServerLimits, TeacherServer, describe_server
from megatron_opd.teacher.transport import ServerInfo


class ToyScorer:
    """A causal toy model: logits at ``s`` = (sum of embeddings of tokens ``0..s``) @ W, ``width`` >= ``vocab`` columns.

    Columns ``vocab..width-1`` play padded vocabulary columns (large logits, so a top-k that let them in would show).
    """

    def __init__(self, vocab: int = 50, width: int = 64, hidden: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.embed = torch.randn(width, hidden, generator=g, dtype=torch.float64)
        self.out = torch.randn(hidden, width, generator=g, dtype=torch.float64)
        self.out[:, vocab:] += 10.0  # padded columns would dominate any top-k that did not exclude them
        self.batches = 0

    def logprobs(self, tokens_NS: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``[N, S, vocab]`` reference log-probabilities (float64) over the real vocabulary."""
        h = self.embed[tokens_NS.long()].cumsum(dim=1)
        logits = (h @ self.out)[..., : self.vocab] / temperature
        return torch.log_softmax(logits, dim=-1)

    def score(self, tokens_NS, request_ids_NSR, k: int, temperature: float) -> TeacherScores:
        self.batches += 1
        logprobs = self.logprobs(tokens_NS, temperature)
        values, ids = torch.topk(logprobs, k, dim=-1)
        requested = None if request_ids_NSR is None else logprobs.gather(-1, request_ids_NSR.long()).float()
        return TeacherScores(topk_ids=ids, topk_logprobs=values.float(), requested_logprobs=requested)

    def heartbeat(self) -> None:
        pass


def toy_tokenizer_summary(vocab: int, tag: str = "") -> dict:
    """A tokenizer summary for ``ToyScorer`` (``tag`` renames the last token: a different vocabulary)."""
    names = {f"t{i}": i for i in range(vocab - 1)}
    names[f"<eos>{tag}"] = vocab - 1
    return {
        "size": vocab,
        "vocab": names,
        "special": {"bos_token": None, "eos_token": f"<eos>{tag}", "pad_token": None, "unk_token": None},
        "added": [[vocab - 1, f"<eos>{tag}", True]],
        "chat_template": None,
    }


def toy_server_info(scorer: ToyScorer, limits: ServerLimits, summary: dict | None = None) -> ServerInfo:
    summary = summary or toy_tokenizer_summary(scorer.vocab)
    return describe_server(
        limits, vocab_size=scorer.vocab, embedding_rows=scorer.embed.shape[0], tokenizer=summary, model="toy"
    )


class ThreadServer:
    """A ``TeacherServer`` with a ``ToyScorer`` in a daemon thread (``stop()`` or a fault ends it)."""

    def __init__(
        self,
        scorer: ToyScorer | None = None,
        *,
        port: int = 0,
        token: bytes | None = None,
        limits: ServerLimits | None = None,
        summary: dict | None = None,
        fault_at_request: int | None = None,
    ) -> None:
        self.scorer = scorer or ToyScorer()
        self.limits = limits or ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=512, batch_wait_s=0.0)
        info = toy_server_info(self.scorer, self.limits, summary)
        self.server = TeacherServer(
            self.scorer, info, port=port, token=token, limits=self.limits, fault_at_request=fault_at_request
        )
        self.address = self.server.address
        self.port = self.server.port
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.server.serve(self._stop)
        except BaseException as err:  # noqa: BLE001 - a fault injection ends the thread like a kill
            self.error = err

    def wait_dead(self, timeout: float = 30.0) -> None:
        """Wait for a fault hook to end the server."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"server {self.address} is still running")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class RawServer:
    """A ROUTER socket that answers each request with ``respond(request_bytes) -> bytes | None`` (None: silence)."""

    def __init__(self, respond: Callable[[bytes], bytes | None]) -> None:
        self.respond = respond
        self.received = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            identity, body = self._socket.recv_multipart()[:2]
            self.received += 1
            reply = self.respond(body)
            if reply is not None:
                self._socket.send_multipart([identity, reply])
        self._socket.close(linger=0)
        self._context.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
