"""Masking and reduction of per-token losses, kept apart from the divergences that produce them.

The divergences return one loss per token; which tokens count (response tokens, not prompt, padding or tool
output) and how they are averaged is a training-recipe choice. ``token_mean`` weights every valid token equally;
``sequence_mean`` weights every sequence equally (averaging within each sequence first); ``sum`` adds them up.
Masked tokens are excluded with ``where``, so a NaN or inf loss at a padding position cannot leak into the result.

For gradient accumulation or data parallelism pass ``normalizer``: the denominator (valid tokens, or sequences)
counted over the whole global batch, so that micro-batch losses add up to the global mean.

Shape legend: ``B`` sequences, ``S`` positions.
"""

from __future__ import annotations

from typing import Literal

import torch

ReductionMode = Literal["token_mean", "sequence_mean", "sum"]
MODES: tuple[str, ...] = ("token_mean", "sequence_mean", "sum")


def reduce_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor | None = None,
    mode: ReductionMode = "token_mean",
    *,
    normalizer: float | torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    sequence_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    Args:
        per_token_loss: ``[tokens]`` or ``[batch, seq]`` (``sequence_mean`` needs ``[..., seq]``: the last dim
            is the sequence).
        mask: same shape; bool (``True`` = counts) or float weights. ``None`` counts every token.
        mode: ``"token_mean"``, ``"sequence_mean"`` or ``"sum"``.
        normalizer: replaces the denominator (the number of valid tokens for ``token_mean``, of sequences with
            at least one valid token for ``sequence_mean``); not allowed with ``sum``.
        segment_ids: same shape, int: the sequence of each token when sequences are packed into one row (THD);
            ``sequence_mean`` then averages within each id instead of along the last dim.
        sequence_weights: ``[batch]`` each sequence's total ``mask`` weight when the rows hold only part of each
            sequence (context parallelism: counted before the split); ``sequence_mean`` divides by it.

    Returns:
        A scalar in the loss's dtype; 0 (with a gradient of zeros) when nothing is valid.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mask is None:
        weight = torch.ones_like(per_token_loss)
    else:
        if mask.shape != per_token_loss.shape:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} must equal per_token_loss shape {tuple(per_token_loss.shape)}"
            )
        weight = mask.to(per_token_loss.dtype)
    weighted = torch.where(weight != 0, per_token_loss * weight, torch.zeros_like(per_token_loss))
    if mode == "sum":
        if normalizer is not None:
            raise ValueError("normalizer has no meaning with mode='sum'; divide the result yourself")
        return weighted.sum()
    if mode == "token_mean":
        denominator = weight.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=weighted.dtype)
        return _safe_divide(weighted.sum(), denominator)
    if segment_ids is not None:
        if segment_ids.shape != per_token_loss.shape:
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must equal {tuple(per_token_loss.shape)}")
        ids = segment_ids.reshape(-1).long()
        count = int(ids.max()) + 1 if ids.numel() else 0
        seq_weight_B = weight.new_zeros(count).index_add(0, ids, weight.reshape(-1))
        seq_sum_B = weighted.new_zeros(count).index_add(0, ids, weighted.reshape(-1))
    elif per_token_loss.dim() < 1:
        raise ValueError("sequence_mean needs per_token_loss shaped [..., seq]")
    else:
        seq_weight_B, seq_sum_B = weight.sum(dim=-1), weighted.sum(dim=-1)
    if sequence_weights is not None:
        seq_weight_B = sequence_weights.to(device=weighted.device, dtype=weighted.dtype)
    seq_mean_B = _safe_divide(seq_sum_B, seq_weight_B)
    has_tokens_B = seq_weight_B != 0
    if normalizer is None:
        denominator = has_tokens_B.sum().to(weighted.dtype)
    else:
        denominator = torch.as_tensor(normalizer, dtype=weighted.dtype)
    return _safe_divide(torch.where(has_tokens_B, seq_mean_B, torch.zeros_like(seq_mean_B)).sum(), denominator)


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0 (no valid token: nothing to learn from)."""
    denominator = denominator.to(device=numerator.device, dtype=numerator.dtype)
    safe = torch.where(denominator != 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator != 0, numerator / safe, torch.zeros_like(numerator))
