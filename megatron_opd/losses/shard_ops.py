"""Whole-vocabulary questions answered from vocab-sharded logits: normaliser, log-probs at ids, argmax, top-k.

The sampler, the in-process teacher and the trainer's metrics need these per token; like the losses they never
gather the vocabulary. What crosses ranks is ``[T]``, ``[T, R]`` or ``[T, k x TP]`` (top-k candidates).
Padding columns (global id >= ``shard.vocab_size``) never win an argmax or enter a top-k.

Shape legend: ``T`` tokens, ``V`` local shard columns, ``R`` requested ids per token, ``K`` top-k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_opd.losses.vocab_parallel import VocabShard, all_reduce_max_, all_reduce_sum_, finite_or_zero


def valid_logits(logits_TV: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """This shard's logits as float32 (float64 stays), with padding columns set to ``-inf``."""
    dtype = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
    out_TV = logits_TV.to(dtype)
    if shard.valid_width < logits_TV.shape[-1]:
        out_TV = out_TV.clone()
        out_TV[..., shard.valid_width :] = float("-inf")
    return out_TV


def global_logsumexp(logits_TV: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``logsumexp`` over the whole (unpadded) vocabulary, per row: two all-reduces of ``[T]``."""
    z_TV = valid_logits(logits_TV, shard)
    max_T = all_reduce_max_(z_TV.amax(dim=-1), shard)
    shift_T = finite_or_zero(max_T)
    sum_T = all_reduce_sum_(torch.exp(z_TV - shift_T[..., None]).sum(dim=-1), shard)
    return shift_T + torch.log(sum_T)


def chunked_logsumexp(logits_TV: torch.Tensor, shard: VocabShard, chunk_elements: int = 1 << 20) -> torch.Tensor:
    """``global_logsumexp`` a block of rows at a time, so no float copy of the whole shard exists (long responses)."""
    rows_TV = logits_TV.reshape(-1, logits_TV.shape[-1])
    step = max(1, chunk_elements // max(1, rows_TV.shape[-1]))
    dtype = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
    max_T = torch.empty(rows_TV.shape[0], dtype=dtype, device=logits_TV.device)
    for lo in range(0, rows_TV.shape[0], step):
        max_T[lo : lo + step] = valid_logits(rows_TV[lo : lo + step], shard).amax(dim=-1)
    shift_T = finite_or_zero(all_reduce_max_(max_T, shard))
    sum_T = torch.empty_like(max_T)
    for lo in range(0, rows_TV.shape[0], step):
        z_CV = valid_logits(rows_TV[lo : lo + step], shard)
        sum_T[lo : lo + step] = torch.exp(z_CV - shift_T[lo : lo + step, None]).sum(dim=-1)
    return (shift_T + torch.log(all_reduce_sum_(sum_T, shard))).reshape(logits_TV.shape[:-1])


def gather_at_ids(logits_TV: torch.Tensor, ids_TR: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The logits at global ids ``ids_TR`` (each owned by one rank, summed over the group)."""
    local_TR = ids_TR.to(torch.int64) - shard.start
    owned_TR = (local_TR >= 0) & (local_TR < shard.valid_width)
    picked_TR = torch.gather(logits_TV, -1, local_TR.clamp(0, logits_TV.shape[-1] - 1))
    dtype = torch.float64 if logits_TV.dtype == torch.float64 else torch.float32
    out_TR = torch.where(owned_TR, picked_TR.to(dtype), torch.zeros((), dtype=dtype, device=logits_TV.device))
    return all_reduce_sum_(out_TR.contiguous(), shard)


def logprobs_at(
    logits_TV: torch.Tensor, ids_TR: torch.Tensor, shard: VocabShard, lse_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Full-vocabulary log-probabilities at global ids ``ids_TR`` (``lse_T`` reused when given)."""
    if lse_T is None:
        lse_T = global_logsumexp(logits_TV, shard)
    return gather_at_ids(logits_TV, ids_TR, shard) - lse_T[..., None]


def _all_gather(x: torch.Tensor, shard: VocabShard) -> list[torch.Tensor]:
    if not shard.distributed:
        return [x]
    parts = [torch.empty_like(x) for _ in range(shard.world_size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return parts


def global_argmax(x_TV: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Global id of each row's largest value, the smallest id on ties (as ``torch.argmax`` at TP=1).

    Local ``torch.argmax`` (documented to return the first maximum; ``torch.topk`` makes no such promise), then the
    best value and the smallest id holding it over the group: two all-reduces of ``[T]``.
    """
    x_TV = valid_logits(x_TV, shard)
    idx_T = torch.argmax(x_TV, dim=-1)
    value_T = x_TV.gather(-1, idx_T[..., None])[..., 0]
    ids_T = idx_T + shard.start
    if shard.distributed:
        best_T = all_reduce_max_(value_T.clone(), shard)
        ids_T = torch.where(value_T == best_T, ids_T, torch.iinfo(torch.int64).max)
        dist.all_reduce(ids_T, op=dist.ReduceOp.MIN, group=shard.group)
    return ids_T


def global_topk(logits_TV: torch.Tensor, k: int, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row over the whole vocabulary and their global ids, largest first.

    Local top-k per shard, an all-gather of ``k`` candidates per rank, then a top-k of those ``k x TP``. Equal
    values among the candidates are ordered by id (smallest first); which of several tokens tied exactly at the
    k-th value is kept is up to ``torch.topk`` (a measure-zero event for real logits).
    """
    if k > shard.vocab_size:
        raise ValueError(f"top-k of k={k} asked for a vocabulary of {shard.vocab_size} tokens")
    z_TV = valid_logits(logits_TV, shard)
    k_local = min(k, z_TV.shape[-1])
    values_TK, idx_TK = torch.topk(z_TV, k_local, dim=-1, sorted=True)
    ids_TK = idx_TK + shard.start
    if shard.distributed:
        values_TK = torch.cat(_all_gather(values_TK, shard), dim=-1)
        ids_TK = torch.cat(_all_gather(ids_TK, shard), dim=-1)
    # Sort by (value desc, id asc): a stable sort by id, then a stable sort by value.
    order = torch.argsort(ids_TK, dim=-1, stable=True)
    values_TK, ids_TK = values_TK.gather(-1, order), ids_TK.gather(-1, order)
    order = torch.argsort(values_TK, dim=-1, descending=True, stable=True)[..., :k]
    return values_TK.gather(-1, order), ids_TK.gather(-1, order)


def global_topk_logprobs(
    logits_TV: torch.Tensor, k: int, shard: VocabShard, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids and log-probabilities at ``temperature``, plus the row log-normaliser ``lse_T`` (at it)."""
    z_TV = logits_TV if temperature == 1.0 else logits_TV.float() / temperature
    lse_T = global_logsumexp(z_TV, shard)
    values_TK, ids_TK = global_topk(z_TV, k, shard)
    return ids_TK, values_TK - lse_T[..., None], lse_T
