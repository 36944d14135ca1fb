"""Teacher-server payload size and loopback throughput, in one run.

    python benchmarks/bench_teacher.py                        # ~1-2 minutes on 2 cores
    python benchmarks/bench_teacher.py --tp 2 --requests 20 --json out.json

1. Bytes per scored token of a reply at k=64 and k=256 (one requested id per position, the sampled token), for
   our wire format (ids int32, log-probs fp32 / bf16), ``torch.save`` and ``pickle`` of the same tensors (verl's
   teacher server sends ``torch.save`` bytes; ids int64 as torch holds them), and vLLM's JSON: the
   ``prompt_logprobs`` of the OpenAI completions API (per position a dict ``"token id" -> {logprob, rank,
   decoded_token}``, k entries plus the actual token when it is outside the top-k, the first position null).
   Log-probs and ids come from a real top-k of the tiny teacher; decoded tokens from its tokenizer. Sizes are of
   the payload only (no HTTP or ZeroMQ framing).
2. Round-trip tokens/s of the teacher server (``torchrun -m megatron_opd.teacher.serve``, the fixture's tiny
   teacher at ``--tp``) on loopback with 1 and 4 concurrent clients, each sending ``--requests`` batches of
   ``--batch`` x ``--seq`` tokens at k=64 (fp32 wire) and waiting for each reply. Scored tokens / wall time; the
   4-client run shows what dynamic batching adds. A CPU-only machine is forward-bound with any model; the same
   rows with a near-free toy scorer (``megatron_opd.testing.teacher_fakes``, no Megatron) show the rate of the
   wire, ZeroMQ, batching and the client's checks (clients and server share the same cores).
3. Wire cost of ``teacher.transfer=hidden`` (the final hidden states, ``H`` values a token: exact dense
   distillation) against the top-k reply, at the hidden sizes and vocabularies of Llama-3.1-8B (4,096; 128,256)
   and Llama-3.1-70B (8,192; 128,256): bytes of real encoded messages per token, and the full logits a dense
   reply would otherwise carry (``V`` values a token).
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_opd.teacher import wire  # noqa: E402
from megatron_opd.teacher.client import TeacherClient  # noqa: E402
from megatron_opd.teacher.transport import ScoreReply  # noqa: E402
from megatron_opd.teacher.zmq_transport import ZmqTransportFactory  # noqa: E402


def vllm_prompt_logprobs_json(ids_SK, logprobs_SK, actual_S, actual_logprob_S, decode) -> bytes:
    """vLLM's ``prompt_logprobs`` for one sequence, as the completions API serialises it."""
    positions: list[dict | None] = [None]  # no distribution for the first prompt token
    for s in range(ids_SK.shape[0]):
        entry = {}
        for rank, (i, lp) in enumerate(zip(ids_SK[s].tolist(), logprobs_SK[s].tolist()), start=1):
            entry[str(i)] = {"logprob": lp, "rank": rank, "decoded_token": decode(i)}
        a = int(actual_S[s])
        if str(a) not in entry:
            entry[str(a)] = {"logprob": float(actual_logprob_S[s]), "rank": 1000, "decoded_token": decode(a)}
        positions.append(entry)
    return json.dumps({"prompt_logprobs": positions}).encode()


def payload_sizes(teacher_dir: str, k: int, n: int, s: int) -> dict[str, float]:
    """Bytes per scored token of each format for a real top-k of the tiny teacher."""
    from megatron_opd.models.reference import hf_logits
    from megatron_opd.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(teacher_dir)
    vocab = len(tokenizer)
    tokens = torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(0))
    logprobs = torch.log_softmax(hf_logits(teacher_dir, tokens)[..., :vocab], dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    nxt = torch.roll(tokens, -1, dims=1)
    requested = logprobs.gather(-1, nxt[..., None])
    tokens_total = n * s
    out = {}
    for dtype in ("fp32", "bf16"):
        reply = ScoreReply(ids.to(torch.int32), values, requested)
        out[f"ours ({dtype} log-probs, int32 ids)"] = len(wire.encode_scores(1, reply, dtype)) / tokens_total
    tensors = {"topk_ids": ids, "topk_logprobs": values, "requested_logprobs": requested}
    buf = io.BytesIO()
    torch.save(tensors, buf)
    out["torch.save (fp32, int64 ids)"] = buf.tell() / tokens_total
    out["pickle (fp32, int64 ids)"] = len(pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)) / tokens_total
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tokenizer.decode([i])
        return cache[i]

    size = sum(len(vllm_prompt_logprobs_json(ids[b], values[b], nxt[b], requested[b, :, 0], decode)) for b in range(n))
    out["vLLM JSON prompt_logprobs"] = size / tokens_total
    return out


TRANSFER_MODELS = (("Llama-3.1-8B", 4096, 128256), ("Llama-3.1-70B", 8192, 128256))
"""(name, hidden size, vocabulary) of the ``teacher.transfer`` rows."""


def transfer_sizes(s: int = 64) -> list[tuple[str, str, float]]:
    """(model, payload, bytes per token) of encoded replies of one ``s``-token sequence."""
    rows = []
    for name, hidden, vocab in TRANSFER_MODELS:
        for k in (64, 256):
            ids = torch.arange(k, dtype=torch.int32).expand(1, s, k)
            reply = ScoreReply(ids, torch.zeros(1, s, k), torch.zeros(1, s, 1))
            for dtype in ("fp32", "bf16"):
                rows.append((name, f"top-{k} + 1 requested id ({dtype})", len(wire.encode_scores(1, reply, dtype)) / s))
        for dtype in ("fp32", "bf16"):
            message = wire.encode_hidden(1, ScoreReply(hidden=torch.zeros(1, s, hidden)), dtype)
            rows.append((name, f"hidden states, H={hidden} ({dtype})", len(message) / s))
        rows.append((name, f"full logits, V={vocab} (fp32, for scale)", 4.0 * vocab))
    return rows


def throughput(address: str, clients: int, requests: int, n: int, s: int, vocab: int) -> float:
    """Scored tokens per second of ``clients`` concurrent clients, each ``requests`` sequential batches."""
    batches = [torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(i)) for i in range(requests)]
    ready = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def run() -> None:
        client = TeacherClient([address], ZmqTransportFactory(), topk=64, timeout_s=120, retries=0)
        try:
            client.connect()
            client.score(batches[0], batches[0][..., None]).result()  # warm-up: connection and first forward
            ready.wait()
            for tokens in batches:
                client.score(tokens, torch.roll(tokens, -1, dims=1)[..., None]).result()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            ready.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return clients * requests * n * s / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the teacher server")
    p.add_argument("--requests", type=int, default=10, help="batches per client")
    p.add_argument("--batch", type=int, default=4, help="sequences per request")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--transfer-only", action="store_true", help="only the teacher.transfer wire-cost table")
    args = p.parse_args()
    print_transfer_sizes()
    if args.transfer_only:
        return

    from megatron_opd.testing.distill_fixture import make_distill_fixture
    from megatron_opd.testing.multiprocess import find_free_port
    from megatron_opd.testing.teacher_fakes import ThreadServer, ToyScorer
    from megatron_opd.testing.teacher_jobs import start_teacher_server, stop, wait_ready

    results: dict = {"sizes": {}, "throughput": {}}
    with tempfile.TemporaryDirectory(prefix="bench_teacher_") as tmp:
        pair = make_distill_fixture(Path(tmp) / "fixture")
        for k in (64, 256):
            results["sizes"][k] = payload_sizes(pair.teacher, k, n=4, s=128)

        log = str(Path(tmp) / "server.log")
        proc = start_teacher_server(pair.teacher, tp=args.tp, port=find_free_port(), ready_file=Path(tmp) / "ready",
                                    log_file=log, extra_args=["--topk", "256"])  # fmt: skip
        try:
            address = wait_ready(proc, Path(tmp) / "ready", log)
            client = TeacherClient([address], ZmqTransportFactory(), topk=64)
            vocab = client.connect().vocab_size
            client.close()
            for clients in (1, 4):
                rate = throughput(address, clients, args.requests, args.batch, args.seq, vocab)
                results["throughput"][f"Megatron server TP={args.tp}, {clients} client(s)"] = rate
        finally:
            stop(proc)
        from megatron_opd.teacher.server import ServerLimits

        toy = ThreadServer(ToyScorer(vocab=vocab, width=vocab, hidden=8),
                           limits=ServerLimits(max_topk=256, max_seq_len=4096, batch_wait_s=0.002))  # fmt: skip
        try:
            for clients in (1, 4):
                rate = throughput(toy.address, clients, args.requests, args.batch, args.seq, vocab)
                results["throughput"][f"toy scorer (wire + batching, a near-free model), {clients} client(s)"] = rate
        finally:
            toy.stop()

    print(f"\nBytes per scored token (reply payload; {vocab}-token vocabulary, 1 requested id per position)\n")
    print("| format | k=64 B/token | k=256 B/token | k=64 vs ours fp32 | k=256 vs ours fp32 |")
    print("| --- | --- | --- | --- | --- |")
    ours64, ours256 = (results["sizes"][k]["ours (fp32 log-probs, int32 ids)"] for k in (64, 256))
    for name in results["sizes"][64]:
        a, b = results["sizes"][64][name], results["sizes"][256][name]
        print(f"| {name} | {a:.0f} | {b:.0f} | {a / ours64:.2f}x | {b / ours256:.2f}x |")
    print(f"\nRound trips on loopback: {args.batch} x {args.seq} tokens per request, k=64, fp32 wire\n")
    print("| server | tokens/s | vs 1 client |")
    print("| --- | --- | --- |")
    rows = results["throughput"]
    for name, rate in rows.items():
        base = rows[name.replace("4 client(s)", "1 client(s)")]
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def print_transfer_sizes() -> None:
    print("\nWire cost per token of teacher.transfer=hidden vs top-k (encoded replies of one 64-token sequence)\n")
    print("| teacher | reply | B/token | vs top-256 fp32 |")
    print("| --- | --- | ---: | ---: |")
    rows = transfer_sizes()
    for model, payload, size in rows:
        base = next(b for m, p, b in rows if m == model and p.startswith("top-256") and p.endswith("(fp32)"))
        print(f"| {model} | {payload} | {size:,.0f} | {size / base:.1f}x |")


if __name__ == "__main__":
    main()
