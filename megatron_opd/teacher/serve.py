"""Serve a frozen teacher under its own TP/PP layout: ``torchrun ... -m megatron_opd.teacher.serve --model PATH``.

    torchrun [--nnodes M ...] --nproc-per-node N -m megatron_opd.teacher.serve --model PATH --tp T --pp P [--cp C] \\
        [--ep E] [--host 127.0.0.1] [--port 5555] [--token-file F] [--topk 256] [--ready-file F]

Every rank loads its shard of the teacher (a Hugging Face folder or a ``dist_ckpt``) forward-only. Rank 0 runs the
request loop (:mod:`megatron_opd.teacher.server`); for each batch it broadcasts the shapes, the temperature and
the tokens to all ranks, every rank runs the in-process teacher's sharded forward and vocab-parallel top-k
(:class:`megatron_opd.teacher.inprocess.InProcessTeacher`, no vocabulary gather), and the last pipeline stage
sends the result to rank 0. While idle, rank 0 broadcasts a heartbeat so the other ranks' waits never reach the
process group's timeout. ``--ready-file`` is written (atomically, with the bound address) once the server accepts
requests; a health check (PING) also answers then.

A Mixture-of-Experts teacher at ``--ep E`` runs ``E`` data-parallel replicas of its dense part whose experts are
split over them (Megatron's expert parallelism): each replica scores its share of a batch's rows (the expert-parallel
ranks kept in step, ``distributed.lockstep``) and its sender hands its rows to rank 0, which returns them in order.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_opd import quiet
from megatron_opd.interfaces import TeacherScores
from megatron_opd.teacher.server import ServerLimits, TeacherServer, describe_server, fault_request_from_env
from megatron_opd.teacher.vocabulary import tokenizer_summary
from megatron_opd.teacher.wire import MAX_TOKEN_BYTES, VERSION
from megatron_opd.teacher.zmq_transport import LOOPBACK_HOSTS

logger = logging.getLogger("megatron_opd.teacher.serve")

_STOP, _SCORE, _NOOP = 0.0, 1.0, 2.0
_TRANSFERS = ("topk", "hidden")


class ShardedScorer:
    """Runs each batch on every rank of the server job; rank 0 calls ``score``, the others ``follow``."""

    HEARTBEAT_S = 60.0
    """Idle seconds between heartbeats (well below the process group's 600 s timeout)."""

    def __init__(self, teacher, device: torch.device) -> None:
        from megatron.core import parallel_state as ps

        self.teacher = teacher
        self.device = device
        self.packing = teacher.packing
        """Rows are packed (THD) to their lengths: the padding between requests costs nothing."""
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # Every context-parallel rank holds the whole scores (the teacher gathers them): the first one of the last
        # stage sends its replica's rows to rank 0.
        self.sends = (
            self.tp_rank == 0 and ps.get_context_parallel_rank() == 0 and ps.is_pipeline_last_stage(ignore_virtual=True)
        )
        senders = [None] * dist.get_world_size()
        dist.all_gather_object(senders, (self.dp_rank, self.sends))
        self.senders = {dp: rank for rank, (dp, sends) in enumerate(senders) if sends}  # replica -> its sender
        self._last_collective = time.monotonic()

    def _control(
        self, op: float, n: int = 0, s: int = 0, r: int = 0, k: int = 0, temperature: float = 1.0, transfer: int = 0
    ) -> None:
        ctrl = torch.tensor([op, n, s, r, k, temperature, transfer], dtype=torch.float64, device=self.device)
        dist.broadcast(ctrl, src=0)  # a sync point: every rank waits here between batches
        self._last_collective = time.monotonic()

    def score(
        self, tokens_NS, request_ids_NSR, k: int, temperature: float, lengths: list[int] | None = None, transfer="topk"
    ):
        """``BatchScorer.score``: broadcast the batch, then every rank runs it."""
        n, s = tokens_NS.shape
        r = 0 if request_ids_NSR is None else request_ids_NSR.shape[-1]
        self._control(_SCORE, n, s, r, k, temperature, _TRANSFERS.index(transfer))
        tokens_NS = tokens_NS.to(self.device)
        dist.broadcast(tokens_NS, src=0)
        if request_ids_NSR is not None:
            request_ids_NSR = request_ids_NSR.to(self.device)
            dist.broadcast(request_ids_NSR, src=0)
        lengths_N = torch.tensor(lengths if lengths is not None else [s] * n, device=self.device)
        dist.broadcast(lengths_N, src=0)
        return self._run(tokens_NS, request_ids_NSR, k, temperature, lengths_N.tolist(), transfer)

    def heartbeat(self) -> None:
        if time.monotonic() - self._last_collective > self.HEARTBEAT_S:
            self._control(_NOOP)

    def shutdown(self) -> None:
        try:
            self._control(_STOP)
        except Exception as err:  # noqa: BLE001 - the other ranks may already be gone (SIGTERM from torchrun)
            logger.warning("could not tell the other ranks to stop: %s", err)

    def follow(self) -> None:
        """Non-zero ranks: take part in every batch until rank 0 says stop."""
        while True:
            ctrl = torch.empty(7, dtype=torch.float64, device=self.device)
            dist.broadcast(ctrl, src=0)
            op, n, s, r, k, temperature, transfer = ctrl.tolist()
            if op == _STOP:
                return
            if op == _NOOP:
                continue
            tokens_NS = torch.empty(int(n), int(s), dtype=torch.int64, device=self.device)
            dist.broadcast(tokens_NS, src=0)
            request_ids_NSR = None
            if r:
                request_ids_NSR = torch.empty(int(n), int(s), int(r), dtype=torch.int64, device=self.device)
                dist.broadcast(request_ids_NSR, src=0)
            lengths_N = torch.empty(int(n), dtype=torch.int64, device=self.device)
            dist.broadcast(lengths_N, src=0)
            self._run(tokens_NS, request_ids_NSR, int(k), temperature, lengths_N.tolist(), _TRANSFERS[int(transfer)])

    def _run(
        self, tokens_NS, request_ids_NSR, k: int, temperature: float, lengths: list[int], transfer: str
    ) -> TeacherScores:
        """The sharded forward and top-k (or final hidden states) on every rank; the result reaches rank 0 (from
        the last stage)."""
        hidden = transfer == "hidden"
        self.teacher.mode = "dense" if hidden else "topk"  # dense: the hidden states, no logits formed
        self.teacher.topk, self.teacher.temperature = k, temperature
        n, s = tokens_NS.shape
        bounds = [n * i // self.dp_size for i in range(self.dp_size + 1)]  # each replica's rows
        rows = slice(bounds[self.dp_rank], bounds[self.dp_rank + 1])
        requested = None if request_ids_NSR is None else request_ids_NSR[rows]
        scores = self.teacher.score(tokens_NS[rows], requested, lengths[rows]).result()
        r = 0 if request_ids_NSR is None else request_ids_NSR.shape[-1]
        names = ("dense_hidden",) if hidden else ("topk_ids", "topk_logprobs") + (("requested_logprobs",) if r else ())
        if self.sends and dist.get_rank() != 0 and rows.stop > rows.start:
            for name in names:
                value = getattr(scores, name)
                dist.send(value.contiguous().to(self.device, torch.float32 if value.is_floating_point() else None), 0)
        self._last_collective = time.monotonic()
        if dist.get_rank() != 0:
            return scores
        h = self.teacher.chunks[0].config.hidden_size
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for dp, sender in sorted(self.senders.items()):
            m = bounds[dp + 1] - bounds[dp]
            for name in names if m else ():
                if sender == 0:
                    parts[name].append(getattr(scores, name))
                    continue
                shape = {"topk_ids": (m, s, k), "topk_logprobs": (m, s, k), "requested_logprobs": (m, s, r),
                         "dense_hidden": (m, s, h)}[name]  # fmt: skip
                part = torch.empty(
                    shape, dtype=torch.int64 if name == "topk_ids" else torch.float32, device=self.device
                )
                dist.recv(part, src=sender)
                parts[name].append(part)
        scores = TeacherScores(**{name: torch.cat(values) for name, values in parts.items()})
        if hidden:
            return TeacherScores(dense_hidden=scores.dense_hidden.float().cpu())
        return TeacherScores(
            topk_ids=scores.topk_ids.cpu(),
            topk_logprobs=scores.topk_logprobs.float().cpu(),
            requested_logprobs=None if scores.requested_logprobs is None else scores.requested_logprobs.float().cpu(),
        )


def output_weight_sumsq(chunks: list, vocab_size: int, device: torch.device) -> float:
    """The sum of squares (float64) of the output layer's rows of real tokens, over every rank (a collective):
    what the server tells a ``teacher.transfer=hidden`` trainer, which loads that layer itself, to compare."""
    from megatron.core import parallel_state as ps

    from megatron_opd.models.output import output_weight_of

    total = torch.zeros(1, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        weight_VH = output_weight_of(chunks[-1])
        lo = ps.get_tensor_model_parallel_rank() * weight_VH.shape[0]
        real_VH = weight_VH[: max(0, min(weight_VH.shape[0], vocab_size - lo))]
        total += real_VH.double().square().sum().to(device)
    dist.all_reduce(total)
    return float(total) / ps.get_data_parallel_world_size()  # data-parallel replicas hold the same layer


def read_token(path: str | None) -> bytes | None:
    """The shared secret of ``path`` (surrounding whitespace stripped); None without a file."""
    if not path:
        return None
    token = Path(path).read_bytes().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(f"token file {path}: the token is {len(token)} bytes, at most {MAX_TOKEN_BYTES}")
    return token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m megatron_opd.teacher.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="teacher: Hugging Face folder or dist_ckpt from tools/checkpoint")
    p.add_argument("--tokenizer", help="folder with the teacher's tokenizer files (default: the model's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the teacher")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the teacher")
    p.add_argument(
        "--first-stage-layers",
        type=int,
        help="layers of the first pipeline stage when they do not split evenly (DeepSeek-V3's 61); the rest equally",
    )
    p.add_argument("--last-stage-layers", type=int, help="layers of the last pipeline stage (uneven split)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size of the teacher: each sequence split over CP ranks (implies --no-packing)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size of a Mixture-of-Experts teacher: E data-parallel replicas of the dense part "
        "(launch --tp x --pp x --cp x --ep processes), each scoring a share of every batch",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback; others need a token)")
    p.add_argument("--port", type=int, default=5555, help="TCP port (0: any free port, see --ready-file)")
    p.add_argument("--token-file", help="file holding the shared secret clients must send (teacher.token_file)")
    p.add_argument("--topk", type=int, default=256, help="largest k a request may ask (loss.topk)")
    p.add_argument("--ready-file", help="written with {address, pid} once the server accepts requests")
    p.add_argument("--max-batch-tokens", type=int, default=65536, help="most positions in one forward")
    p.add_argument("--max-message-bytes", type=int, default=256 << 20, help="largest request or reply in bytes")
    p.add_argument("--max-requested", type=int, default=1024, help="most requested ids per position")
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward micro-batch")
    p.add_argument(
        "--no-packing",
        dest="packing",
        action="store_false",
        help="pad every batch to its longest request instead of packing the requests' rows (THD)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="with --pp > 1 and packing: tokens per packed micro-batch (default --micro-batch-size x longest row)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay the forward as CUDA graphs captured per (rows, length) bucket (CUDA, --pp/--cp/--ep 1; implies "
        "--no-packing; an MoE model routes with build.moe_fused_routing)",
    )
    p.add_argument(
        "--cuda-graph-lengths",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[512, 1024, 2048, 4096, 8192],
        help="with --cuda-graphs: the length buckets, comma-separated and increasing (longer batches run eagerly)",
    )
    p.add_argument("--batch-wait-ms", type=float, default=2.0, help="wait for more requests to batch together")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto", help="auto: bf16 on GPU/NPU")
    p.add_argument("--device", choices=("auto", "cuda", "npu", "cpu"), default="auto")
    p.add_argument("--log-level", choices=("info", "debug"), default="info", help="debug: a line per scored batch")
    args = p.parse_args(argv)
    if args.host not in LOOPBACK_HOSTS and not args.token_file:
        p.error(
            f"--host {args.host} is not loopback: give --token-file (clients send the token; it travels in plaintext)"
        )
    for name in ("tp", "pp", "cp", "ep", "topk", "max_batch_tokens", "max_message_bytes", "micro_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.micro_batch_tokens is not None and (args.micro_batch_tokens < 1 or args.micro_batch_tokens % args.tp):
        p.error(f"--micro-batch-tokens={args.micro_batch_tokens} must be >= 1 and divide by --tp={args.tp}")
    if args.cp > 1:  # packed rows are not split over context-parallel ranks: batches are padded
        args.packing = False
    if args.cuda_graphs:
        from megatron_opd.teacher.graphs import check_lengths

        refused = [f"--{n} {getattr(args, n)}" for n in ("pp", "cp", "ep") if getattr(args, n) > 1]
        refused += [f"--device {args.device}"] if args.device not in ("auto", "cuda") else []
        if refused:
            p.error(f"--cuda-graphs captures one forward per padded shape on CUDA: not with {', '.join(refused)}")
        try:
            check_lengths(args.cuda_graph_lengths, "--cuda-graph-lengths")
        except ValueError as err:
            p.error(str(err))
        args.packing = False  # one shape per bucket: rows are padded
    return args


def _write_ready_file(path: str, address: str) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), "protocol": VERSION}) + "\n")
    os.replace(tmp, path)


def _die() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(17)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet.install(level=getattr(logging, args.log_level.upper()))
    token = read_token(args.token_file)

    from megatron_opd.checkpoint.source import build_and_load, model_architecture
    from megatron_opd.distributed import LaunchEnv, ParallelConfig, destroy_distributed, init_process_group
    from megatron_opd.distributed.device import collective_device
    from megatron_opd.distributed.parallel import initialize_model_parallel
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.vocab import tokenizer_dir

    accel = init_process_group(None if args.device == "auto" else args.device)
    moe = model_architecture(args.model, "--model").moe is not None
    if args.ep > 1 and not moe:
        raise ValueError(f"--ep {args.ep}: the model at --model has no Mixture-of-Experts layer; drop --ep")
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep, sequence_parallel=moe and args.tp > 1,  # Megatron's MoE needs SP at TP > 1
        num_layers_in_first_pipeline_stage=args.first_stage_layers,
        num_layers_in_last_pipeline_stage=args.last_stage_layers,
    )  # fmt: skip
    if dist.get_world_size() != parallel.model_parallel_size * args.ep:
        raise ValueError(
            f"the teacher server runs one replica per job (its --ep expert-parallel ranks together): launch exactly "
            f"--tp x --pp x --cp x --ep = {parallel.model_parallel_size * args.ep} processes (got "
            f"{dist.get_world_size()}); start more servers and list them all in teacher.address"
        )
    initialize_model_parallel(parallel)
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if accel.type == "cpu" else "bf16")
    # The replicas score row shares of their own sizes: the default dispatcher (auto) is alltoall at EP > 1, which
    # exchanges tokens in the counts each rank holds.
    # --cuda-graphs: MoE layers route without host syncs (build.moe_fused_routing), which a capture needs.
    build = ModelBuildConfig(dtype=dtype, moe_fused_routing=args.cuda_graphs)
    graphs = None
    if args.cuda_graphs:  # refused off CUDA before the model is built
        from megatron_opd.teacher.graphs import bucketed_teacher_forward

        graphs = bucketed_teacher_forward(
            args.cuda_graph_lengths, args.micro_batch_size, accel.device(LaunchEnv.from_environ().local_rank)
        )
    arch, chunks = build_and_load(args.model, parallel, build, trainable=False, field="--model")
    # Megatron allocates its parallel layers on the current device, but norms (local spec) start on the CPU.
    device = accel.device(LaunchEnv.from_environ().local_rank)
    for chunk in chunks:
        chunk.to(device)
    tok_dir = Path(args.tokenizer) if args.tokenizer else tokenizer_dir(args.model, "--model")
    tokenizer = load_tokenizer(tok_dir, "--tokenizer")
    vocab_size = len(tokenizer)
    if vocab_size > arch.vocab_size:
        raise ValueError(f"the tokenizer ({tok_dir}) has {vocab_size} tokens, the model only {arch.vocab_size} rows")
    teacher = InProcessTeacher(
        chunks,
        vocab_size=vocab_size,
        mode="topk",
        topk=args.topk,
        micro_batch_size=args.micro_batch_size,
        packing=args.packing,
        micro_batch_tokens=args.micro_batch_tokens,
        graphs=graphs,
    )
    scorer = ShardedScorer(teacher, collective_device())
    sumsq = output_weight_sumsq(chunks, vocab_size, collective_device())  # a collective: before ranks part ways
    if dist.get_rank() != 0:
        scorer.follow()
        destroy_distributed()
        return

    summary = tokenizer_summary(tokenizer)
    limits = ServerLimits(
        max_topk=args.topk,
        max_seq_len=arch.max_position_embeddings,
        max_batch_tokens=args.max_batch_tokens,
        max_message_bytes=args.max_message_bytes,
        max_requested=args.max_requested,
        batch_wait_s=args.batch_wait_ms / 1000,
    )
    # Soft-capped final logits (Gemma 2) are not hidden states times the output weight: no transfer=hidden.
    capped = arch.final_logit_softcapping is not None
    info = describe_server(
        limits,
        vocab_size=vocab_size,
        embedding_rows=arch.vocab_size,
        tokenizer=summary,
        model=str(args.model),
        extra={"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep, "dtype": dtype}
        | ({"no_hidden": "its final logits are soft-capped (final_logit_softcapping)"} if capped else {}),
        hidden_size=None if capped else arch.hidden_size,
        output_weight_sumsq=sumsq,
    )
    server = TeacherServer(
        scorer,
        info,
        host=args.host,
        port=args.port,
        token=token,
        limits=limits,
        fault_at_request=fault_request_from_env(),
        on_fault=_die,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.ready_file:
        _write_ready_file(args.ready_file, server.address)
    logger.info(
        "teacher server ready on %s (TP=%d PP=%d CP=%d EP=%d, %s, %d tokens, top-k <= %d%s)",
        server.address, args.tp, args.pp, args.cp, args.ep, dtype, vocab_size, args.topk,
        ", token required" if token else "",
    )  # fmt: skip
    try:
        server.serve(stop)
    finally:
        scorer.shutdown()
        destroy_distributed()


if __name__ == "__main__":
    main()
