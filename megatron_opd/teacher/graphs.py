"""CUDA graphs of the teacher's forward, one per (rows, length) bucket (``teacher.cuda_graphs``, issue #57).

A teacher's forward is hundreds of small kernels per layer (a Mixture-of-Experts layer's router and permutation
above all); replaying a captured graph launches them at once. A graph holds one shape, so each scoring micro-batch
is padded up to a bucket: its rows to the next power of two up to the micro-batch size, its length to the next of
``teacher.cuda_graph_lengths``. Padding goes at the end of every row (and whole padded rows below), so under causal
attention and per-token (dropless) expert routing no real token sees it: the real rows' outputs are the unpadded
forward's, which are copied out of the graph's static output. A length beyond the largest bucket runs eagerly (one
log line).

The capture is a *runner* (``make_runner(forward, tokens, positions) -> run``): :func:`cuda_graph_runner` on a
GPU, :func:`eager_runner` in tests, so everything but the capture itself runs on CPU through the same code.
The captured region must not read device values on the host: Megatron-Core's own MoE layer does (three syncs per
layer), megatron-opd's (``build.moe_fused_routing``) does not, so an MoE teacher needs it (``check_capturable``).

Megatron-Core 0.16's own graphs (``TransformerConfig.cuda_graph_impl="local"``) are not used: they capture per
layer, key runners by shape only for its inference contexts (a training-style forward asserts on a second shape),
need its cudagraph-safe RNG tracker and switch the process to a side stream globally.

Shape legend: ``B`` rows, ``S`` positions (``R``, ``L``: the bucket's).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator

import torch

logger = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]
"""A model chunk's ``forward(tokens_BS, position_ids_BS, attention_mask)``."""
Run = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""One bucket's forward: ``run(tokens_RL, positions_RL) -> output [R, L, ...]``."""
MakeRunner = Callable[[Forward, torch.Tensor, torch.Tensor], Run]
"""``make_runner(forward, tokens_RL, positions_RL) -> run``, called once per bucket with example inputs."""

MAX_LENGTH_BUCKETS = 8
"""At most this many length buckets (``teacher.cuda_graph_lengths``): each costs a capture per row bucket."""


def check_lengths(lengths: list[int] | tuple[int, ...], field: str = "teacher.cuda_graph_lengths") -> None:
    """Refuses an empty, unsorted, non-positive or too long list of length buckets, naming ``field``."""
    lengths = list(lengths)
    if not lengths or len(lengths) > MAX_LENGTH_BUCKETS:
        raise ValueError(f"{field}={lengths}: give 1 to {MAX_LENGTH_BUCKETS} lengths (each bucket is a captured graph)")
    if any(n < 1 for n in lengths) or lengths != sorted(set(lengths)):
        raise ValueError(f"{field}={lengths}: the lengths must be positive and strictly increasing")


def row_buckets(micro_batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``micro_batch_size``, then ``micro_batch_size``: 8 -> (1, 2, 4, 8), 6 -> (1, 2, 4, 6)."""
    rows = [1 << i for i in range(micro_batch_size.bit_length()) if 1 << i < micro_batch_size]
    return (*rows, micro_batch_size)


def eager_runner(forward: Forward, tokens_RL: torch.Tensor, positions_RL: torch.Tensor) -> Run:
    """The bucket's forward run eagerly: the CPU stand-in for :func:`cuda_graph_runner` (same padding, no capture)."""
    return lambda tokens, positions: forward(tokens, positions, None)


def cuda_graph_runner(pool=None, warmup: int = 2) -> MakeRunner:
    """Captures each bucket's forward into a ``torch.cuda.CUDAGraph`` on first use, all in one memory ``pool``
    (shared: buckets replay one at a time and their outputs are copied out before the next), as torch's docs
    describe: ``warmup`` eager forwards on a side stream first (lazy initialisation, autotuning), then the capture
    on static input buffers; a replay copies the inputs into them and returns the static output."""
    if pool is None:
        pool = torch.cuda.graph_pool_handle()

    def make(forward: Forward, tokens_RL: torch.Tensor, positions_RL: torch.Tensor) -> Run:
        static_tokens, static_positions = tokens_RL.clone(), positions_RL.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                forward(static_tokens, static_positions, None)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a rollout or checkpoint thread) do not break the capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                static_out = forward(static_tokens, static_positions, None)
        except RuntimeError as err:  # e.g. a layer that reads device values on the host (an MoE layer's fallback)
            raise RuntimeError(
                f"teacher.cuda_graphs: capturing the forward at {tuple(tokens_RL.shape)} failed ({err}); a layer "
                "that syncs with the host cannot be captured: set teacher.cuda_graphs=false"
            ) from err
        logger.info("teacher.cuda_graphs: captured the forward of %s rows x %s positions", *tokens_RL.shape)

        def run(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            static_tokens.copy_(tokens)
            static_positions.copy_(positions)
            graph.replay()
            return static_out

        return run

    return make


class BucketedForward:
    """A chunk's forward through buckets: pads each call to its bucket, runs that bucket's runner (made on first use),
    returns the real rows and positions; eager beyond the largest bucket."""

    def __init__(self, lengths: tuple[int, ...], micro_batch_size: int, make_runner: MakeRunner, pad_id: int = 0):
        check_lengths(lengths)
        self.lengths = tuple(lengths)
        self.rows = row_buckets(micro_batch_size)
        self.make_runner = make_runner
        self.pad_id = pad_id
        self.runners: dict[Hashable, Run] = {}
        """(variant, rows, length) -> the bucket's runner: at most ``len(rows) * len(lengths)`` per variant."""
        self._warned = False

    def bucket(self, rows: int, length: int) -> tuple[int, int] | None:
        """The (rows, length) bucket of a ``[rows, length]`` micro-batch, or None beyond the largest."""
        r = next((n for n in self.rows if n >= rows), None)
        s = next((n for n in self.lengths if n >= length), None)
        return None if r is None or s is None else (r, s)

    def __call__(self, forward: Forward, variant: Hashable, tokens_BS, position_ids_BS, attention_mask=None, **kw):
        b, s = tokens_BS.shape
        bucket = None if attention_mask is not None or kw else self.bucket(b, s)
        if bucket is None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "teacher.cuda_graphs: a micro-batch of %d rows x %d positions is beyond the largest bucket (%d x "
                    "%d; teacher.cuda_graph_lengths) or not a plain padded one: such micro-batches run eagerly",
                    b, s, self.rows[-1], self.lengths[-1],
                )  # fmt: skip
            return forward(tokens_BS, position_ids_BS, attention_mask, **kw)
        r, L = bucket
        tokens_RL = tokens_BS.new_full((r, L), self.pad_id)
        tokens_RL[:b, :s] = tokens_BS
        # Positions of the padding continue each row's (RoPE tables cover the bucket's length as they do a row's).
        positions_RL = torch.arange(L, device=tokens_BS.device, dtype=position_ids_BS.dtype).expand(r, L).clone()
        positions_RL[:b, :s] = position_ids_BS
        key = (variant, r, L)
        run = self.runners.get(key)
        if run is None:
            run = self.runners[key] = self.make_runner(forward, tokens_RL, positions_RL)
        return run(tokens_RL, positions_RL)[:b, :s].clone()  # out of the static output the next replay overwrites

    @contextlib.contextmanager
    def installed(self, chunks: list, variant: Hashable) -> Iterator[None]:
        """Within the block each chunk's forward goes through the buckets (``variant``: what else shapes the
        forward's graph, e.g. whether the output layer returns hidden states)."""
        before = [chunk.__dict__.get("forward") for chunk in chunks]
        for chunk in chunks:
            eager = chunk.forward
            chunk.forward = lambda *args, _eager=eager, **kw: self(_eager, variant, *args, **kw)
        try:
            yield
        finally:
            for chunk, forward in zip(chunks, before):
                if forward is None:
                    del chunk.forward  # the class's forward again
                else:
                    chunk.forward = forward


def check_capturable(arch, moe_fused_routing: bool, field: str = "teacher.cuda_graphs") -> None:
    """Refuses, before any model is built, a teacher whose forward reads device values on the host (no capture)."""
    if arch.moe is not None and not moe_fused_routing:
        raise ValueError(
            f"{field} with a Mixture-of-Experts teacher needs build.moe_fused_routing=true: Megatron-Core's own MoE "
            "layer copies its tokens per expert to the host, which a CUDA graph cannot capture"
        )


def bucketed_teacher_forward(
    lengths: tuple[int, ...], micro_batch_size: int, device: torch.device | None
) -> BucketedForward:
    """The CUDA-graph forward of ``teacher.cuda_graphs``; refuses a device that is not CUDA."""
    if device is None or device.type != "cuda":
        raise ValueError(f"teacher.cuda_graphs needs a CUDA device, not {device}: set teacher.cuda_graphs=false")
    return BucketedForward(tuple(lengths), micro_batch_size, cuda_graph_runner())
