"""Dtypes by name, in one place: config values ("bf16", "bfloat16"), torch's own names (Hugging Face
``config.json``'s ``torch_dtype``, vLLM's weight-update info), safetensors codes ("BF16"); and the record of a
tensor that is planned, streamed or written before its data exists."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CONFIG_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
"""What a config (``build.dtype``, ``--dtype``, ``torch_dtype``) may name."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors header code -> torch dtype."""

_SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (likewise fp16, fp32)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in CONFIG_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(CONFIG_DTYPES)}, got {name!r}")
    return CONFIG_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name without the prefix: ``torch.bfloat16`` -> ``"bfloat16"`` (``config.json``'s ``torch_dtype``)."""
    return str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"BF16"``."""
    if dtype not in _SAFETENSORS_CODES:
        raise ValueError(f"{dtype} has no safetensors code (known: {sorted(SAFETENSORS_DTYPES)})")
    return _SAFETENSORS_CODES[dtype]


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and full shape of one tensor: what a plan (safetensors shards, weight-sync buckets) needs."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize
