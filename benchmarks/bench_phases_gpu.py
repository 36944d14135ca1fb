"""Per-phase rates of the trainer's compute on one GPU: the student's update and the teacher's scoring forward.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_phases_gpu.py            # needs CUDA (one GPU)
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_phases_gpu.py --only update

Random weights in the recipes' shapes (``megatron_opd.trainer.memory.KNOWN_CONFIGS``), built by our ``build_model``
in bf16 at TP=1, without TransformerEngine. Each row names its core attention (``local``: Megatron's
``DotProductAttention``, which keeps every ``s x s`` score matrix, the baseline; ``sdpa``: ours) and its loss:

- update ``lse``: forward + backward of a log-sum-exp over the whole logits (the first measurement's stand-in);
- update ``off``: the trainer's loss with ``loss.fused_output=off`` (logits, then the in-place top-256 reverse KL);
- update ``fused``: the trainer's loss as it runs by default (the output layer fused into the divergence);
- score ``logits``: forward + top-256 of the whole logits (the first measurement);
- score ``teacher``: ``InProcessTeacher.score`` (top-256 formed chunk by chunk from the hidden states).

Prints time, tokens/s, MFU against 989 TFLOP/s (dense bf16, H100/H200; 6N FLOPs per token for an update, 2N for
scoring, N every parameter; attention's FLOPs are not counted) and peak memory; ``docs/scaling.md`` turns such
rates into step times. Every row builds its model afresh, so the rows are independent.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_FLOPS = 989e12
TOPK = 256
# (model, phase, rows, tokens per row, attention, loss, recompute)
CASES = (
    ("Qwen3-1.7B", "update", 1, 4096, "local", "lse", None),
    ("Qwen3-1.7B", "update", 1, 4096, "sdpa", ("lse", "off", "fused"), None),
    ("Qwen3-1.7B", "update", 1, 32768, "sdpa", ("fused",), "full"),
    ("Llama-3.1-8B-Instruct", "score", 1, 4096, "local", "logits", None),
    ("Llama-3.1-8B-Instruct", "score", 1, 4096, "sdpa", ("logits", "teacher"), None),
    ("Qwen3-32B", "score", 1, 2048, "sdpa", ("teacher",), None),
)


def _update_step(model, loss: str, tokens, positions, vocab_size: int):
    """A closure running one forward + backward of ``model`` with ``loss``."""
    from megatron_opd.models.output import HiddenStateOutput
    from megatron_opd.trainer.config import LossConfig
    from megatron_opd.trainer.objective import make_loss_fn

    if loss == "lse":
        return lambda: model(tokens, positions, None).float().logsumexp(-1).mean().backward()
    b, s = tokens.shape
    g = torch.Generator(device=tokens.device).manual_seed(0)
    ids = torch.randint(0, vocab_size, (b, s, TOPK), generator=g, device=tokens.device)
    mb = {
        "loss_mask": torch.ones(b, s, device=tokens.device),
        "seq_weights": torch.ones(b, device=tokens.device),
        "labels": tokens,
        "teacher_topk_ids": ids,
        "teacher_topk_logprobs": torch.randn(b, s, TOPK + 1, generator=g, device=tokens.device).log_softmax(-1)[
            ..., :-1
        ],
    }
    cfg = LossConfig(kind="reverse_kl", mode="topk", topk=TOPK, fused_output="on" if loss == "fused" else "off")
    output = HiddenStateOutput([model]) if loss == "fused" else None
    loss_fn = make_loss_fn(cfg, vocab_size=vocab_size, teacher_temperature=1.0, normalizer=float(b * s), scale=1.0,
                           output=output, grad_hint=1.0)  # fmt: skip

    def once() -> None:
        if output is None:
            loss_fn(model(tokens, positions, None), mb)[0].backward()
            return
        with output.active():
            loss_fn(model(tokens, positions, None), mb)[0].backward()

    return once


def _score_step(model, loss: str, tokens, positions, vocab_size: int):
    from megatron_opd.teacher.inprocess import InProcessTeacher

    if loss == "logits":

        def once() -> None:
            with torch.no_grad():
                torch.topk(model(tokens, positions, None), TOPK, dim=-1)

        return once
    teacher = InProcessTeacher([model], vocab_size=vocab_size, mode="topk", topk=TOPK, device=tokens.device)
    return lambda: teacher.score(tokens).result()


def bench(
    name: str,
    phase: str,
    b: int,
    s: int,
    attention: str,
    losses,
    recompute,
    reps: int,
    profile: bool = False,
    norm: str = "torch",
) -> list[dict]:
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models.builder import ModelBuildConfig, build_model
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.trainer.memory import hf_config

    arch = architecture_from_hf_config(hf_config(name).to_dict(), name)
    build = ModelBuildConfig(dtype="bf16", attention=attention, recompute_granularity=recompute, norm=norm)
    (model,) = build_model(arch, ParallelConfig(), build, trainable=phase == "update")
    n = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 1000, (b, s), device="cuda")
    positions = torch.arange(s, device="cuda").unsqueeze(0).expand(b, s)
    rows = []
    for loss in (losses,) if isinstance(losses, str) else losses:
        make = _update_step if phase == "update" else _score_step
        once = make(model, loss, tokens, positions, arch.vocab_size)
        once()  # warm-up (and the gradient buffers, which a trainer keeps too)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(reps):
            once()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        rows.append({"model": name, "phase": phase, "attention": attention, "loss": loss,
                     "recompute": recompute or "-", "tokens": b * s, "s": seconds, "tokens_per_s": b * s / seconds,
                     "mfu": (6 if phase == "update" else 2) * n * b * s / seconds / PEAK_FLOPS,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30})  # fmt: skip
        if profile:
            _profile(once, f"{name} {phase} {attention} {loss}")
    return rows


def _profile(once, title: str) -> None:
    """The GPU kernels of two repetitions, by total time (where the rest of the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once()
        once()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"\n{title}\n" + table.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("update", "score"), default=None, help="run one phase's rows")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up")
    parser.add_argument("--case", type=int, action="append", help="run only these rows of CASES (0-based)")
    parser.add_argument("--profile", action="store_true", help="also print the top GPU kernels of each row")
    parser.add_argument("--norm", choices=("torch", "triton"), default="torch", help="build.norm of the models")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_phases_gpu.py needs a CUDA GPU")
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(), "cuda", seed=0)
    print("| model | phase | attention | loss | recompute | tokens | ms | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|")
    for i, case in enumerate(CASES):
        if (args.only and case[1] != args.only) or (args.case and i not in args.case):
            continue
        try:
            rows = bench(*case, reps=args.reps, profile=args.profile, norm=args.norm)
        except torch.OutOfMemoryError as e:
            print(f"| {case[0]} | {case[1]} | {case[4]} | {case[5]} | {case[6] or '-'} | {case[2] * case[3]} | "
                  f"out of memory: {str(e).splitlines()[0][:80]} | | | |", flush=True)  # fmt: skip
            rows = []
        torch.cuda.empty_cache()  # the model went with bench's frame
        for r in rows:
            print(f"| {r['model']} | {r['phase']} | {r['attention']} | {r['loss']} | {r['recompute']} | "
                  f"{r['tokens']} | {r['s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                  f"{r['peak_gib']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
