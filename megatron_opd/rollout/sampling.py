"""Next-token sampling from vocab-sharded logits: greedy, temperature, top-k, top-p and Gumbel-max.

Each tensor-parallel rank holds ``[B, V/TP]`` logits. Sampling needs the rest of the vocabulary only through a few
numbers per row, so the vocabulary is never gathered:

- greedy: the global argmax (two all-reduces of ``[B]``, smallest id on ties);
- top-k: the global k-th largest logit (``[B, k]`` candidates per rank);
- top-p: a logit threshold found by a search over the logits' bit patterns, 8 all-reduces of ``[B, 15]``
  (see :func:`top_p_threshold`);
- the draw itself: Gumbel-max, ``argmax_j (z_j + g_j)`` per shard and the best ``(value, id)`` over the group.

The Gumbel noise of global column ``j`` is the same at every TP size: each step draws ``[B, vocab_size]`` uniforms
from one generator and every rank slices its own columns, so the same seed gives the same samples at TP=1 and TP=2.
Padding columns (global id ``>= shard.vocab_size``) can never be sampled.

Shape legend: ``B`` rows (one per sample), ``V`` this rank's shard columns, ``P`` search points per row.
"""

from __future__ import annotations

import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.losses.shard_ops import global_argmax, global_logsumexp, global_topk, logprobs_at, valid_logits
from megatron_opd.losses.vocab_parallel import VocabShard, all_reduce_sum_


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """An int64 per float that sorts like the float itself (-inf lowest, -0.0 == +0.0); NaN not supported."""
    x = x + 0.0  # -0.0 -> +0.0, so the two zeros get one key
    if x.dtype == torch.float64:
        bits, flip = x.view(torch.int64), 0x7FFF_FFFF_FFFF_FFFF
    else:
        bits, flip = x.to(torch.float32).view(torch.int32).to(torch.int64), 0x7FFF_FFFF
    # Negative floats sort backwards as integers: flip their magnitude bits.
    return torch.where(bits < 0, bits ^ flip, bits)


_PROBE_BITS = 4
"""Each top-p search round probes ``2**_PROBE_BITS - 1`` thresholds at once: 8 rounds for float32 logits."""


def _split_points(lo_B: torch.Tensor, hi_B: torch.Tensor, bits: int) -> torch.Tensor:
    """``[B, 2**bits + 1]`` integers from ``lo`` to ``hi`` splitting the range into near-equal parts.

    Built by repeated floor-averages, which never overflow int64 (float64 order keys span almost 2**64).
    """
    points_BP = torch.stack([lo_B, hi_B], dim=-1)
    for _ in range(bits):
        a_BP, b_BP = points_BP[:, :-1], points_BP[:, 1:]
        mid_BP = (a_BP & b_BP) + ((a_BP ^ b_BP) >> 1)  # floor((a + b) / 2)
        points_BP = torch.stack([a_BP, mid_BP], dim=-1).flatten(1)
        points_BP = torch.cat([points_BP, hi_B[:, None]], dim=-1)
    return points_BP


def top_p_threshold(z_BV: torch.Tensor, shard: VocabShard, top_p: float) -> torch.Tensor:
    """The smallest logit of each row's nucleus, as an order key ``[B]`` (keep ``_order_key(z) >= key``).

    Token ``j`` is kept iff the probability mass of tokens strictly more probable than ``j`` is ``< top_p``, so the
    nucleus is ``{z >= tau}`` for a threshold ``tau`` that is one of the logits (equal logits are kept or dropped
    together). ``mass_above(t)`` is a non-increasing step function of ``t``; the search runs over the integers that
    order the floats (their bit patterns), probing 15 thresholds per round, and ends on ``tau`` exactly after 8
    rounds for float32 logits (16 for float64). A round is one all-reduce of ``[B, 15]``; each rank sorts its shard
    once, so a round costs ``O(B log V)``.

    Precision: the threshold is exact for the computed probabilities, which are float64 and summed in float64
    (relative error ~1e-15); only a nucleus whose mass is within ~1e-13 of ``top_p`` could come out differently
    from exact arithmetic or between TP sizes.
    """
    z64_BV = z_BV.to(torch.float64)
    lse_B = global_logsumexp(z64_BV, shard)
    probs_BV = torch.exp(z64_BV - lse_B[:, None])
    keys_BV, order_BV = torch.sort(_order_key(z_BV), dim=-1)
    # above_BV[:, i] = mass of this shard's columns from sorted position i on (the extra last column holds 0).
    sorted_probs_BV = probs_BV.gather(-1, order_BV)
    above_BV = torch.cat(
        [sorted_probs_BV.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(sorted_probs_BV[:, :1])], dim=-1
    )
    batch, device = z_BV.shape[0], z_BV.device
    hi_key, lo_key = _order_key(torch.tensor([float("inf"), float("-inf")], dtype=z_BV.dtype)).tolist()
    # Invariant: mass_above(lo) >= top_p > mass_above(hi), so tau is in (lo, hi]; the search ends at hi = lo + 1.
    lo_B = torch.full((batch,), lo_key, dtype=torch.int64, device=device)
    hi_B = torch.full((batch,), hi_key, dtype=torch.int64, device=device)
    key_bits = 64 if z_BV.dtype == torch.float64 else 32
    for _ in range(-(-key_bits // _PROBE_BITS)):
        points_BP = _split_points(lo_B, hi_B, _PROBE_BITS)
        probes_BP = points_BP[:, 1:-1].contiguous()
        count_BP = torch.searchsorted(keys_BV, probes_BP, right=True)  # columns with key <= probe
        mass_BP = all_reduce_sum_(above_BV.gather(-1, count_BP), shard)  # this is the round's one all-reduce
        # mass is non-increasing along the probes: the first probe inside the nucleus ends the new range.
        first_B = (mass_BP >= top_p).sum(dim=-1)
        lo_B = points_BP.gather(-1, first_B[:, None])[:, 0]
        hi_B = points_BP.gather(-1, first_B[:, None] + 1)[:, 0]
    return hi_B


def processed_logits(logits_BV: torch.Tensor, shard: VocabShard, params: SamplingParams) -> torch.Tensor:
    """The logits sampling draws from: divided by the temperature, then top-k, then top-p (excluded = ``-inf``).

    Padding columns are ``-inf`` too. Top-k keeps every logit equal to the k-th largest (as transformers does);
    top-p applies to the distribution renormalised after top-k. Float32 (float64 stays).
    """
    if params.temperature == 0:
        raise ValueError("temperature=0 is greedy decoding: it has no sampling distribution")
    z_BV = valid_logits(logits_BV, shard) / params.temperature
    neg_inf = torch.tensor(float("-inf"), dtype=z_BV.dtype, device=z_BV.device)
    if 0 < params.top_k < shard.vocab_size:
        kth_B = global_topk(z_BV, params.top_k, shard)[0][:, -1]
        z_BV = torch.where(z_BV >= kth_B[:, None], z_BV, neg_inf)
    if params.top_p < 1.0:
        tau_B = top_p_threshold(z_BV, shard, params.top_p)
        z_BV = torch.where(_order_key(z_BV) >= tau_B[:, None], z_BV, neg_inf)
    return z_BV


def gumbel_noise(generator: torch.Generator, batch: int, shard: VocabShard, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise for this shard's columns, cut from one ``[batch, vocab_size]`` draw.

    Every rank draws the whole vocabulary (``O(B x vocab)`` random numbers per step) so that global column ``j``
    gets the same noise at any TP size; padding columns get ``-inf``. The uniforms are float32, which truncates the
    Gumbel tail at ~16.6: only tokens ~1e-7 times less likely than the winner are affected.
    """
    u_BW = torch.rand(batch, shard.vocab_size, generator=generator, device=device)
    u_BV = u_BW[:, shard.start : shard.start + shard.valid_width]
    g_BV = torch.full((batch, shard.width), float("-inf"), device=device)
    g_BV[:, : shard.valid_width] = -torch.log(-torch.log(u_BV))  # u = 0 gives -inf: never drawn
    return g_BV


def sample_next(
    logits_BV: torch.Tensor,
    shard: VocabShard,
    params: SamplingParams,
    noise_generator: torch.Generator,
    *,
    drawn: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Global ids ``[B]`` of the next tokens, the same on every rank of the shard's group (with ``drawn``, also
    their log-probabilities under the distribution drawn from, as :func:`drawn_logprobs`: one gather and one
    logsumexp more).

    ``temperature == 0``: the global argmax (smallest id on ties; top-k/top-p ignored, no noise drawn).
    Otherwise Gumbel-max over :func:`processed_logits`: ``argmax_j (z_j + g_j)`` is an exact draw from
    ``softmax(z)``, and its per-shard maxima reduce over the group like a plain argmax.
    """
    if params.temperature == 0:
        ids_B = global_argmax(logits_BV, shard)
        return (ids_B, torch.zeros(ids_B.shape, dtype=torch.float32, device=ids_B.device)) if drawn else ids_B
    z_BV = processed_logits(logits_BV, shard, params)
    g_BV = gumbel_noise(noise_generator, logits_BV.shape[0], shard, logits_BV.device)
    ids_B = global_argmax(z_BV + g_BV.to(z_BV.dtype), shard)
    return (ids_B, logprobs_at(z_BV, ids_B[:, None], shard)[:, 0]) if drawn else ids_B


def drawn_logprobs(logits_BV: torch.Tensor, ids_B: torch.Tensor, shard: VocabShard, params: SamplingParams):
    """``log softmax(processed_logits)[ids]``: each id's log-probability under the distribution :func:`sample_next`
    draws from (temperature, top-k, top-p; ``-inf`` for an id they exclude). Float32 ``[B]`` (float64 stays); no
    gradient. Costs what the draw's processing costs (a top-k merge, the top-p search's 8 all-reduces)."""
    with torch.no_grad():
        z_BV = processed_logits(logits_BV, shard, params)
        return logprobs_at(z_BV, ids_B[:, None], shard)[:, 0]


def token_logprobs(logits_BV: torch.Tensor, ids_B: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``log softmax(logits)[ids]`` over the whole vocabulary: the *unmodified* distribution (temperature 1, no
    top-k/top-p), as vLLM reports it. Float32 ``[B]`` (float64 for float64 logits)."""
    return logprobs_at(logits_BV, ids_B[:, None], shard)[:, 0]
