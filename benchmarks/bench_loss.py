"""Peak memory and time of the vocab-parallel divergence losses against the obvious alternatives.

CPU (default): TP ranks are spawned once with gloo, each holding a ``[tokens, V/TP]`` shard (one thread per
rank); every token count gets fresh inputs, shared by its variants. Variants:

- ``all-gather``: gather the student's and teacher's vocabulary shards to ``[tokens, V]`` and use ``log_softmax``
  over the full vocabulary with plain autograd (what one writes without vocab-parallel losses);
- ``unchunked``: this implementation with one chunk holding every token (a vocab-parallel loss that keeps
  ``[tokens, V/TP]`` temporaries);
- ``chunked``: this implementation as called by default (automatic chunking);
- ``chunked+inplace``: the same, writing the gradient into the logits' storage (``inplace_backward=True``).

Peak memory per rank is the highest anonymous resident memory (resident minus file-backed pages, sampled every
0.5 ms from ``/proc/self/statm`` in a thread) during one forward+backward, minus its value at the start, with glibc
told to return freed blocks to the OS (``MALLOC_MMAP_THRESHOLD_``): the extra memory the step needs on top of its
inputs. The student logits reach the loss through a stand-in for the output layer that consumes their gradient
(as a model does), so no ``[tokens, V/TP]`` ``.grad`` is kept. The ``excl. grad`` column subtracts the
``[tokens, V/TP]`` gradient buffer a variant allocates (none for ``+inplace``). Time is the median
wall time of forward+backward over ``--repeats`` runs after one warm-up.

CUDA (``--device cuda``): one process, one shard of ``V/TP`` columns (no collectives), comparing the Triton
kernels, the torch path (chunked and unchunked) and a full ``log_softmax`` on that shard; peak memory from
``torch.cuda.max_memory_allocated`` above the inputs, time from CUDA events.

    python benchmarks/bench_loss.py --quick
    python benchmarks/bench_loss.py --tokens 1024,4096 --vocab 151936 --tp 2
    python benchmarks/bench_loss.py --device cuda --tokens 4096 --vocab 151936 --tp 1 --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_opd.losses import dense_divergence, topk_divergence  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_VARIANTS = ("all-gather", "unchunked", "chunked", "chunked+inplace")
# Estimated [tokens, V] fp32 buffers alive at the all-gather baseline's peak (gathered logits, log-softmaxes,
# probabilities, autograd's saved tensors and gradients); used only to skip runs that cannot fit.
_ALLGATHER_FULL_BUFFERS = 9


# ----------------------------------------------------------------------------------------------- variants


class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary shards; backward keeps this rank's slice (the loss is identical on every rank)."""

    @staticmethod
    def forward(ctx, shard_TV: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(shard_TV) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard_TV.contiguous(), group=group)
        ctx.slice = (dist.get_rank(group) * shard_TV.shape[-1], shard_TV.shape[-1])
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad_TV: torch.Tensor):
        start, width = ctx.slice
        return grad_TV[:, start : start + width].contiguous(), None


def _allgather_loss(args, student_TV, teacher_TV, ids_TK, lp_TK, group) -> torch.Tensor:
    full_s_TV = _GatherVocab.apply(student_TV, group) if group is not None else student_TV
    logq_TV = torch.log_softmax(full_s_TV.float(), dim=-1)
    if args.mode == "topk":
        # Forward KL on the teacher's top-k with the bucket tail, written plainly over the full vocabulary.
        logq_TK = logq_TV.gather(-1, ids_TK)
        q_tail_T = 1.0 - logq_TK.exp().sum(-1)
        p_TK = lp_TK.exp()
        p_tail_T = 1.0 - p_TK.sum(-1)
        return (p_TK * (lp_TK - logq_TK)).sum(-1) + p_tail_T * (p_tail_T.log() - q_tail_T.log())
    with torch.no_grad():
        full_t_TV = _GatherVocab.apply(teacher_TV, group) if group is not None else teacher_TV
        logp_TV = torch.log_softmax(full_t_TV.float(), dim=-1)
    return (logp_TV.exp() * (logp_TV - logq_TV)).sum(-1)


class _ConsumeGrad(torch.autograd.Function):
    """Stands for the output layer: passes the logits through and consumes their gradient in backward.

    Without it the benchmark's leaf logits would keep a ``[tokens, V/TP]`` ``.grad``, which a real model never
    does (the output layer turns that gradient into a weight gradient and a ``[tokens, hidden]`` input gradient).
    """

    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return logits_TV.view_as(logits_TV)

    @staticmethod
    def backward(ctx, grad_TV: torch.Tensor):
        return None, torch.zeros((), dtype=grad_TV.dtype, device=grad_TV.device)


def _student_leaf(student_TV: torch.Tensor) -> torch.Tensor:
    """A fresh copy of the student logits, differentiable through ``_ConsumeGrad`` (so in place is allowed)."""
    anchor = torch.zeros((), dtype=student_TV.dtype, device=student_TV.device, requires_grad=True)
    return _ConsumeGrad.apply(student_TV.clone(), anchor)


def _loss(variant: str, args, student_TV, teacher_TV, ids_TK, lp_TK, group) -> torch.Tensor:
    if variant in ("all-gather", "full log_softmax"):
        return _allgather_loss(args, student_TV, teacher_TV, ids_TK, lp_TK, group)
    backend = "torch"
    chunk = None
    if variant == "unchunked":
        chunk = student_TV.shape[0]
    elif variant.startswith("triton"):
        backend = "triton"
        chunk = args.chunk_size
    else:
        chunk = args.chunk_size
    kw = dict(chunk_size=chunk, group=group, inplace_backward=variant.endswith("+inplace"), backend=backend)
    if args.mode == "topk":
        return topk_divergence(student_TV, ids_TK, lp_TK, args.kind, tail="bucket", **kw)
    return dense_divergence(student_TV, teacher_TV, args.kind, **kw)


def _inputs(args, n_tokens: int, width: int, rank: int, device: str):
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    dtype = DTYPES[args.dtype]
    student_TV = torch.randn(n_tokens, width, generator=g, device=device, dtype=dtype).mul_(3)
    teacher_TV = torch.randn(n_tokens, width, generator=g, device=device, dtype=dtype).mul_(3)
    # Top-k: the same distinct ids and log-probabilities on every rank (a remote teacher's reply), spread over
    # every shard; the teacher's top-k mass is below 1.
    g_shared = torch.Generator(device=device).manual_seed(99)
    vocab = width * args.tp
    base_K = torch.randperm(vocab, generator=g_shared, device=device)[: args.k]
    ids_TK = (base_K[None, :] + 7919 * torch.arange(n_tokens, device=device)[:, None]) % vocab
    lp_TK = torch.log_softmax(torch.randn(n_tokens, args.k + 1, generator=g_shared, device=device), -1)[:, :-1]
    return student_TV, teacher_TV, ids_TK, lp_TK


# ----------------------------------------------------------------------------------------------- CPU


def _grad_mb(student_TV: torch.Tensor, variant: str) -> float:
    """Size of the gradient a variant allocates (none when it is written into the logits)."""
    return 0.0 if variant.endswith("+inplace") else student_TV.numel() * student_TV.element_size() / 2**20


def _anon_mb() -> float:
    """Anonymous resident memory (resident minus file-backed pages) of this process, in MiB."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE / 2**20


class _AnonPeak:
    """Samples ``_anon_mb`` every ``interval`` seconds in a thread; ``peak_mb`` is the rise above the start.

    Anonymous memory rather than ``VmHWM``: file-backed pages (torch's shared libraries) can be evicted and
    faulted back under memory pressure, which moved ``VmHWM`` by hundreds of MiB between runs here.
    """

    def __init__(self, interval: float = 0.0005) -> None:
        self.interval = interval
        self.peak_mb = 0.0

    def __enter__(self) -> _AnonPeak:
        self._base = self._max = _anon_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, _anon_mb())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self._max, _anon_mb()) - self._base


def _cpu_run_once(args, variant: str, inputs: tuple, group, measure_memory: bool) -> tuple[float, float]:
    """One forward+backward on every rank: (seconds, peak anonymous memory above the start in MiB)."""
    student_TV, teacher_TV, ids_TK, lp_TK = inputs
    logits = _student_leaf(student_TV)  # the student copy is an input: created before the measurement starts
    gc.collect()
    dist.barrier()
    with _AnonPeak() if measure_memory else contextlib.nullcontext() as peak:
        t0 = time.perf_counter()
        _loss(variant, args, logits, teacher_TV, ids_TK, lp_TK, group).sum().backward()
        dist.barrier()
        elapsed = time.perf_counter() - t0
    return elapsed, peak.peak_mb if measure_memory else 0.0


def _cpu_job(args, plan: list[tuple[int, str]]) -> list[dict[str, float]]:
    """Measure every (tokens, variant) of the plan; one set of inputs per token count, shared by its variants.

    Memory: one forward+backward per variant with the high-water mark reset just before it. Time: the variants'
    repeats are interleaved (A B C A B C ...) so that load from other processes hits them alike.
    """
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    rank = dist.get_rank()
    width = args.vocab // args.tp
    results: dict[tuple[int, str], dict[str, float]] = {}
    for n_tokens in sorted({t for t, _ in plan}):
        variants = [v for t, v in plan if t == n_tokens]
        inputs = _inputs(args, n_tokens, width, rank, "cpu")
        for variant in variants:
            _, peak_mb = _cpu_run_once(args, variant, inputs, group, measure_memory=True)
            results[(n_tokens, variant)] = {"peak_mb": peak_mb, "grad_mb": _grad_mb(inputs[0], variant)}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(args.repeats + 1):  # the first round is a warm-up
            for variant in variants:
                elapsed, _ = _cpu_run_once(args, variant, inputs, group, measure_memory=False)
                if i > 0:
                    times[variant].append(elapsed)
        for variant in variants:
            results[(n_tokens, variant)]["time_s"] = statistics.median(times[variant])
            if rank == 0:
                print(f"  done: tokens={n_tokens} {variant}", file=sys.stderr, flush=True)
        del inputs
        gc.collect()
    return [results[key] for key in plan]


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    return float("inf")


def _estimate_mb(args, variant: str, n_tokens: int) -> float:
    """Rough memory of one run over all ranks (inputs + extra), to skip what cannot fit."""
    width = args.vocab // args.tp
    shard_mb = n_tokens * width * DTYPES[args.dtype].itemsize / 2**20
    per_rank = 4 * shard_mb  # student, its copy, teacher, gradient
    if variant == "all-gather":
        per_rank += _ALLGATHER_FULL_BUFFERS * n_tokens * args.vocab * 4 / 2**20
    elif variant == "unchunked":
        per_rank += 6 * n_tokens * width * 4 / 2**20
    return per_rank * args.tp + 1024 * args.tp


def run_cpu(args) -> list[dict]:
    from megatron_opd.testing.multiprocess import run_distributed

    # Children inherit this: freed blocks go back to the OS, so resident memory tracks live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows, plan = [], []
    for n_tokens in args.tokens:
        for variant in args.variants:
            need = _estimate_mb(args, variant, n_tokens)
            if need > 0.9 * _available_mb():
                rows.append({"tokens": n_tokens, "variant": variant, "skipped": f"needs ~{need / 1024:.0f} GiB"})
            else:
                plan.append((n_tokens, variant))
                rows.append({"tokens": n_tokens, "variant": variant})
    # One spawn for the whole plan (each costs seconds); each measurement resets the high-water mark.
    per_rank = run_distributed(_cpu_job, args.tp, args=(args, plan), timeout=7200)
    measured = iter(range(len(plan)))
    for row in rows:
        if "skipped" not in row:
            i = next(measured)
            row["peak_mb"] = max(r[i]["peak_mb"] for r in per_rank)
            row["grad_mb"] = per_rank[0][i]["grad_mb"]
            row["time_s"] = max(r[i]["time_s"] for r in per_rank)
    return rows


# ----------------------------------------------------------------------------------------------- CUDA


def run_cuda(args) -> list[dict]:
    width = args.vocab // args.tp
    rows = []
    for n_tokens in args.tokens:
        for variant in args.variants:
            torch.cuda.empty_cache()
            student_TV, teacher_TV, ids_TK, lp_TK = _inputs(args, n_tokens, width, 0, "cuda")
            grad_mb = _grad_mb(student_TV, variant)

            logits = _student_leaf(student_TV)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            try:
                _loss(variant, args, logits, teacher_TV, ids_TK, lp_TK, None).sum().backward()
            except torch.OutOfMemoryError:
                rows.append({"tokens": n_tokens, "variant": variant, "skipped": "out of memory"})
                continue
            torch.cuda.synchronize()
            peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
            del logits
            times = []
            for i in range(args.repeats + 1):  # the first is a warm-up
                logits = _student_leaf(student_TV)  # the copy is outside the timed region
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _loss(variant, args, logits, teacher_TV, ids_TK, lp_TK, None).sum().backward()
                end.record()
                torch.cuda.synchronize()
                if i > 0:
                    times.append(start.elapsed_time(end) / 1000.0)
                del logits
            rows.append(
                {
                    "tokens": n_tokens,
                    "variant": variant,
                    "peak_mb": peak_mb,
                    "grad_mb": grad_mb,
                    "time_s": statistics.median(times),
                }
            )
            del student_TV, teacher_TV, ids_TK, lp_TK
    return rows


# ----------------------------------------------------------------------------------------------- table


def format_table(args, rows: list[dict], memory_ref: str, time_ref: str) -> str:
    by_key = {(r["tokens"], r["variant"]): r for r in rows}
    lines = [
        f"mode={args.mode} kind={args.kind} dtype={args.dtype} vocab={args.vocab} TP={args.tp} "
        f"device={args.device_name}" + (f" k={args.k}" if args.mode == "topk" else ""),
        "",
        "| tokens | variant | peak extra MiB/rank | excl. grad MiB | time fwd+bwd s | memory vs "
        f"{memory_ref} | time vs {time_ref} |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['tokens']} | {r['variant']} | skipped ({r['skipped']}) | | | | |")
            continue
        mem_ref = by_key.get((r["tokens"], memory_ref), {})
        t_ref = by_key.get((r["tokens"], time_ref), {})
        mem_ratio = f"{r['peak_mb'] / mem_ref['peak_mb']:.3f}" if mem_ref.get("peak_mb") else "-"
        time_ratio = f"{r['time_s'] / t_ref['time_s']:.2f}" if t_ref.get("time_s") else "-"
        lines.append(
            f"| {r['tokens']} | {r['variant']} | {r['peak_mb']:.0f} | {r['peak_mb'] - r['grad_mb']:.0f} | "
            f"{r['time_s']:.3f} | {mem_ratio} | {time_ratio} |"
        )
    growth = []
    tokens = sorted({r["tokens"] for r in rows})
    if len(tokens) > 1:
        for variant in args.variants:
            first, last = by_key.get((tokens[0], variant), {}), by_key.get((tokens[-1], variant), {})
            if first.get("peak_mb") and last.get("peak_mb"):
                growth.append(
                    f"{variant}: peak x{last['peak_mb'] / first['peak_mb']:.2f}, excl. grad "
                    f"x{(last['peak_mb'] - last['grad_mb']) / max(first['peak_mb'] - first['grad_mb'], 1e-9):.2f}"
                )
        lines += ["", f"Growth from {tokens[0]} to {tokens[-1]} tokens: " + "; ".join(growth)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default 1024,4096)")
    parser.add_argument("--vocab", type=int, default=None, help="global (padded) vocabulary (default 151936)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks the vocabulary is split over")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--mode", choices=("dense", "topk"), default="dense")
    parser.add_argument("--kind", choices=("forward_kl", "reverse_kl", "jsd"), default="forward_kl")
    parser.add_argument("--k", type=int, default=256, help="teacher top-k (mode topk)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk for ours (default: auto)")
    parser.add_argument("--quick", action="store_true", help="small shapes that run in seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = args.tokens or "64,256"
        args.vocab = args.vocab or 32768
        args.repeats = 1
        args.chunk_size = args.chunk_size or 32
    args.tokens = [int(t) for t in (args.tokens or "1024,4096").split(",")]
    args.vocab = args.vocab or 151936
    if args.vocab % args.tp:
        parser.error(f"--vocab {args.vocab} must be divisible by --tp {args.tp} (Megatron pads it so)")
    if args.mode == "topk" and args.kind != "forward_kl":
        parser.error("the all-gather baseline implements forward_kl only in topk mode")
    if args.device == "cuda":
        default_variants = "full log_softmax,unchunked,chunked,triton,triton+inplace"
    else:
        default_variants = ",".join(CPU_VARIANTS)
    args.variants = (args.variants or default_variants).split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        args.device_name = torch.cuda.get_device_name()
        rows = run_cuda(args)
        print(format_table(args, rows, memory_ref="full log_softmax", time_ref="chunked"))
    else:
        args.device_name = f"CPU x{os.cpu_count()} (1 thread per rank)"
        rows = run_cpu(args)
        print(format_table(args, rows, memory_ref="all-gather", time_ref="unchunked"))


if __name__ == "__main__":
    main()
