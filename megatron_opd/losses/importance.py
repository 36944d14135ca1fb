"""Importance weights of sampled tokens: how much a batch drawn by the sampler's policy ``mu`` counts under the
weights being trained (``pi``). Both are the distribution the sampler draws from: with ``rollout.temperature``,
``top_k`` or ``top_p`` the truncated, renormalised one (``rollout.sampling.drawn_logprobs``; a fresh batch then has
``pi = mu`` up to rounding, and weight 1), else the model's own.

With ``d = log pi(y) - log mu(y)`` of each sampled token:

- prefix weights (``loss.staleness_correction=prefix``): ``w_t = exp(sum_{s<t} d_s)`` (``s <= t`` for
  ``loss.mode=sampled``, whose estimator also samples the token at ``t``), clipped at ``loss.staleness_clip``: the
  state distribution of a stale batch corrected to the trained weights'. The rollout-fidelity monitor logs them
  (``rollout.fidelity``; ``docs/training.md``).
- rollout corrections (``loss.rollout_correction``, ``ROLLOUT_CORRECTIONS``), at every staleness: ``token_tis``
  ``min(exp(d_t), C)``; ``sequence_tis`` ``min(exp(sum_t d_t), C)`` at every token of the sample; ``token_mis`` /
  ``sequence_mis`` the same ratio where it is ``<= C`` and 0 (the token, or the whole sample, dropped) where it is
  above (masked importance sampling: a token the sampler drew far more often than the trainer would is left out
  rather than capped).

The sampled losses (``losses.sampled``) estimate ``E_q[a(y) grad log q(y)]`` from the student's draws; under
truncation the draws come from ``pi`` instead, so each token's surrogate is multiplied by ``truncation_ratios``'
``q(y)/pi(y)`` (no clip): the expected gradient is then the divergence's gradient less the terms of the tokens the
sampler cannot draw, ``sum_{y in supp(pi)} q(y) a(y) grad log q(y)`` (docs/losses.md; checked by enumeration).

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


TRUNCATED_FLOOR = -1.0e4
"""The log-probability a token gets where the trainer's truncated distribution excludes it (``-inf``): finite, so
sums of log-ratios stay defined, and ``exp`` of it is 0 (the token has weight 0)."""


def truncation_ratios(logq_T: torch.Tensor, drawn_lp_T: torch.Tensor) -> torch.Tensor:
    """``q(y)/pi(y)`` per sampled token (no gradient), 0 where ``pi`` excludes the token (``TRUNCATED_FLOOR``):
    what turns an estimate under the student's own distribution ``q`` into one under the sampler's ``pi``."""
    log_ratio_T = logq_T.detach().double() - drawn_lp_T.double()
    return torch.where(drawn_lp_T > TRUNCATED_FLOOR, torch.exp(log_ratio_T), 0.0).to(logq_T.dtype)


ROLLOUT_CORRECTIONS = ("off", "token_tis", "sequence_tis", "token_mis", "sequence_mis")
"""The values of ``loss.rollout_correction``."""


def sequence_log_ratios(
    trainer_lp_BS: torch.Tensor,
    sampler_lp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    segment_ids_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, S]`` float64: at every position, the sum of ``d`` over all trained tokens of its sample (a row, or
    with ``segment_ids_BS`` each segment of a packed row)."""
    before_BS = prefix_log_ratios(trainer_lp_BS, sampler_lp_BS, mask_BS, segment_ids_BS)
    d_BS = torch.where(mask_BS != 0, trainer_lp_BS.double() - sampler_lp_BS.double(), 0.0)
    to_go_BS = d_BS.flip(-1).cumsum(-1).flip(-1)
    if segment_ids_BS is not None:  # subtract what the row's later segments sum to
        last_BS = torch.ones_like(segment_ids_BS, dtype=torch.bool)
        last_BS[..., :-1] = segment_ids_BS[..., :-1] != segment_ids_BS[..., 1:]
        positions_BS = torch.arange(d_BS.shape[-1], device=d_BS.device).expand_as(d_BS)
        end_BS = torch.where(last_BS, positions_BS, d_BS.shape[-1] - 1).flip(-1).cummin(-1).values.flip(-1)
        to_go_BS = to_go_BS - to_go_BS.gather(-1, end_BS) + d_BS.gather(-1, end_BS)
    return before_BS + to_go_BS


def rollout_correction_weights(
    trainer_lp_BS: torch.Tensor,
    sampler_lp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    segment_ids_BS: torch.Tensor | None,
    *,
    mode: str,
    clip: float,
    context_parallel=None,
) -> torch.Tensor:
    """``[B, S]`` float32 weights of ``loss.rollout_correction`` ``mode`` (see the module docstring; ``off``: 1).
    ``context_parallel``: as for ``prefix_weights`` (a sequence's total spans the ranks' chunks)."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"loss.rollout_correction must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if mode == "off":
        return torch.ones_like(mask_BS, dtype=torch.float32)
    if mode.startswith("token"):
        log_ratio_BS = torch.where(mask_BS != 0, trainer_lp_BS.double() - sampler_lp_BS.double(), 0.0)
    else:
        columns = (trainer_lp_BS, sampler_lp_BS, mask_BS)
        if context_parallel is not None:
            columns = tuple(context_parallel.gather(c) for c in columns)
        log_ratio_BS = sequence_log_ratios(*columns, segment_ids_BS)
        if context_parallel is not None:
            log_ratio_BS = context_parallel.split(log_ratio_BS, 1)
    if mode.endswith("tis"):
        return importance_weights(log_ratio_BS, clip)[0]
    kept_BS = log_ratio_BS <= math.log(clip)
    return torch.where(kept_BS, torch.exp(log_ratio_BS.clamp(max=math.log(clip))), 0.0).float()


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
