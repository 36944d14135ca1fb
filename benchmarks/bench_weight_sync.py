"""Weight sync into vLLM (bytes/s, by bucket size) against a plain memory copy of the same bytes, and rollout
tokens/s of vLLM against the built-in sampler on the same prompts.

    python benchmarks/bench_weight_sync.py                       # ~2-3 minutes on 2 cores
    python benchmarks/bench_weight_sync.py --hidden 1024 --layers 8 --buckets 4,64,512 --json out.json

One process (TP=1, a one-rank gloo group) holds a random Qwen3 student (``--hidden``, ``--layers``, vocabulary
``--vocab``, fp32). Its vLLM engine runs in its own process, as in training (``rollout.backend=vllm``).

- Sync: ``VLLMRollout.sync_weights`` (gather the full tensors by name mapping, pack into buckets, gloo broadcast,
  vLLM's layerwise reload) for each bucket size, ``--repeats`` times; bandwidth = the bytes sent / the median
  wall time. Baseline in the same run: copying the same tensors into a buffer of the same bytes (``memcpy``),
  the lower bound of any transfer that has to move every byte once.
- Rollouts: ``--prompts`` random prompts of 8-24 tokens, ``--new-tokens`` sampled tokens each (temperature 1,
  no stop token, so every row runs to the limit); tokens/s = generated tokens / wall time, median of
  ``--repeats`` after one warm-up, for vLLM (one engine call for the batch) and the built-in sampler (static
  batching with a KV cache on the student's ``GPTModel``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args) -> dict:
    import torch.distributed as dist

    from megatron_opd import quiet
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.interfaces import SamplingParams
    from megatron_opd.rollout import BuiltinSampler
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.testing.multiprocess import find_free_port
    from megatron_opd.testing.tiny_models import make_tiny_hf_model
    from megatron_opd.weight_sync.source import megatron_weight_source

    quiet.install(rank=0)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    heads = args.hidden // 64
    model_dir = make_tiny_hf_model(
        "qwen3", work / "student", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=64, vocab_size=args.vocab, max_position_embeddings=256,
    )  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    parallel = ParallelConfig()
    initialize_distributed(parallel)
    arch, chunks = build_and_load(model_dir, parallel, trainable=False)
    source = megatron_weight_source(chunks, arch)
    metas = source.metadata()
    total = sum(m.dtype.itemsize * torch.Size(m.shape).numel() for m in metas)
    result: dict = {"model_bytes": total, "threads": args.threads, "sync": [], "rollout": {}}

    # memcpy baseline: every tensor copied once into a buffer of the same bytes.
    tensors = [t for _, t in source]
    buffer = torch.empty(total, dtype=torch.uint8)

    def memcpy() -> None:
        offset = 0
        for t in tensors:
            flat = t.reshape(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()

    memcpy()
    copy_s = _median_time(memcpy, args.repeats)
    result["memcpy_bytes_per_s"] = total / copy_s
    # The trainer's share of a sync: rebuilding the Hugging Face tensors from the shards (name mapping, casts).
    result["source_seconds"] = _median_time(lambda: [None for _ in source], args.repeats)
    tensors.clear()

    options = EngineOptions(model=str(model_dir), max_model_len=256, threads=args.threads,
                            log_file=str(work / "vllm.log"), max_num_seqs=max(64, args.prompts))  # fmt: skip
    rollout = VLLMRollout(source, options, dp_rank=0, bucket_bytes=int(args.buckets[0] * (1 << 20)), timeout_s=120)
    rollout.sync_weights(0)
    for mib in args.buckets:
        rollout.transfer.bucket_bytes = int(mib * (1 << 20))  # each sync tells the workers its bucket size
        seconds = _median_time(lambda: rollout.sync_weights(0), args.repeats)
        row = {"bucket_mib": mib, "seconds": seconds, "bytes": rollout.bytes_synced,
               "bytes_per_s": rollout.bytes_synced / seconds}  # fmt: skip
        row["vs_memcpy"] = row["bytes_per_s"] / result["memcpy_bytes_per_s"]
        result["sync"].append(row)
        print(f"source iteration alone: {result['source_seconds']:.3f} s", flush=True) if mib == args.buckets[
            0
        ] else None
        print(f"sync bucket {mib:>6g} MiB: {seconds:.3f} s, {row['bytes_per_s'] / 1e9:.2f} GB/s "
              f"({row['vs_memcpy']:.2f}x memcpy at {result['memcpy_bytes_per_s'] / 1e9:.2f} GB/s)", flush=True)  # fmt: skip

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (int(torch.randint(8, 25, (1,), generator=gen)),), generator=gen)
               .tolist() for _ in range(args.prompts)]  # fmt: skip
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1)
    builtin = BuiltinSampler(chunks, vocab_size=arch.vocab_size, max_seq_len=256, pad_token_id=0)
    for name, backend in (("vllm", rollout), ("builtin", builtin)):
        backend.generate(prompts, sampling, 1).result()  # warm-up
        tokens = []

        def once(backend=backend, tokens=tokens) -> None:
            out = backend.generate(prompts, sampling, 1).result()
            tokens.append(sum(out.response_lengths))

        seconds = _median_time(once, args.repeats)
        result["rollout"][name] = {"seconds": seconds, "tokens": tokens[-1], "tokens_per_s": tokens[-1] / seconds}
        print(
            f"rollout {name:>8}: {tokens[-1]} tokens in {seconds:.2f} s = {tokens[-1] / seconds:.0f} tokens/s",
            flush=True,
        )
    result["rollout"]["vllm_over_builtin"] = (
        result["rollout"]["vllm"]["tokens_per_s"] / result["rollout"]["builtin"]["tokens_per_s"]
    )
    rollout.close()
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--buckets", type=lambda s: [float(x) for x in s.split(",")], default=[1, 16, 512])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
