"""Per-phase rates of the trainer's compute on one GPU: the student's update and the teacher's scoring forward.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_phases_gpu.py      # needs CUDA (one GPU)

Random weights in the recipes' shapes (``megatron_opd.launch.memory.KNOWN_CONFIGS``), built by our
``build_model`` in bf16 at TP=1: a Qwen3-1.7B update (forward + backward of a log-sum-exp over the logits) and
the scoring forward (+ top-256) of Llama-3.1-8B and Qwen3-32B. Prints time, tokens/s, MFU against 989 TFLOP/s
(dense bf16, H100/H200; 6N FLOPs per token for an update, 2N for scoring) and peak memory; ``docs/scaling.md``
turns such rates into step times.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_FLOPS = 989e12
CASES = (("Qwen3-1.7B", True, 1, 4096), ("Llama-3.1-8B-Instruct", False, 1, 4096), ("Qwen3-32B", False, 1, 2048))


def bench(name: str, train: bool, b: int, s: int, reps: int = 5) -> dict:
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.launch.memory import hf_config
    from megatron_opd.models.architecture import architecture_from_hf_config
    from megatron_opd.models.builder import ModelBuildConfig, build_model

    arch = architecture_from_hf_config(hf_config(name).to_dict(), name)
    (model,) = build_model(arch, ParallelConfig(), ModelBuildConfig(dtype="bf16"), trainable=train)
    n = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 1000, (b, s), device="cuda")
    positions = torch.arange(s, device="cuda").unsqueeze(0).expand(b, s)

    def once() -> None:
        if train:
            model(tokens, positions, None).float().logsumexp(-1).mean().backward()
        else:
            with torch.no_grad():
                torch.topk(model(tokens, positions, None), 256, dim=-1)

    once()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    row = {"model": name, "phase": "update" if train else "score", "params": n, "tokens": b * s, "s": seconds,
           "tokens_per_s": b * s / seconds, "mfu": (6 if train else 2) * n * b * s / seconds / PEAK_FLOPS,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
    return row


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_phases_gpu.py needs a CUDA GPU")
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(), "cuda", seed=0)
    print(f"{'model':<24}{'phase':<8}{'tokens':>8}{'ms':>9}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}")
    for case in CASES:
        r = bench(*case)
        torch.cuda.empty_cache()  # the model went with bench's frame
        print(f"{r['model']:<24}{r['phase']:<8}{r['tokens']:>8}{r['s'] * 1e3:>9.1f}{r['tokens_per_s']:>11.0f}"
              f"{r['mfu']:>8.1%}{r['peak_gib']:>10.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
