"""Peak memory and time of the vocab-parallel divergence losses against verl's algorithm and other baselines.

CPU (default): TP ranks are spawned once with gloo, each holding a ``[tokens, V/TP]`` shard (one thread per
rank); every token count gets fresh inputs, shared by all its kinds, tails and variants. Variants:

- ``verl``: verl GKD's vocab-parallel top-k KL algorithm, written here from its description (not its code):
  unchunked, the softmax written over the logits in place, forward KL over the teacher's top-k with the tail
  ignored, gradient ``q - p`` written into the same storage. It exists only for ``--mode topk`` forward KL with
  ``ignore`` tail (the only case verl has) and is then the reference of the ratio columns;
- ``all-gather``: gather the student's and teacher's vocabulary shards to ``[tokens, V]`` and use ``log_softmax``
  over the full vocabulary with plain autograd (forward KL only; top-k with the bucket tail);
- ``unchunked``: this implementation with one chunk holding every token (keeps ``[tokens, V/TP]`` temporaries);
  the reference of the ratio columns for every kind and tail verl does not have;
- ``chunked``: this implementation as called by default (automatic chunking, a fresh gradient);
- ``chunked+inplace``: the trainer's loss path, called as the trainer calls it (automatic chunking,
  ``inplace_backward=True``, ``validate=False``).

Peak memory per rank is the highest anonymous resident memory (resident minus file-backed pages, sampled every
0.5 ms from ``/proc/self/statm`` in a thread) during one forward+backward, minus its value at the start, with glibc
told to return freed blocks to the OS (``MALLOC_MMAP_THRESHOLD_``): the extra memory the step needs on top of its
inputs. The student logits are copied from a pristine copy into a work buffer before each run (outside the
measurement) and reach the loss through a stand-in for the output layer that consumes their gradient (as a model
does), so no ``[tokens, V/TP]`` ``.grad`` is kept. The ``excl. grad`` column subtracts the ``[tokens, V/TP]``
gradient buffer a variant allocates (none in place). Time is the median wall time of forward+backward over
``--repeats`` interleaved runs (A B C A B C ...) after one warm-up round, max over ranks.

The output layer with the loss (``--hidden H``): each rank holds hidden states ``[tokens, H]`` and a ``[V/TP, H]``
weight shard instead of logits, and the variants are the output layer followed by the trainer's loss
(``output+loss``: ``h @ W^T``, then ``chunked+inplace``, autograd through the matmul; the reference) and the fused
output layer (``fused``: ``losses.fused_output``, logits formed a chunk at a time). The weight's ``.grad`` is
allocated before the measurement, as Megatron's gradient buffer is, so the extra memory is what the step adds.

CUDA (``--device cuda``): one process, one shard of ``V/TP`` columns (no collectives), comparing the Triton
kernels, the torch path (chunked and unchunked), verl's algorithm and a full ``log_softmax`` on that shard (with
``--hidden``: the output layer + loss against the fused one, the loss's kernels as ``auto`` picks them); peak
memory from ``torch.cuda.max_memory_allocated`` above the inputs, time from CUDA events.

    python benchmarks/bench_loss.py --quick
    python benchmarks/bench_loss.py --mode topk --kind forward_kl --tail ignore --tokens 1024,4096,16384
    python benchmarks/bench_loss.py --mode topk --kind forward_kl,reverse_kl,jsd --tail bucket,renorm,ignore
    python benchmarks/bench_loss.py --device cuda --tokens 4096 --vocab 151936 --tp 1 --dtype bf16
    python benchmarks/bench_loss.py --hidden 1024 --mode topk --kind reverse_kl --tail bucket --tokens 1024,4096,8192
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
from megatron_opd.losses.fused_output import chunk_tokens, fused_output_loss  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_VARIANTS = ("verl", "all-gather", "unchunked", "chunked", "chunked+inplace")
OUTPUT_VARIANTS = ("output+loss", "fused")
"""With ``--hidden``: the output layer then the loss (reference), and the two fused."""
TRAINER_PATH = "chunked+inplace"
# Estimated [tokens, V] fp32 buffers alive at the all-gather baseline's peak (gathered logits, log-softmaxes,
# probabilities, autograd's saved tensors and gradients); used only to skip runs that cannot fit.
_ALLGATHER_FULL_BUFFERS = 9


def _is_output_variant(variant: str) -> bool:
    """``output+loss``, ``fused`` or ``fused(N)`` (``--fused-chunk-size``)."""
    return variant == "output+loss" or variant.startswith("fused")


def applies(variant: str, mode: str, kind: str, tail: str | None) -> bool:
    """Whether a variant exists for this case (verl and the all-gather baseline implement one kind each)."""
    if variant == "verl":
        return mode == "topk" and kind == "forward_kl" and tail == "ignore"
    if variant in ("all-gather", "full log_softmax"):
        return kind == "forward_kl" and tail in (None, "bucket")
    return True


def reference_variant(mode: str, kind: str, tail: str | None, hidden: int | None = None) -> str:
    """The ratio columns' reference: the output layer then the loss with ``--hidden``; else verl's algorithm where
    it exists, else our own unchunked version."""
    if hidden:
        return "output+loss"
    return "verl" if applies("verl", mode, kind, tail) else "unchunked"


# ----------------------------------------------------------------------------------------------- variants


class _VerlTopkForwardKL(torch.autograd.Function):
    """verl GKD's algorithm from its description: unchunked; max, exp and normalisation written over the logits
    in place (they become q); loss = sum over the teacher's top-k of p (log p - log q), tail ignored; backward
    returns ``(q - p) * grad`` in the same storage."""

    @staticmethod
    def forward(ctx, logits_TV, ids_TK, lp_TK, group):
        width = logits_TV.shape[1]
        start = dist.get_rank(group) * width if group is not None else 0
        max_T = logits_TV.amax(dim=-1)
        if group is not None:
            dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
        q_TV = logits_TV.sub_(max_T[:, None]).exp_()
        sum_T = q_TV.sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_T, group=group)
        q_TV.div_(sum_T[:, None])
        local_TK = (ids_TK >= start) & (ids_TK < start + width)
        idx_TK = torch.where(local_TK, ids_TK - start, 0)
        q_TK = torch.where(local_TK, q_TV.gather(1, idx_TK), 0.0)
        if group is not None:
            dist.all_reduce(q_TK, group=group)
        p_TK = lp_TK.exp()
        ctx.save_for_backward(q_TV, idx_TK, torch.where(local_TK, p_TK, 0.0))
        return (p_TK * (lp_TK - q_TK.log())).sum(dim=-1)

    @staticmethod
    def backward(ctx, grad_T):
        q_TV, idx_TK, p_local_TK = ctx.saved_tensors
        q_TV.scatter_add_(1, idx_TK, -p_local_TK.to(q_TV.dtype))
        return q_TV.mul_(grad_T[:, None]), None, None, None


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


def _allgather_loss(mode, student_TV, teacher_TV, ids_TK, lp_TK, group) -> torch.Tensor:
    full_s_TV = _GatherVocab.apply(student_TV, group) if group is not None else student_TV
    logq_TV = torch.log_softmax(full_s_TV.float(), dim=-1)
    if mode == "topk":
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
        # Same storage, but not a view in autograd's eyes (as a model's output is not): in-place use is allowed.
        return logits_TV.detach()

    @staticmethod
    def backward(ctx, grad_TV: torch.Tensor):
        return None, torch.zeros((), dtype=grad_TV.dtype, device=grad_TV.device)


def _student_logits(work_TV: torch.Tensor, pristine_TV: torch.Tensor) -> torch.Tensor:
    """Refill the work buffer from the pristine copy and return it as a model's (non-leaf) logits."""
    work_TV.copy_(pristine_TV)
    anchor = torch.zeros((), dtype=work_TV.dtype, device=work_TV.device, requires_grad=True)
    return _ConsumeGrad.apply(work_TV, anchor)


def _loss(case: tuple, args, student_TV, teacher_TV, ids_TK, lp_TK, group) -> torch.Tensor:
    kind, tail, variant = case
    if variant == "verl":
        return _VerlTopkForwardKL.apply(student_TV, ids_TK, lp_TK, group)
    if variant in ("all-gather", "full log_softmax"):
        return _allgather_loss(args.mode, student_TV, teacher_TV, ids_TK, lp_TK, group)
    backend = "triton" if variant.startswith("triton") else "torch"
    chunk = student_TV.shape[0] if variant == "unchunked" else args.chunk_size
    in_place = variant.endswith("+inplace")
    # The in-place variants are called as the trainer calls the loss: in place and without input validation.
    kw = dict(chunk_size=chunk, group=group, inplace_backward=in_place, validate=not in_place, backend=backend)
    if args.mode == "topk":
        return topk_divergence(student_TV, ids_TK, lp_TK, kind, tail=tail, **kw)
    return dense_divergence(student_TV, teacher_TV, kind, **kw)


def _output_loss(case: tuple, args, hidden_TH, weight_VH, teacher_TV, ids_TK, lp_TK, group) -> torch.Tensor:
    """The output layer and the trainer's loss: ``h @ W^T`` then the in-place loss, or the two fused."""
    kind, tail, variant = case
    kw = dict(chunk_size=args.chunk_size, group=group, inplace_backward=True, validate=False)

    def loss_of(logits_CV: torch.Tensor, rows_C: torch.Tensor | None = None) -> torch.Tensor:
        pick = (lambda x: x) if rows_C is None else (lambda x: x.index_select(0, rows_C))  # noqa: E731
        if args.mode == "topk":
            return topk_divergence(logits_CV, pick(ids_TK), pick(lp_TK), kind, tail=tail, **kw)
        return dense_divergence(logits_CV, pick(teacher_TV), kind, **kw)

    if variant == "output+loss":
        return loss_of(hidden_TH @ weight_VH.t()).sum()
    n, device = hidden_TH.shape[0], hidden_TH.device
    fixed = variant.removeprefix("fused").strip("()")  # fused(N): N tokens per chunk
    rows = int(fixed) if fixed else chunk_tokens(args.chunk_size, weight_VH.shape[0], device)
    ones = torch.ones(n, dtype=torch.float64, device=device)
    # grad_hint=1: .backward() of the loss itself; the weight gradient goes straight into its buffer.
    return fused_output_loss(hidden_TH, weight_VH, ones, ones.bool(), loss_of, rows=rows, grad_hint=1.0)[0]


def _output_inputs(args, n_tokens: int, width: int, rank: int, device: str):
    """(hidden states, weight shard with its gradient buffer, teacher, ids, log-probs) for ``--hidden``."""
    g = torch.Generator(device=device).manual_seed(4321 + rank)
    dtype = DTYPES[args.dtype]
    hidden_TH = torch.randn(n_tokens, args.hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    weight_VH = (torch.randn(width, args.hidden, generator=g, device=device, dtype=dtype) / 16).requires_grad_()
    weight_VH.grad = torch.zeros_like(weight_VH)  # Megatron's gradient buffer: there before the step
    _, _, teacher_TV, ids_TK, lp_TK = _inputs(args, n_tokens, width, rank, device, student=False)
    return hidden_TH, weight_VH, teacher_TV, ids_TK, lp_TK


def _inputs(args, n_tokens: int, width: int, rank: int, device: str, student: bool = True):
    """(pristine student, work buffer, teacher, ids, log-probs). The pristine student is kept in bf16 (values
    exactly representable in the work dtype) so that two student copies fit at 16k tokens."""
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    dtype = DTYPES[args.dtype]
    pristine_TV = work_TV = None
    if student:
        pristine_TV = torch.randn(n_tokens, width, generator=g, device=device, dtype=dtype).mul_(3).to(torch.bfloat16)
        work_TV = torch.empty(n_tokens, width, device=device, dtype=dtype)
    teacher_TV = None
    if args.mode == "dense":
        teacher_TV = torch.randn(n_tokens, width, generator=g, device=device, dtype=dtype).mul_(3)
    # Top-k: the same distinct ids and log-probabilities on every rank (a remote teacher's reply), spread over
    # every shard (CUDA runs one shard alone, so its ids all fall in it); the teacher's top-k mass is below 1.
    g_shared = torch.Generator(device=device).manual_seed(99)
    vocab = width * (args.tp if device == "cpu" else 1)
    base_K = torch.randperm(vocab, generator=g_shared, device=device)[: args.k]
    ids_TK = (base_K[None, :] + 7919 * torch.arange(n_tokens, device=device)[:, None]) % vocab
    lp_TK = torch.log_softmax(torch.randn(n_tokens, args.k + 1, generator=g_shared, device=device), -1)[:, :-1]
    return pristine_TV, work_TV, teacher_TV, ids_TK, lp_TK


# ----------------------------------------------------------------------------------------------- CPU


def _grad_mb(work_TV: torch.Tensor, variant: str) -> float:
    """Size of the gradient a variant allocates (none when it is written into the logits)."""
    in_place = variant.endswith("+inplace") or variant == "verl" or _is_output_variant(variant)
    return 0.0 if in_place else work_TV.numel() * work_TV.element_size() / 2**20


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


def _cpu_run_once(args, case: tuple, inputs: tuple, group, measure_memory: bool) -> tuple[float, float]:
    """One forward+backward on every rank: (seconds, peak anonymous memory above the start in MiB)."""
    if _is_output_variant(case[2]):
        hidden_TH, weight_VH = inputs[:2]
        hidden_TH.grad = None
        weight_VH.grad.zero_()

        def step():
            _output_loss(case, args, *inputs, group).backward()
    else:
        pristine_TV, work_TV, teacher_TV, ids_TK, lp_TK = inputs
        logits = _student_logits(work_TV, pristine_TV)  # an input: refilled before the measurement starts

        def step():
            _loss(case, args, logits, teacher_TV, ids_TK, lp_TK, group).sum().backward()

    gc.collect()
    dist.barrier()
    with _AnonPeak() if measure_memory else contextlib.nullcontext() as peak:
        t0 = time.perf_counter()
        step()
        dist.barrier()
        elapsed = time.perf_counter() - t0
    return elapsed, peak.peak_mb if measure_memory else 0.0


def _cpu_job(args, plan: list[tuple]) -> list[dict[str, float]]:
    """Measure every (tokens, kind, tail, variant) of the plan; one set of inputs per token count.

    Memory: one forward+backward per case with the high-water mark reset just before it. Time: the variants of
    one (kind, tail) are interleaved (A B C A B C ...) so that load from other processes hits them alike.
    """
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    rank = dist.get_rank()
    width = args.vocab // args.tp
    results: dict[tuple, dict[str, float]] = {}
    for n_tokens in sorted({key[0] for key in plan}):
        make = _output_inputs if args.hidden else _inputs
        inputs = make(args, n_tokens, width, rank, "cpu")
        for kind, tail in dict.fromkeys((k, t) for n, k, t, _ in plan if n == n_tokens):
            cases = [(kind, tail, v) for n, k, t, v in plan if (n, k, t) == (n_tokens, kind, tail)]
            for case in cases:
                _, peak_mb = _cpu_run_once(args, case, inputs, group, measure_memory=True)
                results[(n_tokens, *case)] = {"peak_mb": peak_mb, "grad_mb": _grad_mb(inputs[1], case[2])}
                if args.hidden:  # the hidden-state gradient: the same [tokens, H] in both variants
                    results[(n_tokens, *case)]["grad_mb"] = n_tokens * args.hidden * DTYPES[args.dtype].itemsize / 2**20
            times: dict[tuple, list[float]] = {case: [] for case in cases}
            for i in range(args.repeats + 1):  # the first round is a warm-up
                for case in cases:
                    elapsed, _ = _cpu_run_once(args, case, inputs, group, measure_memory=False)
                    if i > 0:
                        times[case].append(elapsed)
            for case in cases:
                results[(n_tokens, *case)]["time_s"] = statistics.median(times[case])
            if rank == 0:
                print(f"  done: tokens={n_tokens} {kind} {tail or ''}", file=sys.stderr, flush=True)
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
    per_rank = 1.5 * shard_mb  # the work buffer and the bf16 pristine copy
    if args.mode == "dense":
        per_rank += shard_mb  # the teacher
    if not (variant.endswith("+inplace") or variant == "verl"):
        per_rank += shard_mb  # the gradient
    if _is_output_variant(variant):
        per_rank = (4 if variant == "output+loss" else 1) * shard_mb / 1.5 + 3 * width * args.hidden * 4 / 2**20
    if variant == "all-gather":
        per_rank += _ALLGATHER_FULL_BUFFERS * n_tokens * args.vocab * 4 / 2**20
    elif variant == "unchunked":
        per_rank += 4 * n_tokens * width * 4 / 2**20
    return per_rank * args.tp + 1024 * args.tp


def _plan_rows(args) -> tuple[list[dict], list[tuple]]:
    rows, plan = [], []
    tails = args.tails if args.mode == "topk" else [None]
    for n_tokens in args.tokens:
        for kind in args.kinds:
            for tail in tails:
                for variant in args.variants:
                    if not applies(variant, args.mode, kind, tail):
                        continue
                    row = {"tokens": n_tokens, "kind": kind, "tail": tail, "variant": variant}
                    need = _estimate_mb(args, variant, n_tokens)
                    if args.device == "cpu" and need > 0.9 * _available_mb():
                        row["skipped"] = f"needs ~{need / 1024:.0f} GiB"
                    else:
                        plan.append((n_tokens, kind, tail, variant))
                    rows.append(row)
    return rows, plan


def run_cpu(args) -> list[dict]:
    from megatron_opd.testing.multiprocess import run_distributed

    # Children inherit this: freed blocks go back to the OS, so resident memory tracks live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows, plan = _plan_rows(args)
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
    rows, plan = _plan_rows(args)
    by_tokens: dict[int, tuple] = {}
    for row in rows:
        n_tokens = row["tokens"]
        if n_tokens not in by_tokens:
            by_tokens.clear()
            torch.cuda.empty_cache()
            by_tokens[n_tokens] = (_output_inputs if args.hidden else _inputs)(args, n_tokens, width, 0, "cuda")
        inputs = by_tokens[n_tokens]
        case = (row["kind"], row["tail"], row["variant"])
        if args.hidden:  # the hidden-state gradient: the same [tokens, H] in both variants
            row["grad_mb"] = n_tokens * args.hidden * DTYPES[args.dtype].itemsize / 2**20
        else:
            row["grad_mb"] = _grad_mb(inputs[1], row["variant"])

        def step(case=case, inputs=inputs):
            """One forward+backward; the refill of the logits (or gradients) happens before the timed region."""
            if args.hidden:
                inputs[0].grad = None
                inputs[1].grad.zero_()
                return lambda: _output_loss(case, args, *inputs, None).backward()
            pristine_TV, work_TV, teacher_TV, ids_TK, lp_TK = inputs
            logits = _student_logits(work_TV, pristine_TV)
            return lambda: _loss(case, args, logits, teacher_TV, ids_TK, lp_TK, None).sum().backward()

        run = step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            run()
        except torch.OutOfMemoryError:
            row["skipped"] = "out of memory"
            continue
        torch.cuda.synchronize()
        row["peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        times = []
        for i in range(args.repeats + 1):  # the first is a warm-up
            run = step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            if i > 0:
                times.append(start.elapsed_time(end) / 1000.0)
        row["time_s"] = statistics.median(times)
    return rows


# ----------------------------------------------------------------------------------------------- table


def format_table(args, rows: list[dict]) -> str:
    by_key = {(r["tokens"], r["kind"], r["tail"], r["variant"]): r for r in rows}
    lines = [
        f"mode={args.mode} dtype={args.dtype} vocab={args.vocab} TP={args.tp} device={args.device_name}"
        + (f" k={args.k}" if args.mode == "topk" else ""),
        "",
        "| tokens | kind | tail | variant | peak extra MiB/rank | excl. grad MiB | time fwd+bwd s | reference | "
        "memory vs ref | time vs ref |",
        "|---:|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['tokens']} | {r['kind']} | {r['tail'] or '-'} | {r['variant']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped ({r['skipped']}) | | | | | |")
            continue
        ref_name = reference_variant(args.mode, r["kind"], r["tail"], args.hidden)
        ref = by_key.get((r["tokens"], r["kind"], r["tail"], ref_name), {})
        mem_ratio = f"{r['peak_mb'] / ref['peak_mb']:.3f}" if ref.get("peak_mb") else "-"
        time_ratio = f"{r['time_s'] / ref['time_s']:.2f}" if ref.get("time_s") else "-"
        lines.append(
            f"{head} {r['peak_mb']:.0f} | {r['peak_mb'] - r['grad_mb']:.0f} | {r['time_s']:.3f} | {ref_name} | "
            f"{mem_ratio} | {time_ratio} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default 1024,4096)")
    parser.add_argument("--vocab", type=int, default=None, help="global (padded) vocabulary (default 151936)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks the vocabulary is split over")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--mode", choices=("dense", "topk"), default="dense")
    parser.add_argument("--kind", default="forward_kl", help="comma-separated: forward_kl, reverse_kl, jsd")
    parser.add_argument("--tail", default="ignore", help="comma-separated top-k tails: bucket, renorm, ignore")
    parser.add_argument("--k", type=int, default=256, help="teacher top-k (mode topk)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk for ours (default: auto)")
    parser.add_argument("--quick", action="store_true", help="small shapes that run in seconds")
    parser.add_argument("--hidden", type=int, default=None, help="compare the output layer + loss with the fused one")
    parser.add_argument("--fused-chunk-size", default=None,
                        help="with --hidden: comma-separated tokens per chunk, each adding a variant fused(N)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = args.tokens or "64,256"
        args.vocab = args.vocab or 32768
        args.repeats = 1
        args.chunk_size = args.chunk_size or 32
    args.tokens = [int(t) for t in (args.tokens or "1024,4096").split(",")]
    args.vocab = args.vocab or 151936
    args.kinds = args.kind.split(",")
    args.tails = args.tail.split(",")
    for kind in args.kinds:
        if kind not in ("forward_kl", "reverse_kl", "jsd"):
            parser.error(f"--kind {kind!r}: choose from forward_kl, reverse_kl, jsd")
    for tail in args.tails:
        if tail not in ("bucket", "renorm", "ignore"):
            parser.error(f"--tail {tail!r}: choose from bucket, renorm, ignore")
    if args.vocab % args.tp:
        parser.error(f"--vocab {args.vocab} must be divisible by --tp {args.tp} (Megatron pads it so)")
    if args.hidden:
        sizes = args.fused_chunk_size.split(",") if args.fused_chunk_size else []
        default_variants = ",".join(OUTPUT_VARIANTS + tuple(f"fused({int(n)})" for n in sizes))
    elif args.device == "cuda":
        default_variants = "verl,full log_softmax,unchunked,chunked,triton,triton+inplace,chunked+inplace"
    else:
        default_variants = ",".join(v for v in CPU_VARIANTS if v != "all-gather")
    args.variants = (args.variants or default_variants).split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        args.device_name = torch.cuda.get_device_name()
        rows = run_cuda(args)
    else:
        args.device_name = f"CPU x{os.cpu_count()} (1 thread per rank)"
        rows = run_cpu(args)
    print(format_table(args, rows))


if __name__ == "__main__":
    main()
