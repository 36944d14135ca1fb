"""The sampled divergences (``loss.mode=sampled``): the teacher's log-probability of each sampled token is all
they need.

On-policy, the student's own samples ``y ~ q`` estimate a per-token divergence's gradient by the score function:
``E_q[a(y) grad log q(y)]`` with a weight ``a`` read at the sampled token. Differentiating an estimate of the
divergence itself would give ``E_q[grad log q] = 0`` (the student would not learn), so the loss is the surrogate

    sum_t sg(a_t) * log q(y_t)        (sg: stop-gradient; a_t from the log-ratio log q(y_t) - log p(y_t))

whose value is not a divergence but whose gradient is the estimate.

- ``reverse_kl`` (slime's estimator): ``a = log q - log p``, the reported divergence the same. ``a`` is unbounded
  where the teacher rules a sampled token out (``log p`` of -20 at a wrong digit): a few such tokens carry each
  step's gradient, and under Adam that noise outweighs the signal on small batches (docs/training.md).
- ``forward_kl``: ``grad KL(p || q) = -E_p[grad log q] = E_q[(1 - p/q) grad log q]`` (importance weights ``p/q``,
  and ``E_q[grad log q] = 0`` as the baseline): ``a = 1 - min(p/q, ratio_clip)``, never above 1, so a token the
  teacher rules out weighs 1 however unlikely it is; the reported divergence is ``r log r - r + 1`` (``r = p/q``),
  a non-negative unbiased estimate of ``KL(p || q)``. ``ratio_clip`` truncates the weights where the student gives
  a token far less than the teacher does (rare under ``q`` but then large), as truncated importance sampling does.

Every teacher back end can give ``log p(y_t)`` (a vLLM teacher included), and the teacher may use another tokenizer:
with ``group_offset`` the log-ratio is taken per aligned group of tokens (``megatron_opd.cross_tokenizer``),
``log q(group) - log p(group)`` with ``log q(group)`` the sum over its student tokens and ``log p(group)`` over its
teacher tokens, and its weight multiplies ``grad log q(y_t)`` at each student token of the group. Its expectation
is exactly the fixed-prefix (per-group) part of the sequence-level divergence over texts (checked by enumeration,
``testing.cross_tokenizer_reference``; docs/losses.md gives the gap to the sequence-level one).

``log q(y_t)`` comes from the shard statistics alone (two all-reduces of ``[T]``); its backward needs no
communication. Shape legend: ``T`` tokens (any leading shape), ``V`` this rank's vocabulary columns.
"""

from __future__ import annotations

import torch

from megatron_opd.losses.shard_ops import gather_at_ids, global_logsumexp, valid_logits
from megatron_opd.losses.vocab_parallel import VocabShard, make_vocab_shard


class _LabelLogprob(torch.autograd.Function):
    """``log softmax(logits / T)`` at the labels over the whole (sharded, unpadded) vocabulary."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, shard: VocabShard, inv_temperature: float):
        z_TV = valid_logits(logits_TV, shard)
        z_TV = z_TV * inv_temperature if inv_temperature != 1.0 else z_TV
        lse_T = global_logsumexp(z_TV, shard)
        label_T = gather_at_ids(z_TV, labels_T[:, None], shard)[:, 0]
        ctx.save_for_backward(z_TV, labels_T, lse_T)
        ctx.shard, ctx.inv_temperature, ctx.dtype = shard, inv_temperature, logits_TV.dtype
        return label_T - lse_T

    @staticmethod
    def backward(ctx, grad_T):
        z_TV, labels_T, lse_T = ctx.saved_tensors
        grad_TV = torch.exp(z_TV - lse_T[:, None]).mul_(-grad_T[:, None])  # padding columns: exp(-inf) = 0
        local_T = labels_T - ctx.shard.start
        owned_T = (local_T >= 0) & (local_T < ctx.shard.valid_width)
        rows_T = torch.arange(grad_TV.shape[0], device=grad_TV.device)
        grad_TV[rows_T[owned_T], local_T[owned_T]] += grad_T[owned_T]
        return grad_TV.mul_(ctx.inv_temperature).to(ctx.dtype), None, None, None


def label_logprobs(
    logits_TV: torch.Tensor, labels_T: torch.Tensor, *, vocab_size: int | None, temperature: float = 1.0
) -> torch.Tensor:
    """``log q(label)`` per token at ``temperature`` (differentiable; vocab-parallel over Megatron's TP group)."""
    shard = make_vocab_shard(logits_TV.shape[-1], None, vocab_size)
    lead = labels_T.shape
    flat_TV, flat_T = logits_TV.reshape(-1, logits_TV.shape[-1]), labels_T.reshape(-1).to(torch.int64)
    return _LabelLogprob.apply(flat_TV, flat_T, shard, 1.0 / temperature).view(lead)


def group_sums(values_T: torch.Tensor, group_offset_T: torch.Tensor | None, context_parallel=None) -> torch.Tensor:
    """Each token's group total: ``values`` summed over the tokens whose ``position + group_offset`` (the group's
    first position, in the same flattened layout) is the same; ``None``: every token its own group.
    ``context_parallel`` (a ``ContextParallelSplit``; ``[B, S]`` values): the rows are this rank's share of each
    sequence, and a group may span ranks: the totals are taken over the gathered sequences (no gradient)."""
    if group_offset_T is None:
        return values_T
    if context_parallel is not None:
        cp = context_parallel
        return cp.split(group_sums(cp.gather(values_T), cp.gather(group_offset_T)), 1)
    flat_T, shape = values_T.reshape(-1), values_T.shape
    first_T = torch.arange(flat_T.numel(), device=flat_T.device) + group_offset_T.reshape(-1).to(torch.int64)
    totals = torch.zeros_like(flat_T).index_add_(0, first_T, flat_T)
    return totals[first_T].view(shape)


SAMPLED_KINDS = ("reverse_kl", "forward_kl")
"""The divergences ``loss.mode=sampled`` estimates."""
_MAX_LOG_RATIO = 80.0
"""``log(p/q)`` beyond this is taken as this: ``r log r`` stays finite in float32."""


def sampled_divergence(
    logq_T: torch.Tensor,
    teacher_logp_T: torch.Tensor,
    kind: str = "reverse_kl",
    group_offset_T: torch.Tensor | None = None,
    context_parallel=None,
    ratio_clip: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(surrogate_T, divergence_T)``: the per-token loss whose gradient is the sampled estimate of the gradient of
    ``kind`` (``SAMPLED_KINDS``), and the divergence's estimate (a group's spread over its student tokens in
    proportion to each token's share: they sum to the group's). ``teacher_logp_T``: ``log p`` of each token, or with
    ``group_offset_T`` of its group (the same value at every token of a group). ``ratio_clip``: ``forward_kl``'s cap
    on ``p/q`` in the weight (0: none). ``context_parallel``: see ``group_sums``."""
    if kind not in SAMPLED_KINDS:
        raise ValueError(f"the sampled loss estimates {' or '.join(SAMPLED_KINDS)}, not {kind!r}")
    logq_group_T = group_sums(logq_T.detach(), group_offset_T, context_parallel)
    log_ratio_T = logq_group_T - teacher_logp_T.to(logq_T.dtype)
    if kind == "reverse_kl":
        weight_T, divergence_T = log_ratio_T, log_ratio_T
    else:  # in float64, the exponent capped: p/q overflows float32 where log q is far below log p
        ratio_T = torch.exp((-log_ratio_T.double()).clamp(max=_MAX_LOG_RATIO))
        weight_T = (1.0 - (ratio_T.clamp(max=ratio_clip) if ratio_clip > 0 else ratio_T)).to(logq_T.dtype)
        divergence_T = (ratio_T * -log_ratio_T.double() - ratio_T + 1.0).to(logq_T.dtype)
    surrogate_T = weight_T * logq_T
    if group_offset_T is None:
        return surrogate_T, divergence_T
    size_T = group_sums(torch.ones_like(logq_T.detach()), group_offset_T, context_parallel)
    return surrogate_T, divergence_T / size_T
