"""Core attention and packing on CPU: extra peak memory of one student update per sequence length with our SDPA
attention and with Megatron's local attention, and tokens/s of packed against trimmed micro-batches.

    python benchmarks/bench_attention.py                  # ~3 minutes on 2 cores
    python benchmarks/bench_attention.py --lengths 1024,4096 --heads 16 --local-max 8192   # ~20 GiB at 8,192

Memory: a 2-layer Llama-shaped model with many heads (``--heads`` of 64 dims, so the score matrices dominate), one
sequence of each length, forward + backward of the cross-entropy, each in a fresh process (``build.attention`` =
``sdpa`` or ``local``). Extra peak = the process's peak RSS (``VmHWM``) minus its RSS after the model is built.
SDPA keeps no ``s x s`` matrix, so it grows linearly; the local attention keeps the probabilities of every head.

Packing: the same model, the pinned skewed lengths (1 x 2,048 + 7 x 128 tokens) as one micro-batch of 8, padded to
its longest sample (today's trimmed micro-batches, ``train.packing=false``) or packed (THD, ``train.packing=true``);
median forward + backward time over ``--repeats`` after one warm-up. Both with SDPA attention. The same batch scored
by the in-process teacher (forward, vocab-parallel top-64), padded or packed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _worker(model_dir: str, attention: str, job: str, lengths: list[int], repeats: int) -> dict:
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward

    torch.set_num_threads(2)
    initialize_distributed(ParallelConfig())
    teacher_job = job.startswith("teacher")
    build = ModelBuildConfig(attention=attention)
    _, chunks = build_and_load(model_dir, ParallelConfig(), build, trainable=not teacher_job)

    def loss_fn(logits, mb):
        ce = vocab_parallel_cross_entropy(logits.float(), mb["labels"]) * mb["loss_mask"]
        return ce.sum(), None

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (1,), generator=gen) for _ in lengths]
    responses = [torch.randint(0, 1000, (n - 1,), generator=gen) for n in lengths]
    batch = pack(prompts, responses, [torch.ones(n - 1) for n in lengths], pad_token_id=0, pad_multiple=1)
    if job == "memory":
        micro_batches = batch.micro_batches(len(lengths), trim=True, pad_multiple=1)
        base = _rss("VmRSS")
        forward_backward(chunks, micro_batches, loss_fn)
        return {"extra_mib": (_rss("VmHWM") - base) / 2**20}
    if teacher_job:
        from megatron_opd.teacher.inprocess import InProcessTeacher

        teacher = InProcessTeacher(chunks, vocab_size=1000, mode="topk", topk=64, micro_batch_size=len(lengths),
                                   packing=job == "teacher_packed")  # fmt: skip
        tokens = batch.tokens[:, : max(lengths)]

        def once():
            teacher.score(tokens, lengths=batch.lengths).result()
    else:
        if job == "packed":
            micro_batches = batch.packed_micro_batches(len(lengths))
        else:
            micro_batches = batch.micro_batches(len(lengths), trim=True, pad_multiple=8)

        def once():
            forward_backward(chunks, micro_batches, loss_fn)

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    return {"seconds": seconds, "tokens_per_s": sum(lengths) / seconds}


def run(model_dir: Path, attention: str, job: str, lengths: list[int], repeats: int) -> dict:
    """One measurement in a fresh process (peak RSS is per process)."""
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.bench_attention import _worker; "
            f"print('RESULT ' + json.dumps(_worker({str(model_dir)!r}, {attention!r}, {job!r}, {lengths!r}, "
            f"{repeats})))")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MASTER_ADDR": "127.0.0.1"}
    from megatron_opd.testing.multiprocess import find_free_port

    env["MASTER_PORT"], env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"] = str(find_free_port()), "1", "0", "0"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stdout + proc.stderr)[-400:]}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--local-max", type=int, default=4096, help="longest run with the local attention (RAM)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    results: dict = {"memory": [], "packing": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lengths = [int(n) for n in args.lengths.split(",")]
        model = make_tiny_hf_model("llama", Path(tmp) / "model", seed=0, num_hidden_layers=2, hidden_size=256,
                                   num_attention_heads=args.heads, num_key_value_heads=args.heads // 4,
                                   head_dim=64, intermediate_size=512, max_position_embeddings=max(lengths))  # fmt: skip
        for n in lengths:
            row = {"length": n}
            for attention in ("sdpa", "local"):
                if attention == "sdpa" or n <= args.local_max:
                    row[attention] = run(model, attention, "memory", [n], 0).get("extra_mib")
            results["memory"].append(row)
            print(json.dumps(row), flush=True)
        skewed = [2048] + [128] * 7
        for job in ("trimmed", "packed", "teacher_padded", "teacher_packed"):
            results["packing"][job] = run(model, "sdpa", job, skewed, args.repeats)
            print(job, json.dumps(results["packing"][job]), flush=True)

    print(f"\nExtra peak memory of one update (MiB), 2 layers, {args.heads} heads of 64, one sequence:")
    print("| tokens | SDPA (ours) | Megatron local | local / SDPA |")
    print("| ---: | ---: | ---: | ---: |")
    for row in results["memory"]:
        sdpa, local = row.get("sdpa"), row.get("local")
        ratio = f"{local / sdpa:.1f}x" if sdpa and local else "—"
        fmt = lambda v: "not run" if v is None else f"{v:,.0f}"  # noqa: E731
        print(f"| {row['length']:,} | {fmt(sdpa)} | {fmt(local)} | {ratio} |")
    runs = results["packing"]
    _speed_table("Skewed micro-batch (1 x 2,048 + 7 x 128 tokens), forward + backward, SDPA:",
                 {"trimmed (padded to 2,048)": runs["trimmed"], "packed (THD)": runs["packed"]})  # fmt: skip
    _speed_table("The same batch scored by the in-process teacher (forward + top-64), SDPA:",
                 {"padded to 2,048": runs["teacher_padded"], "packed (THD)": runs["teacher_packed"]})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _speed_table(title: str, rows: dict[str, dict]) -> None:
    """A markdown table of ``rows`` (name -> result), speed-ups against the first."""
    if not all("tokens_per_s" in r for r in rows.values()):
        return
    base = next(iter(rows.values()))["tokens_per_s"]
    print(f"\n{title}\n| layout | s | tokens/s | vs the first |\n| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
