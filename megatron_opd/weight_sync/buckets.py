"""Packed buckets: how a stream of named tensors travels as a few large byte buffers.

Both ends cut the stream into the same buckets from the same metadata (names, dtypes, shapes) and the same
bucket size, so only the bytes travel per bucket. A bucket holds whole tensors, each at a 64-byte aligned offset
(so it can be viewed in place as its dtype); a tensor larger than the bucket size travels alone in a bucket of its
own size. Sender and receiver therefore hold one bucket at a time, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_opd.dtypes import TensorMeta

ALIGN = 64
DEFAULT_BUCKET_BYTES = 512 << 20  # verl's and slime's bucket size


@dataclass(frozen=True)
class Bucket:
    """Tensors ``[start, stop)`` of the stream at byte ``offsets`` of a buffer of ``nbytes``."""

    start: int
    stop: int
    offsets: tuple[int, ...]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Cut the stream into buckets of at most ``bucket_bytes`` (a bigger tensor gets a bucket of its own)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket size must be >= {ALIGN} bytes, got {bucket_bytes}")
    buckets: list[Bucket] = []
    start, offsets, used = 0, [], 0
    for i, meta in enumerate(metas):
        if offsets and used + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(start, i, tuple(offsets), used))
            start, offsets, used = i, [], 0
        offsets.append(used)
        used = _aligned(used + meta.nbytes)
    if offsets:
        buckets.append(Bucket(start, len(metas), tuple(offsets), used))
    return buckets


def pack(tensors: Sequence[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """One bucket's tensors copied into a fresh ``uint8`` buffer."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for tensor, offset in zip(tensors, bucket.offsets):
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat)
    return buffer


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta], bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of a received bucket's tensors (they share ``buffer``: keep it alive while they are used)."""
    for meta, offset in zip(metas[bucket.start : bucket.stop], bucket.offsets):
        yield meta.name, buffer[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape)


def metas_from_lists(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]):
    """The JSON-safe update info (names, dtype names, shapes) back into ``TensorMeta``s."""
    out = []
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype_name!r}")
        out.append(TensorMeta(name, dtype, tuple(int(s) for s in shape)))
    return out
