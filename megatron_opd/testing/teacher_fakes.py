"""Stand-ins for teacher-server tests: a tiny causal scorer, in-thread servers, and misbehaving servers.

The client's fault handling (time-outs, restarts, dead replicas, bad replies) is tested against the real
``TeacherServer`` front end running in a thread with ``ToyScorer`` (no Megatron, milliseconds per batch), and
against raw ZeroMQ sockets that never answer or answer garbage. The Megatron server itself is tested as a job of ranks.
``python -m megatron_opd.testing.teacher_fakes --port P`` serves a ``ToyScorer`` in a process of its own, for tests
that kill a server with SIGKILL (``ToyServerProcess`` starts one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
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
        self.seen: list[tuple[tuple[int, int], list[int] | None]] = []
        """``(tokens shape, lengths)`` of every batch scored."""

    def logprobs(self, tokens_NS: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``[N, S, vocab]`` reference log-probabilities (float64) over the real vocabulary."""
        logits = (self.hidden(tokens_NS) @ self.out)[..., : self.vocab] / temperature
        return torch.log_softmax(logits, dim=-1)

    def hidden(self, tokens_NS: torch.Tensor) -> torch.Tensor:
        """``[N, S, hidden]`` final hidden states (float64); the logits are ``hidden @ out``."""
        return self.embed[tokens_NS.long()].cumsum(dim=1)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer as a ``[width, hidden]`` weight (what ``teacher.transfer=hidden`` multiplies by)."""
        return self.out.t()

    packing = False

    def score(
        self, tokens_NS, request_ids_NSR, k: int, temperature: float, lengths=None, transfer: str = "topk"
    ) -> TeacherScores:
        self.batches += 1
        self.seen.append((tuple(tokens_NS.shape), lengths))
        if transfer == "hidden":
            return TeacherScores(dense_hidden=self.hidden(tokens_NS).float())
        logprobs = self.logprobs(tokens_NS, temperature)
        values, ids = torch.topk(logprobs, k, dim=-1)
        requested = None if request_ids_NSR is None else logprobs.gather(-1, request_ids_NSR.long()).float()
        return TeacherScores(topk_ids=ids, topk_logprobs=values.float(), requested_logprobs=requested)

    def heartbeat(self) -> None:
        pass


class SlowToyScorer(ToyScorer):
    """A ``ToyScorer`` that prints ``scoring`` when a batch starts and takes ``delay_s`` over it (a request in
    flight that a test can kill the server under)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def score(self, tokens_NS, request_ids_NSR, k: int, temperature: float, lengths=None, transfer="topk"):
        print("scoring", flush=True)
        time.sleep(self.delay_s)
        return super().score(tokens_NS, request_ids_NSR, k, temperature, lengths, transfer)


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


def toy_server_info(
    scorer: ToyScorer, limits: ServerLimits, summary: dict | None = None, hidden_states: bool = True
) -> ServerInfo:
    """The hello reply of a ``ToyScorer`` server (``hidden_states=False``: one that answers top-k only)."""
    summary = summary or toy_tokenizer_summary(scorer.vocab)
    weight = scorer.output_weight[: scorer.vocab].float()
    return describe_server(
        limits, vocab_size=scorer.vocab, embedding_rows=scorer.embed.shape[0], tokenizer=summary, model="toy",
        hidden_size=scorer.embed.shape[1] if hidden_states else None,
        output_weight_sumsq=float(weight.double().square().sum()),
    )  # fmt: skip


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
        hidden_states: bool = True,
    ) -> None:
        self.scorer = scorer or ToyScorer()
        self.limits = limits or ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=512, batch_wait_s=0.0)
        info = toy_server_info(self.scorer, self.limits, summary, hidden_states)
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


class ToyServerProcess:
    """``python -m megatron_opd.testing.teacher_fakes`` on ``port``: ready when the constructor returns."""

    def __init__(self, port: int, delay_s: float = 0.0) -> None:
        command = [sys.executable, "-m", "megatron_opd.testing.teacher_fakes", "--port", str(port)]
        command += ["--delay-s", str(delay_s)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.address = f"127.0.0.1:{port}"
        if self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            self.stop()
            raise RuntimeError(
                f"the toy teacher server on port {port} did not start (exit code {self.proc.returncode})"
            )

    def wait_scoring(self) -> None:
        """Block until the server starts scoring a batch."""
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        if line != "scoring":
            raise RuntimeError(f"the toy teacher server printed {line!r}, expected 'scoring'")

    def stop(self) -> None:
        """SIGKILL (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()  # type: ignore[union-attr]


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


def vllm_prompt_logprobs(logprobs_SV: torch.Tensor, tokens_S: torch.Tensor, k: int) -> list[dict | None]:
    """What vLLM's ``/v1/completions`` returns as ``prompt_logprobs`` for one prompt: entry ``j`` scores token ``j``
    from the distribution at ``j - 1`` (entry 0 is null): its top-k, plus the actual token when outside it."""
    out: list[dict | None] = [None]
    for j in range(1, len(tokens_S)):
        row = logprobs_SV[j - 1]
        ids = row.topk(k).indices.tolist()
        actual = int(tokens_S[j])
        if actual not in ids:
            ids.append(actual)
        ranks = (row.unsqueeze(-1) < row[ids]).sum(0) + 1
        out.append({str(i): {"logprob": float(row[i]), "rank": int(r), "decoded_token": f"t{i}"}
                    for i, r in zip(ids, ranks.tolist())})  # fmt: skip
    return out


class FakeVLLMServer:
    """vLLM's OpenAI routes the vLLM teacher uses (``/v1/models``, ``/tokenize``, ``/v1/completions``), answered
    from a ``ToyScorer`` and a tokenizer in a thread; ``mode`` makes it misbehave like a broken server would:
    ``silent`` never answers a completion, ``malformed`` drops a position, ``oversized`` pads the reply,
    ``max_logprobs`` refuses k like vLLM above ``--max-logprobs``, ``other_tokenizer`` tokenizes differently."""

    def __init__(self, scorer: ToyScorer, tokenizer, mode: str = "ok", max_logprobs: int = 20) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.scorer, self.tokenizer, self.mode, self.max_logprobs = scorer, tokenizer, mode, max_logprobs
        self.completions = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, body: dict | str) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client hung up first (it refuses an oversized reply unread): not the server's error

            def do_GET(self) -> None:
                self._reply(200, {"data": [{"id": "toy", "max_model_len": 64}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = fake.tokenizer.encode(body["prompt"], add_special_tokens=False)
                    if fake.mode == "other_tokenizer":
                        ids = [(i + 1) % len(fake.tokenizer) for i in ids]
                    return self._reply(200, {"tokens": ids, "count": len(ids), "max_model_len": 64})
                self._reply(*fake.complete(body))

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.address = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> tuple[int, dict | str]:
        k = int(body["prompt_logprobs"])
        if k > self.max_logprobs:
            message = f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
            return 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
        self.completions += 1
        probe = len(body["prompt"][0]) <= 2  # the hello's probe is always answered
        if self.mode == "silent" and not probe:
            self._stop.wait()
            return 500, "stopped"
        tokens = torch.tensor(body["prompt"])
        logprobs = self.scorer.logprobs(tokens)
        choices = []
        for row in range(len(tokens)):
            prompt = vllm_prompt_logprobs(logprobs[row], tokens[row], k)
            if self.mode == "malformed":
                prompt = prompt[:-1]
            choices.append({"index": row, "text": "", "prompt_logprobs": prompt, "logprobs": None})
        reply: dict = {"choices": choices}
        if self.mode == "oversized" and not probe:
            reply["padding"] = "x" * (1 << 20)
        return 200, reply

    def stop(self) -> None:
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()


def main(argv: list[str] | None = None) -> None:
    """Serve a ``ToyScorer`` (each batch taking ``--delay-s``) on loopback until killed; prints ``ready`` once bound."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    scorer = SlowToyScorer(args.delay_s) if args.delay_s else ToyScorer()
    limits = ServerLimits(max_topk=16, max_seq_len=64, max_batch_tokens=512, batch_wait_s=0.0)
    server = TeacherServer(scorer, toy_server_info(scorer, limits), port=args.port, limits=limits)
    print("ready", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
