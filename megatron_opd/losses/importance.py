"""Truncated importance weights of a sampled prefix: how much a batch drawn by older weights (the sampler's policy
``mu``) counts under the weights being trained.

With ``d = log p_trainer - log p_sampler`` of each sampled token, a token's weight is ``w_t = exp(sum_{s<t} d_s)``
(``s <= t`` for ``loss.mode=sampled``, whose estimator also samples the token at ``t``), clipped at
``loss.staleness_clip``. The loss applies them with ``loss.staleness_correction=prefix`` and the rollout-fidelity
monitor logs them (``rollout.fidelity``; ``docs/training.md``).

Shape legend: ``B`` samples, ``S`` positions.
"""

from __future__ import annotations

import math

import torch


def prefix_log_ratios(
    trainer_lp_BS: torch.Tensor,
    sampler_lp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    segment_ids_BS: torch.Tensor | None = None,
    *,
    inclusive: bool = False,
) -> torch.Tensor:
    """``[B, S]`` float64: the sum of ``d = log p_trainer - log p_sampler`` over the trained tokens of a sample
    predicted before position ``s`` (and at ``s`` too when ``inclusive``), i.e. the log-ratio of the probabilities
    of the sampled prefix. Each row is one sample, or with ``segment_ids_BS`` (packed rows) each segment."""
    d_BS = torch.where(mask_BS != 0, trainer_lp_BS.double() - sampler_lp_BS.double(), 0.0)
    through_BS = d_BS.cumsum(dim=-1)
    before_BS = through_BS - d_BS
    if segment_ids_BS is not None:  # subtract what the row's earlier segments summed to
        starts_BS = torch.ones_like(segment_ids_BS, dtype=torch.bool)
        starts_BS[..., 1:] = segment_ids_BS[..., 1:] != segment_ids_BS[..., :-1]
        positions_BS = torch.arange(d_BS.shape[-1], device=d_BS.device).expand_as(d_BS)
        first_BS = torch.where(starts_BS, positions_BS, 0).cummax(dim=-1).values
        offset_BS = before_BS.gather(-1, first_BS)
        through_BS, before_BS = through_BS - offset_BS, before_BS - offset_BS
    return through_BS if inclusive else before_BS


def importance_weights(log_ratio_BS: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights ``min(exp(log_ratio), clip)`` (float32) and where the clip applied."""
    truncated_BS = log_ratio_BS > math.log(clip)
    return torch.exp(log_ratio_BS.clamp(max=math.log(clip))).float(), truncated_BS


def prefix_weights(
    trainer_lp_BS: torch.Tensor,
    sampler_lp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    segment_ids_BS: torch.Tensor | None,
    *,
    inclusive: bool,
    clip: float,
    context_parallel=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``importance_weights`` of each trained token's prefix (``prefix_log_ratios``). ``context_parallel``
    (``models.context_parallel.ContextParallelSplit``): the inputs are this rank's chunks of each sequence; a prefix
    spans the ranks' chunks, so it is read along the gathered sequences and the weights split back."""
    columns = (trainer_lp_BS, sampler_lp_BS, mask_BS)
    if context_parallel is not None:
        columns = tuple(context_parallel.gather(c) for c in columns)
    log_ratio_BS = prefix_log_ratios(*columns, segment_ids_BS, inclusive=inclusive)
    if context_parallel is not None:
        log_ratio_BS = context_parallel.split(log_ratio_BS, 1)
    return importance_weights(log_ratio_BS, clip)
