"""Extra peak memory of one student update per rank, CP=1 vs CP=2, at long sequences (CPU, gloo).

    python benchmarks/bench_context_parallel.py                       # 8k and 16k tokens, ~3 minutes on 2 cores
    python benchmarks/bench_context_parallel.py --lengths 4096 --json out.json
    python benchmarks/bench_context_parallel.py --tp 2                # TP2xCP2 (4 processes) against TP=2

One update (top-k reverse KL, k=16, synthetic teacher scores, full trained responses) of a 2-layer Qwen3-style
student (hidden 128, 4 heads of 32, 2 K/V groups, vocabulary 1,000) on one sequence of ``L`` tokens, after a warm-up
update (the optimizer's state then exists). "Extra peak" is the peak of the bytes of tensors alive at once that the
update creates (a ``TorchDispatchMode`` adds every fresh output storage and subtracts it when the tensor is freed),
on the rank with the highest peak: activations, logits, K/V gathered over the CP group, gradients' temporaries.
Parameters, gradient buffers and optimizer state, allocated before, are not in it (they do not depend on ``L``).
The loss of both layouts is printed as a check that they trained the same thing (equal to ~1e-6), and the measured
update's wall time (tracked, the slowest rank; the CPU's two ranks share its cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB, TOPK = 1000, 16


class LiveTensorBytes(TorchDispatchMode):
    """The peak of the bytes of tensors created while active and still alive (fresh storages only: views and
    in-place writes add nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if ptr in self._seen or size == 0:
                continue
            self._seen[ptr] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.live -= self._seen.pop(ptr, 0)


def _update(student_dir: str, length: int, cp: int, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.interfaces import TeacherScores
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    torch.set_num_threads(1)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp)
    initialize_distributed(parallel)
    optim = OptimConfig(lr=1e-4)
    student = Student(
        build_and_load(student_dir, parallel)[1], optim, precision_plan(optim, detect_accelerator("cpu")), 10
    )
    gen = torch.Generator().manual_seed(0)
    prompt, response = (
        torch.randint(0, VOCAB, (16,), generator=gen),
        torch.randint(0, VOCAB, (length - 16,), generator=gen),
    )
    batch = pack([prompt], [response], [torch.ones(length - 16)], pad_token_id=0, seq_len=length)
    logits = torch.randn(1, length, VOCAB, generator=gen) * 3
    logprobs, ids = torch.log_softmax(logits, -1).topk(TOPK, dim=-1)
    scores = TeacherScores(topk_ids=ids, topk_logprobs=logprobs)
    cfg = LossConfig(kind="reverse_kl", mode="topk", topk=TOPK)
    step = dict(vocab_size=VOCAB, teacher_temperature=1.0, micro_batch_size=1)
    train_step(student, batch, scores, cfg, **step)  # warm-up: the optimizer's state
    tracker = LiveTensorBytes()
    start = time.perf_counter()
    with tracker:
        result = train_step(student, batch, scores, cfg, **step)
    seconds = time.perf_counter() - start
    return {"peak": tracker.peak, "loss": result.stats.loss, "rank": ps.get_context_parallel_rank(), "s": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args()

    from megatron_opd.testing.multiprocess import run_distributed
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        student = str(make_tiny_hf_model("qwen3", Path(tmp) / "student", seed=1, num_hidden_layers=2, hidden_size=128,
                                         intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, vocab_size=VOCAB, max_position_embeddings=32768))  # fmt: skip
        for length in args.lengths:
            row = {"tokens": length}
            for cp in (1, 2):
                ranks = run_distributed(_update, cp * args.tp, args=(student, length, cp, args.tp), timeout=1800)
                row[f"cp{cp}_peak_mib"] = max(r["peak"] for r in ranks) / 2**20
                row[f"cp{cp}_loss"] = ranks[0]["loss"]
                row[f"cp{cp}_s"] = max(r["s"] for r in ranks)
            row["ratio"] = row["cp2_peak_mib"] / row["cp1_peak_mib"]
            rows.append(row)
            print(
                f"L={length:6d} TP={args.tp}: extra peak per rank CP=1 {row['cp1_peak_mib']:8.1f} MiB, "
                f"CP=2 {row['cp2_peak_mib']:8.1f} MiB ({row['ratio']:.2f}x); loss {row['cp1_loss']:.6f} / "
                f"{row['cp2_loss']:.6f}; update {row['cp1_s']:.1f} s / {row['cp2_s']:.1f} s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
