"""Context parallelism without TransformerEngine: the sequence split over CP ranks, attention over all of it.

Megatron's layout (``megatron.core.utils.get_batch_on_this_cp_rank``): a sequence of ``S`` positions is cut into
``2 * CP`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * CP - 1 - r`` (one early, one late: the causal work
is balanced; :mod:`megatron_opd.distributed.sequence_split`). Everything per token lives in that layout on each
rank; RoPE is sliced the same way by Megatron (``rope_utils.get_pos_emb_on_this_cp_rank``), and DDP reduces
gradients over data x context-parallel ranks.

Core attention (:func:`attend`): every rank all-gathers K/V over the CP group (backward: the key/value gradients
are summed back to their owners, a reduce-scatter), puts the ``2 * CP`` chunks back in order and runs SDPA for each
local query chunk against its causal prefix only (chunk ``c`` sees chunks ``0..c``, the last one causally). Memory
per rank: the full sequence's K/V (``2 * S * g * d`` per layer, kept for backward) on top of the local activations.

Shape legend: ``s`` local positions (``S / CP``), ``n`` positions of a chunk (``S / 2CP``), ``b`` batch, ``h``/``g``
query / K/V heads on this rank, ``d`` head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_opd.distributed.sequence_split import (
    ContextParallelSplit,
    all_gather_sequence,
    chunk_order,
    natural_order,
)
from megatron_opd.models.sliding_window import window_mask

SPLIT_MARKER = "context_parallel_split"
"""The micro-batch key that says its columns are in this layout (``trainer.loss_batch.split_for_context_parallel``;
``forward_backward`` refuses a CP micro-batch without it)."""


def split_micro_batch(
    mb: dict[str, torch.Tensor],
    split: ContextParallelSplit,
    *,
    per_token: set[str] | frozenset[str],
    pad_multiple: int,
    zero_padded: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """``mb`` with its ``per_token`` columns ``[B, S, ...]`` in this rank's layout, the global ``position_ids`` and
    :data:`SPLIT_MARKER`. ``S`` is first padded to a multiple of ``pad_multiple`` by repeating the last position
    (``zero_padded`` columns: with zeros); the padding must predict nothing trained."""
    out = dict(mb)
    b, s = mb["tokens"].shape
    length = -(-s // pad_multiple) * pad_multiple
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(s, device=mb["tokens"].device).expand(b, s)
    for name in set(per_token) | {"tokens", "position_ids"}:
        value = out.get(name)
        if value is None:
            continue
        if length > s:
            if name == "position_ids":
                tail = value[:, -1:] + torch.arange(1, length - s + 1, device=value.device)
            elif name in zero_padded:
                tail = value.new_zeros(b, length - s, *value.shape[2:])
            else:
                tail = value[:, -1:].expand(b, length - s, *value.shape[2:])
            value = torch.cat([value, tail], dim=1)
        out[name] = split.split(value, 1)
    out[SPLIT_MARKER] = torch.tensor(split.size)
    return out


@contextlib.contextmanager
def whole_sequences(model: torch.nn.Module) -> Iterator[None]:
    """``model`` (a ``GPTModel`` chunk) run on whole sequences on this rank, as at CP=1, restored afterwards.

    For the built-in sampler's decode steps (one token each, which cannot be split into ``2 * CP`` chunks): every CP
    rank holds the same weights, so each decodes the same rows itself. Attention stops gathering K/V over the CP
    group and RoPE stops slicing its table (its ``lru_cache`` is cleared on the way in and out: it is keyed by the
    length only)."""
    config = model.config
    if config.context_parallel_size == 1:
        yield
        return
    splits = [m for m in model.modules() if isinstance(getattr(m, "context_parallel", None), ContextParallelSplit)]
    groups = [m for m in model.modules() if getattr(m, "cp_group", None) is not None]
    caches = {
        forward
        for m in groups
        for cls in type(m).__mro__
        if hasattr(forward := vars(cls).get("forward"), "cache_clear")
    }
    saved = ([m.context_parallel for m in splits], [m.cp_group for m in groups], config.context_parallel_size)
    try:
        for cache in caches:
            cache.cache_clear()
        for m in splits:
            m.context_parallel = None
        for m in groups:
            m.cp_group = None
        config.context_parallel_size = 1
        yield
    finally:
        for m, split in zip(splits, saved[0]):
            m.context_parallel = split
        for m, group in zip(groups, saved[1]):
            m.cp_group = group
        config.context_parallel_size = saved[2]
        for cache in caches:
            cache.cache_clear()


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence in natural order; backward: each rank's slice of the summed gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, split: ContextParallelSplit) -> torch.Tensor:
        ctx.dim, ctx.split = dim, split
        return natural_order(all_gather_sequence(x.contiguous(), dim, split.group, split.size), dim, split.size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from megatron_opd.distributed.device import collective_device

        split = ctx.split
        # Rank-major order, then sum every rank's contribution into its owner's slice (gloo has no reduce-scatter:
        # an all-reduce and a slice there).
        grad = _rank_major(grad, ctx.dim, split.size)
        device = collective_device()
        if dist.get_backend(split.group) == "gloo":
            total = grad.contiguous().to(device)
            dist.all_reduce(total, group=split.group)
            out = total.chunk(split.size, dim=ctx.dim)[split.rank]
        else:
            parts = [p.contiguous() for p in grad.to(device).chunk(split.size, dim=ctx.dim)]
            out = torch.empty_like(parts[0])
            dist.reduce_scatter(out, parts, group=split.group)
        return out.to(grad.device).contiguous(), None, None


def _rank_major(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The natural order along ``dim`` -> rank-major chunks (the inverse of ``natural_order``)."""
    chunks = x.unflatten(dim, (2 * size, x.shape[dim] // (2 * size)))
    return chunks.index_select(dim, torch.tensor(chunk_order(size), device=x.device)).flatten(dim, dim + 1)


def attend(q, k, v, split: ContextParallelSplit, sdpa, window: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries ``[b, h, s, d]`` over the whole sequence; ``k``/``v``
    ``[b, g, s, d]`` are this rank's and are all-gathered. ``sdpa(q, k, v, mask, causal)`` is the module's SDPA call
    (scale, GQA, dropout). ``window``: keys before each query it sees (a sliding window; None: all). Returns
    ``[b, h, s, d]`` in the local layout.

    Query chunk ``c`` attends to keys ``0 .. (c + 1) n``, bottom-right aligned. SDPA's ``is_causal`` is top-left
    aligned when the lengths differ and an explicit mask costs ``n x (c + 1) n`` (kept for backward; on CPU larger
    than CP saves at 8k tokens), so the chunk's queries go last in a square causal call whose first ``c n`` query
    rows are zeros and are dropped: exact, no mask, memory linear in the sequence, at up to twice the attention
    compute of the chunk (``benchmarks/RESULTS.md``). A chunk whose keys a ``window`` hides takes the explicit mask
    (the trainer refuses windows that bite within its sequences, ``trainer.setup.check_inputs``; this covers the
    padding after them)."""
    k_all, v_all = (_GatherSequence.apply(x, 2, split) for x in (k, v))  # [b, g, S, d] in natural order
    n = q.shape[2] // 2
    outs = []
    for i, c in enumerate((split.rank, 2 * split.size - 1 - split.rank)):
        q_c = q[:, :, i * n : (i + 1) * n]
        keys = (c + 1) * n
        if window is not None and keys > window + 1:  # the window hides some of this chunk's keys
            mask = window_mask(n, keys, window, q.device)
            outs.append(sdpa(q_c, k_all[:, :, :keys], v_all[:, :, :keys], mask, False))
            continue
        if c > 0:
            q_c = torch.cat([q_c.new_zeros(*q_c.shape[:2], c * n, q_c.shape[3]), q_c], dim=2)
        outs.append(sdpa(q_c, k_all[:, :, :keys], v_all[:, :, :keys], None, n > 1)[:, :, c * n :])
    return torch.cat(outs, dim=2)
