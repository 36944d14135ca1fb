"""Quantised checkpoints as they are published, dequantised one tensor at a time on reading: DeepSeek-V3/R1's FP8
blocks and gpt-oss's MXFP4 experts. :func:`quantization_of` is the one parser of ``quantization_config``.

Such a checkpoint stores a linear weight ``W`` ``[out, in]`` as ``torch.float8_e4m3fn`` beside a float32
``<name>_scale_inv`` ``[ceil(out / bo), ceil(in / bi)]`` for ``config.json``'s
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bo, bi], ...}``: every
``bo x bi`` block (partial at the matrix's edges) is ``W.float() * its scale``, as DeepSeek's own
``weight_dequant`` computes it (a float32 product, then cast to the wanted dtype). Which tensors are quantised is
not guessed from their names: a tensor is dequantised iff the checkpoint holds its ``_scale_inv`` companion
(DeepSeek quantises the attention and MLP/expert projections, not norms, embeddings, ``lm_head``, the router).

MXFP4 (``quantization_config = {"quant_method": "mxfp4", ...}``, gpt-oss): a tensor ``W`` is absent and stored as
``W_blocks`` ``[..., rows, G, 16]`` uint8 (two 4-bit e2m1 values a byte, low nibble first: 32 values a block) and
``W_scales`` ``[..., rows, G]`` uint8 (the block's power of two, biased by 127); the value is
``FP4[nibble] * 2 ** (scale - 127)``, and the ``[rows, 32 G]`` matrix is transposed into the parameter's layout
(transformers' ``convert_moe_packed_tensors``; gpt-oss stores its experts' ``[in, out]``).

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
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code (OCP microscaling formats)."""


@dataclass(frozen=True)
class BlockFP8:
    """``quantization_config`` of an FP8 block-quantised checkpoint."""

    block_size: tuple[int, int]
    """``weight_block_size``: rows (output features) and columns (input features) that share one scale."""


@dataclass(frozen=True)
class MXFP4:
    """``quantization_config`` of an MXFP4 checkpoint (gpt-oss's experts): which tensors are quantised is read from
    the checkpoint (a ``_blocks`` / ``_scales`` pair), not from ``modules_to_not_convert``."""


def scale_name(name: str) -> str:
    """The companion holding ``name``'s inverse scales (``...weight`` -> ``...weight_scale_inv``)."""
    return name + SCALE_SUFFIX


def quantization_of(config: dict[str, Any], source: str = "config.json") -> BlockFP8 | MXFP4 | None:
    """The quantisation ``config`` declares; None without ``quantization_config``. Any other method or format is
    refused: only DeepSeek's ``fp8`` / ``e4m3`` / dynamic-activation blocks and gpt-oss's ``mxfp4`` are dequantised
    here."""
    quant = config.get(QUANTIZATION_CONFIG)
    if quant is None:
        return None
    fix = (
        "megatron-opd dequantises only DeepSeek-V3/R1's FP8 block format (quant_method fp8, fmt e4m3, "
        "weight_block_size [rows, columns], activation_scheme dynamic) and gpt-oss's quant_method mxfp4; dequantise "
        "the checkpoint to bf16 first (e.g. DeepSeek's inference/fp8_cast_bf16.py) and remove quantization_config "
        "from its config.json"
    )
    if not isinstance(quant, dict):
        raise CheckpointError(f"{source} {QUANTIZATION_CONFIG} must be a JSON object, got {quant!r}; {fix}")
    method = quant.get("quant_method")
    if method == "mxfp4":
        return MXFP4()
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


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "weight"
) -> torch.Tensor:
    """``blocks`` ``[..., rows, G, 16]`` (uint8) and ``scales`` ``[..., rows, G]`` (uint8) as the ``[..., 32 G, rows]``
    tensor of ``dtype`` they encode (transposed as transformers loads gpt-oss's experts). Computed in float32 (every
    value is exact there and in bf16 unless a scale under- or overflows it), then cast."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(
            f"{name}{BLOCKS_SUFFIX} / {name}{SCALES_SUFFIX} must be uint8 (MXFP4), got {blocks.dtype} / {scales.dtype}"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(
            f"{name}{BLOCKS_SUFFIX} {tuple(blocks.shape)} and {name}{SCALES_SUFFIX} {tuple(scales.shape)} are not an "
            "MXFP4 pair ([..., rows, G, 16] bytes and [..., rows, G] scales); the checkpoint is damaged"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., rows, G, 16, 2]
    values = torch.ldexp(values.flatten(-3), (scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1))
    return values.to(dtype).transpose(-1, -2).contiguous()
