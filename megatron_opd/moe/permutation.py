"""Token permutation for grouped expert GEMMs from ``[tokens, k]`` expert indices, with no host sync.

Megatron-Core's local dispatcher permutes with ``masked_select`` over a dense ``[tokens, experts]`` map and copies
the tokens per expert to the host (``.cpu()``), both device-to-host syncs. One stable sort of the ``T * K`` chosen
experts gives the same order (expert by expert, tokens ascending within an expert) and ``searchsorted`` each expert's
end row, which ``torch._grouped_mm`` takes as its offsets: nothing reads a size on the host.

Legend: ``T`` tokens, ``K`` experts per token, ``R = T * K`` permuted rows, ``L`` local experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class Permutation:
    """Where each of the ``R`` permuted rows comes from, and where each local expert's rows end."""

    tokens_R: torch.Tensor
    """The token (row of the un-permuted input) of each permuted row."""
    slots_R: torch.Tensor
    """The position in the flattened ``[T, K]`` routing of each permuted row (to pick its probability)."""
    offsets_L: torch.Tensor
    """int32 end row of each local expert (``torch._grouped_mm``'s ``offs``)."""
    local_R: torch.Tensor | None
    """Rows routed to a local expert (None: every expert is local); the others sort after the last local
    expert, which ``torch._grouped_mm`` leaves unwritten."""


@functools.cache
def _expert_ids(num_local: int, device: torch.device) -> torch.Tensor:
    """``arange(num_local)`` on ``device``, made once (a launch per layer and forward otherwise)."""
    return torch.arange(num_local, device=device)


def permutation(experts_TK: torch.Tensor, first_local: int, num_local: int, num_experts: int) -> Permutation:
    """The expert-major permutation of ``experts_TK``'s rows for local experts ``first_local ..
    first_local + num_local - 1`` of ``num_experts``."""
    k = experts_TK.shape[1]
    flat_R = experts_TK.reshape(-1)
    if num_local == num_experts:
        key_R = flat_R
    else:  # other ranks' experts sort last, as local expert ``num_local``
        key_R = flat_R - first_local
        key_R = key_R.masked_fill((key_R < 0) | (key_R >= num_local), num_local)
    sorted_R, slots_R = torch.sort(key_R, stable=True)
    experts_L = _expert_ids(num_local, flat_R.device)
    offsets_L = torch.searchsorted(sorted_R, experts_L, right=True, out_int32=True)
    local_R = None if num_local == num_experts else sorted_R < num_local
    return Permutation(torch.div(slots_R, k, rounding_mode="floor"), slots_R, offsets_L, local_R)


def permute(hidden_TH: torch.Tensor, probs_TK: torch.Tensor, perm: Permutation) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows_RH, probs_R)``: the input rows and their routing probabilities in permuted order."""
    rows_RH = hidden_TH.index_select(0, perm.tokens_R)
    probs_R = probs_TK.reshape(-1).index_select(0, perm.slots_R)
    if perm.local_R is not None:
        # Rows the grouped GEMMs skip: their outputs and input gradients are left unwritten (any bits), so neither
        # their input nor their probability may take a gradient from them.
        rows_RH = torch.where(perm.local_R.unsqueeze(-1), rows_RH, 0)
        probs_R = torch.where(perm.local_R, probs_R, 0)
    return rows_RH, probs_R


def unpermute(rows_RH: torch.Tensor, perm: Permutation, num_tokens: int) -> torch.Tensor:
    """``[T, H]``: each token's permuted rows summed back (Megatron's ``unpermute`` without probabilities)."""
    if perm.local_R is not None:
        rows_RH = torch.where(perm.local_R.unsqueeze(-1), rows_RH, 0)
    out_TH = rows_RH.new_zeros(num_tokens, rows_RH.shape[-1])
    return out_TH.index_add_(0, perm.tokens_R, rows_RH)
