"""The sliding window's attention mask, shared by the attention module and context parallelism's attention."""

from __future__ import annotations

import torch


def window_mask(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """``[queries, keys]`` boolean mask (True = attends), bottom-right aligned: query ``i`` sits at key position
    ``keys - queries + i`` and sees itself and the ``window`` keys before it."""
    position = torch.arange(queries, device=device)[:, None] + (keys - queries)
    key = torch.arange(keys, device=device)[None, :]
    return (key <= position) & (key >= position - window)
