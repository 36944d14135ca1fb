"""FP8 block-quantised checkpoints, as DeepSeek-V3/R1 are published: dequantised one tensor at a time on reading.

Such a checkpoint stores a linear weight ``W`` ``[out, in]`` as ``torch.float8_e4m3fn`` beside a float32
``<name>_scale_inv`` ``[ceil(out / bo), ceil(in / bi)]`` for ``config.json``'s
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bo, bi], ...}``: every
``bo x bi`` block (partial at the matrix's edges) is ``W.float() * its scale``, as DeepSeek's own
``weight_dequant`` computes it (a float32 product, then cast to the wanted dtype). Which tensors are quantised is
not guessed from their names: a tensor is dequantised iff the checkpoint holds its ``_scale_inv`` companion
(DeepSeek quantises the attention and MLP/expert projections, not norms, embeddings, ``lm_head``, the router).
Megatron-opd trains and exports the dequantised weights; an export's ``config.json`` loses ``quantization_config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_opd.model_files import CheckpointError

SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = "quantization_config"
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class BlockFP8:
    """``quantization_config`` of an FP8 block-quantised checkpoint."""

    block_size: tuple[int, int]
    """``weight_block_size``: rows (output features) and columns (input features) that share one scale."""


def scale_name(name: str) -> str:
    """The companion holding ``name``'s inverse scales (``...weight`` -> ``...weight_scale_inv``)."""
    return name + SCALE_SUFFIX


def block_fp8_of(config: dict[str, Any], source: str = "config.json") -> BlockFP8 | None:
    """The FP8 block quantisation ``config`` declares; None without ``quantization_config``. Any other method or
    format is refused: only DeepSeek's ``fp8`` / ``e4m3`` / dynamic-activation blocks are dequantised here."""
    quant = config.get(QUANTIZATION_CONFIG)
    if quant is None:
        return None
    fix = (
        "megatron-opd dequantises only DeepSeek-V3/R1's FP8 block format (quant_method fp8, fmt e4m3, "
        "weight_block_size [rows, columns], activation_scheme dynamic); dequantise the checkpoint to bf16 first "
        "(e.g. DeepSeek's inference/fp8_cast_bf16.py) and remove quantization_config from its config.json"
    )
    if not isinstance(quant, dict):
        raise CheckpointError(f"{source} {QUANTIZATION_CONFIG} must be a JSON object, got {quant!r}; {fix}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{source} {QUANTIZATION_CONFIG}.quant_method={method!r} is not supported; {fix}")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{source} {QUANTIZATION_CONFIG}.fmt={fmt!r} is not supported; {fix}")
    activations = quant.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise CheckpointError(
            f"{source} {QUANTIZATION_CONFIG}.activation_scheme={activations!r} is not supported (static activation "
            f"scales); {fix}"
        )
    block = quant.get("weight_block_size")
    valid = (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not valid:
        raise CheckpointError(
            f"{source} {QUANTIZATION_CONFIG}.weight_block_size={block!r} must be two positive integers [rows, "
            f"columns] (DeepSeek-V3: [128, 128]); per-tensor or per-channel FP8 scales are not supported; {fix}"
        )
    return BlockFP8(block_size=(block[0], block[1]))


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without ``quantization_config``: the weights megatron-opd writes are never quantised."""
    return {k: v for k, v in config.items() if k != QUANTIZATION_CONFIG}


def scale_shape(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, int]:
    """The shape of the inverse scales of a ``shape`` weight: one per block, edge blocks included."""
    return math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1])


def dequantize_block_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype = torch.float32,
    name: str = "weight",
) -> torch.Tensor:
    """``weight`` ``[out, in]`` (float8) times its per-block ``scale_inv``, as ``dtype``.

    One band of ``block_size[0]`` rows at a time, so the float32 intermediate is a band, not the matrix.
    """
    if weight.dim() != 2:
        raise CheckpointError(f"{name} is block-quantised but has shape {tuple(weight.shape)}, not a matrix")
    if weight.dtype != FP8_DTYPE:
        raise CheckpointError(
            f"{name} has a {scale_name('')} companion but dtype {weight.dtype}; FP8 block quantisation stores "
            f"{FP8_DTYPE}"
        )
    expected = scale_shape(tuple(weight.shape), block_size)
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"{scale_name(name)} has shape {tuple(scale_inv.shape)}, but {name} {tuple(weight.shape)} in blocks of "
            f"{list(block_size)} (quantization_config.weight_block_size) needs {expected}; the checkpoint and its "
            "config.json disagree"
        )
    rows, cols = block_size
    out = torch.empty(weight.shape, dtype=dtype)
    scales = scale_inv.float()
    for band in range(expected[0]):
        span = slice(band * rows, (band + 1) * rows)
        per_column = scales[band].repeat_interleave(cols)[: weight.shape[1]]  # [in]
        out[span] = (weight[span].float() * per_column).to(dtype)
    return out
