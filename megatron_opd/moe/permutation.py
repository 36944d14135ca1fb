"""Token permutation for grouped expert GEMMs from ``[tokens, k]`` expert indices, with no host sync.

Megatron-Core's local dispatcher permutes with ``masked_select`` over a dense ``[tokens, experts]`` map and copies
the tokens per expert to the host (``.cpu()``), both device-to-host syncs. One stable sort of the ``T * K`` chosen
experts gives the same order (expert by expert, tokens ascending within an expert) and ``searchsorted`` each expert's
end row, which ``torch._grouped_mm`` takes as its offsets: nothing reads a size on the host.

The rows themselves are gathered, and summed back, by :mod:`megatron_opd.moe.ops` (one kernel each on CUDA).

Legend: ``T`` tokens, ``K`` experts per token, ``R = T * K`` permuted rows, ``L`` local experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class Permutation:
    """Where each of the ``R`` permuted rows comes from, and where each local expert's rows end."""

    slots_R: torch.Tensor
    """The position in the flattened ``[T, K]`` routing of each permuted row (its token is ``slot // K``)."""
    offsets_L: torch.Tensor
    """int32 end row of each local expert (``torch._grouped_mm``'s ``offs``); rows routed to other ranks' experts
    sort after the last local expert's end, where ``torch._grouped_mm`` leaves them unwritten and
    :mod:`megatron_opd.moe.ops` reads them as zero."""


@functools.cache
def expert_ids(num_local: int, device: torch.device) -> torch.Tensor:
    """``arange(num_local)`` on ``device``, made once (a launch per layer and forward otherwise)."""
    return torch.arange(num_local, device=device)


def permutation(experts_TK: torch.Tensor, first_local: int, num_local: int, num_experts: int) -> Permutation:
    """The expert-major permutation of ``experts_TK``'s rows for local experts ``first_local ..
    first_local + num_local - 1`` of ``num_experts`` (a sort and a ``searchsorted``)."""
    flat_R = experts_TK.reshape(-1)
    # Other ranks' experts sort last: shifted round, local experts are 0 .. num_local - 1, the others above.
    key_R = flat_R if first_local == 0 else torch.remainder(flat_R - first_local, num_experts)
    sorted_R, slots_R = torch.sort(key_R, stable=True)
    offsets_L = torch.searchsorted(sorted_R, expert_ids(num_local, flat_R.device), right=True, out_int32=True)
    return Permutation(slots_R, offsets_L)
