"""The cross-tokenizer loss on the teacher's top-k mapped to the student's vocabulary (``cross_tokenizer=aligned``).

At the first position of an aligned group (a byte offset where both tokenizations have a boundary) the teacher's
top-k there, each teacher token mapped to the student token its bytes begin with (``cross_tokenizer.VocabularyMap``,
``teacher_to_first``), is a distribution over what the student writes next, minus the mass of teacher tokens that
map to none: the exact top-k divergence (``losses.topk``, any kind and tail; the unmapped mass is in the teacher's
tail) runs there, vocab-parallel on the student's shard (``aligned`` marks those positions; the data path leaves out
those where too little mapped). Every other position takes the sampled group surrogate of ``losses.sampled``, of the
same divergence (``forward_kl`` or ``reverse_kl``; the reverse KL for ``jsd``, which has no sampled form). With
one tokenizer every position is aligned and the loss is the top-k loss.

What it estimates (docs/losses.md, "What the cross-tokenizer losses estimate", measured by enumeration in
``testing.cross_tokenizer_reference``): at a kept group start, the exact per-position divergence between the
student's next-token distribution and the teacher's pushed onto student tokens by first bytes, where teacher mass
that maps to no student token (a token a longer student token extends) is compared, in the tail bucket, with the
student's mass outside the mapped ids; elsewhere the sampled estimate of the fixed-prefix (per-group) divergence.
Where every teacher token maps to the student token that follows it, it has the sampled loss's expectation; where
teacher mass goes to the tail it does not (gradient 37-85% off on the enumerated pairs whose teacher merges across
spaces or splits a character).

The top-k divergence runs on a copy of the aligned rows only, in place; the sampled surrogate reads the label's
log-probability from the logits as they are (neither overwrites what the other needs). Shape legend: ``T`` tokens
(any leading shape, flattened), ``V`` this rank's vocabulary columns, ``K`` top-k slots.
"""

from __future__ import annotations

import torch

from megatron_opd.losses.importance import truncation_ratios
from megatron_opd.losses.sampled import SAMPLED_KINDS, label_logprobs, sampled_divergence
from megatron_opd.losses.topk import topk_divergence


def aligned_divergence(
    logits: torch.Tensor,
    labels: torch.Tensor,
    aligned: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    support: torch.Tensor,
    group_logprobs: torch.Tensor,
    group_offset: torch.Tensor,
    kind: str,
    *,
    vocab_size: int | None,
    student_temperature: float = 1.0,
    context_parallel=None,
    sampled_ratio_clip: float = 0.0,
    drawn_logprobs: torch.Tensor | None = None,
    **topk_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and divergence, the logits' leading shape: top-k where ``aligned``, sampled elsewhere.

    ``topk_ids`` / ``topk_logprobs`` / ``support`` ``[..., K]``: the teacher's top-k in student ids at aligned
    positions (``support`` False: an empty slot). ``group_logprobs`` / ``group_offset``: each position's group
    log-probability under the teacher and the offset to its group's first position (``losses.sampled``).
    ``context_parallel``: the rows are this rank's share of each sequence (``losses.sampled.group_sums``).
    ``sampled_ratio_clip``: the sampled forward KL's cap on ``p/q`` (``losses.sampled.sampled_divergence``).
    ``drawn_logprobs``: truncated sampling, the student's log-probability of each label under the distribution drawn
    from; the sampled positions are weighted by ``losses.importance.truncation_ratios``.
    ``topk_options``: ``topk_divergence``'s ``beta``, ``tail``, ``coverage_weight``, ``chunk_size``.
    """
    lead = logits.shape[:-1]
    logits_TV = logits.reshape(-1, logits.shape[-1])
    aligned_T = aligned.reshape(-1).to(torch.bool)
    rows = aligned_T.nonzero()[:, 0].to(logits.device)
    sampled_rows = int(aligned_T.numel() - rows.numel())
    if sampled_rows:
        logq_T = label_logprobs(logits_TV, labels.reshape(-1), vocab_size=vocab_size, temperature=student_temperature)
        per_token_T, divergence_T = sampled_divergence(
            logq_T.view(lead), group_logprobs.to(logq_T.dtype), kind if kind in SAMPLED_KINDS else "reverse_kl",
            group_offset, context_parallel, ratio_clip=sampled_ratio_clip,
        )  # fmt: skip
        if drawn_logprobs is not None:
            ratio = truncation_ratios(logq_T.view(lead), drawn_logprobs)
            per_token_T, divergence_T = per_token_T * ratio, divergence_T * ratio
        per_token_T, divergence_T = per_token_T.reshape(-1), divergence_T.reshape(-1)
    else:  # one tokenizer: the top-k loss alone, nothing sampled to read
        per_token_T = logits_TV.new_zeros(aligned_T.shape, dtype=torch.float32)
        divergence_T = per_token_T.detach().clone()
    if rows.numel():

        def at_rows(t: torch.Tensor) -> torch.Tensor:  # a copy: the logits' one can take the loss's intermediates
            return t.reshape(-1, *t.shape[len(lead) :]).index_select(0, rows)

        topk_T = topk_divergence(
            at_rows(logits), at_rows(topk_ids), at_rows(topk_logprobs), kind, support_mask=at_rows(support),
            student_temperature=student_temperature, vocab_size=vocab_size, validate=False, inplace_backward=True,
            **topk_options,
        )  # fmt: skip
        per_token_T = per_token_T.to(topk_T.dtype).index_put((rows,), topk_T)
        divergence_T = divergence_T.to(topk_T.dtype).index_put((rows,), topk_T.detach())
    return per_token_T.view(lead), divergence_T.view(lead)
