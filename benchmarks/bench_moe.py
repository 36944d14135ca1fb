"""Mixture-of-Experts student updates on CPU: tokens/s against a dense model with the same active parameters, grouped
against sequential expert GEMMs, and EP=2 against EP=1 (issue #35, item 8).

    python benchmarks/bench_moe.py                  # ~3 minutes on 2 cores
    python benchmarks/bench_moe.py --steps 5 --json out.json

Both students are Qwen3-style, 4 layers of hidden 256 (8 heads of 32, 4 K/V groups), vocabulary 1,000: the MoE one
has 8 experts of width 256 with top-2 routing in every layer; the dense one an MLP of width 512, so a token meets the
same number of parameters (active parameters equal; the MoE holds 4x the MLP weights). One update is an SFT step
(forward, backward, Adam) through the trainer's ``train_step`` on 8 sequences of 256 tokens per data-parallel rank
in micro-batches of 2, timed over ``--steps`` updates after a warm-up one; tokens/s counts every rank's tokens. One
process per layout on one thread; the two-process rows (DP=2) share the machine's two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB, SEQS, LENGTH, MICRO = 1000, 8, 256, 2
SHAPE = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             vocab_size=VOCAB, max_position_embeddings=4096)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, mlp_only_layers=[], decoder_sparse_step=1)


def _updates(student_dir: str, ep: int, grouped: bool, steps: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack_sft
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    torch.set_num_threads(1)
    parallel = ParallelConfig(expert_model_parallel_size=ep)
    initialize_distributed(parallel)
    build = ModelBuildConfig(moe_token_dispatcher="alltoall", moe_grouped_gemm=grouped)
    optim = OptimConfig(lr=1e-4)
    chunks = build_and_load(student_dir, parallel, build, trainable=True)[1]
    student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), steps + 1)
    gen = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    prompts = [torch.randint(1, VOCAB, (16,), generator=gen).tolist() for _ in range(SEQS)]
    responses = [torch.randint(1, VOCAB, (LENGTH - 16,), generator=gen).tolist() for _ in range(SEQS)]
    batch = pack_sft(prompts, responses, pad_token_id=0)
    step = dict(vocab_size=VOCAB, teacher_temperature=1.0, micro_batch_size=MICRO)
    train_step(student, batch, None, LossConfig(kind="sft"), **step)  # warm-up: Adam's state, first-call costs
    start = time.perf_counter()
    for _ in range(steps):
        result = train_step(student, batch, None, LossConfig(kind="sft"), **step)
    return {"s": time.perf_counter() - start, "loss": result.stats.loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()

    from megatron_opd.testing.multiprocess import run_distributed
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        dense = str(make_tiny_hf_model("qwen3", Path(tmp) / "dense", seed=1, intermediate_size=512, **SHAPE))
        moe = str(make_tiny_hf_model("qwen3_moe", Path(tmp) / "moe", seed=1, intermediate_size=512, **SHAPE, **MOE))
        layouts = {  # name -> (model, processes, EP, grouped expert GEMMs)
            "dense, 1 process": (dense, 1, 1, False),
            "MoE sequential experts, 1 process": (moe, 1, 1, False),
            "MoE grouped experts, 1 process": (moe, 1, 1, True),
            "MoE EP=1 (DP=2), 2 processes": (moe, 2, 1, True),
            "MoE EP=2 (DP=2), 2 processes": (moe, 2, 2, True),
        }
        rows = []
        for name, (model, procs, ep, grouped) in layouts.items():
            ranks = run_distributed(_updates, procs, args=(model, ep, grouped, args.steps), timeout=1800)
            seconds = max(r["s"] for r in ranks) / args.steps
            rows.append({"layout": name, "s_per_update": seconds, "tokens_per_s": procs * SEQS * LENGTH / seconds,
                         "loss": ranks[0]["loss"]})  # fmt: skip
            print(f"{name:36s} {seconds:6.2f} s/update  {rows[-1]['tokens_per_s']:8.0f} tokens/s  "
                  f"loss {ranks[0]['loss']:.4f}", flush=True)  # fmt: skip
    base = {r["layout"]: r["tokens_per_s"] for r in rows}
    print(f"MoE (grouped) / dense: {base['MoE grouped experts, 1 process'] / base['dense, 1 process']:.2f}x; "
          f"grouped / sequential: {base['MoE grouped experts, 1 process'] / base['MoE sequential experts, 1 process']:.2f}x; "
          f"EP=2 / EP=1: {base['MoE EP=2 (DP=2), 2 processes'] / base['MoE EP=1 (DP=2), 2 processes']:.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
