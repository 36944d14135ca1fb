"""Packed micro-batches: sequences end to end in one row with no padding between them (Megatron's THD layout).

A packed micro-batch is ``[1, T]``: its sequences concatenated, then, when a fixed length is asked for, one padding
segment. ``cu_seqlens`` marks where each segment starts (:func:`megatron_opd.models.forward_backward.packed_seq_params`
hands it to attention, which stays within a segment), ``position_ids`` restart at 0 per segment (RoPE), and
``segment_ids`` say which sequence each token belongs to (the padding segment is numbered after the last one).
Every per-position column ``[N, S, ...]`` is concatenated the same way, so a consumer reads the same value at the
same token as in the padded layout. The student update (``TrainBatch.packed_micro_batches``) and teacher scoring
(``InProcessTeacher``) use it; :func:`unpack` maps a packed result back to one row per sequence.

Shape legend: ``N`` sequences, ``S`` padded positions, ``T`` tokens of a packed micro-batch.
"""

from __future__ import annotations

import torch


def group_sequences(
    lengths: list[int], *, per_group: int | None = None, token_budget: int | None = None, field: str = ""
) -> list[list[int]]:
    """Consecutive sequences into micro-batches: ``per_group`` each, or as many as fit ``token_budget`` tokens."""
    if token_budget is None:
        assert per_group is not None, "give per_group or token_budget"
        return [list(range(lo, min(lo + per_group, len(lengths)))) for lo in range(0, len(lengths), per_group)]
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(
                f"a sequence of {n} tokens does not fit {field}={token_budget} (tokens per packed micro-batch); "
                "raise it to at least the longest sequence"
            )
        if used + n > token_budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def pipeline_token_budget(micro_batch_tokens: int | None, micro_batch_size: int, seq_len: int) -> int | None:
    """Tokens per packed micro-batch: None without pipeline parallelism (each micro-batch its own length), else
    ``micro_batch_tokens`` or ``micro_batch_size`` rows of ``seq_len``, rounded up to a multiple of TP (sequence
    parallelism splits it)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    tp = ps.get_tensor_model_parallel_world_size()
    return micro_batch_tokens or -(-micro_batch_size * seq_len // tp) * tp


def pack(
    lengths: list[int],
    groups: list[list[int]],
    columns: dict[str, torch.Tensor],
    *,
    pad_multiple: int = 1,
    token_budget: int | None = None,
    fills: dict[str, int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """One packed micro-batch per group; ``columns`` are ``[N, S, ...]`` (``tokens`` among them, padding fills 0).

    Each micro-batch is ``T`` = its tokens rounded up to ``pad_multiple`` (sequence parallelism splits ``T`` over
    TP) or exactly ``token_budget`` (pipeline stages exchange activations of one shape). ``fills``: what pads a
    column other than 0.
    """
    out = []
    for group in groups:
        sizes = [lengths[i] for i in group]
        used = sum(sizes)
        total = token_budget if token_budget is not None else -(-max(used, 1) // pad_multiple) * pad_multiple
        pad = total - used
        bounds = [0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()] + ([total] if pad else [])
        i64 = torch.zeros(0, dtype=torch.int64)
        mb = {
            "position_ids": _concat([torch.arange(n) for n in sizes], pad, i64, fill="arange"),
            "segment_ids": _concat([torch.full((n,), j) for j, n in enumerate(sizes)], pad, i64, len(group)),
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
            "max_seqlen": torch.tensor(max([*sizes, pad])),
        }
        for name, value in columns.items():
            fill = (fills or {}).get(name, 0)
            mb[name] = _concat([value[i, :n] for i, n in zip(group, sizes)], pad, value[0, :0], fill)
        out.append(mb)
    return out


def unpack(values_1T: torch.Tensor, sizes: list[int], seq_len: int) -> torch.Tensor:
    """``[1, T, ...]`` -> ``[len(sizes), seq_len, ...]``: each sequence's positions back on its own row.

    Positions past a sequence's end repeat its last position, so every row holds valid values (a distribution, not
    zeros whose log-mass would be NaN); they predict padding, which nothing trains.
    """
    starts = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
    last = torch.tensor(sizes, dtype=torch.int64) - 1
    index_NS = starts[:, None] + torch.minimum(torch.arange(seq_len)[None, :], last[:, None])
    return values_1T[0, index_NS.to(values_1T.device)]


def _concat(pieces: list[torch.Tensor], pad: int, like: torch.Tensor, fill: float | str = 0) -> torch.Tensor:
    """``[1, T, ...]``: the pieces (``[n_i, ...]``, dtype and trailing shape of ``like``) end to end, then ``pad``
    rows of ``fill`` (``"arange"``: 0, 1, ...)."""
    if pad:
        if fill == "arange":
            tail = torch.arange(pad, dtype=like.dtype)
        else:
            tail = torch.full((pad, *like.shape[1:]), fill, dtype=like.dtype)
        pieces = [*pieces, tail]
    return torch.cat([like, *pieces])[None]
