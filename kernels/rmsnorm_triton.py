"""Fused Triton RMSNorm, forward and backward (CUDA only; import-guarded like ``divergence_triton``).

torch's RMSNorm backward reduces the weight gradient over rows with a slow kernel (``GammaBetaBackward``), worst for
Qwen3's QK-norm: [tokens * heads, 128] rows. Here one program normalises a tile of whole rows held in registers; the
backward keeps a per-program fp32 partial of the weight gradient, written to a ``[P, N]`` buffer and summed once
(no atomics, so the gradient is deterministic).

Numerics follow ``torch.nn.functional.rms_norm``: statistics and products in fp32, ``y = x * rsqrt(mean(x^2) + eps)
* w`` rounded once to x's dtype, also for a weight of another dtype (fp32 hidden states with a bf16 weight under
Float16Module give an fp32 output, as torch does); ``eps=None`` is fp32's eps, the eps of torch's compute type (not
of x's dtype). ``dx`` comes in x's dtype, ``dw`` in the weight's.

Shape legend: ``M`` rows (the leading dims flattened), ``N`` normalised width, ``P`` backward programs.
"""

from __future__ import annotations

import torch

from .divergence_triton import tl, triton, triton_usable_on  # one import guard for the package

MAX_N = 8192  # a row is one block in registers; wider rows stay on torch
# Tile sizes picked on an H100 (bf16; N = 128, 2048, 5120, 8192): 4096 elements per program tile
# [BLOCK_M rows, BLOCK_N columns] and a warp per 512 of them were within a few percent of the best per shape.
_TILE = 4096
_ELEMENTS_PER_WARP = 512
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes these: triton on x's device, fp32/bf16/fp16, a 1-D weight as wide as x's rows."""
    return (
        triton_usable_on(x.device)
        and x.dtype in _DTYPES
        and weight.dtype in _DTYPES
        and weight.dim() == 1
        and x.shape[-1] == weight.shape[0] <= MAX_N
    )


if triton is not None:

    @triton.jit
    def _rmsnorm_fwd_kernel(
        x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, n_rows, n_cols, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + rows64 * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)

    @triton.jit
    def _rmsnorm_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_part_ptr,
        stride_dy,
        stride_x,
        n_rows,
        n_cols,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # Program p takes row tiles p, p + P, p + 2P, ...: dx = rstd (dy w - x_hat mean(dy w x_hat)) per row, and
        # its share of dw = sum_rows dy x_hat accumulated in fp32, written to row p of the [P, N] partials.
        pid = tl.program_id(0)
        n_progs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        n_tiles = tl.cdiv(n_rows, BLOCK_M)
        for tile in range(pid, n_tiles, n_progs):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            mask = row_ok[:, None] & col_ok[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            x_hat = x * rstd[:, None]
            wdy = dy * w[None, :]
            c = tl.sum(wdy * x_hat, axis=1) / n_cols
            dx = (wdy - x_hat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64 * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * x_hat, axis=0)
        tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=col_ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [M, N] rows with a contiguous last dim (a view when it can be)."""
    t_MN = t.reshape(-1, t.shape[-1])
    return t_MN if t_MN.stride(-1) == 1 else t_MN.contiguous()


def _tiles(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): whole rows per tile, several short rows (QK-norm) per program."""
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, _TILE // block_n)
    return block_m, block_n, min(16, max(1, block_m * block_n // _ELEMENTS_PER_WARP))


def _num_programs(device: torch.device, n_tiles: int, num_warps: int) -> int:
    """Backward programs: one wave at 16 warps per SM (two waves were no faster, and make more partials to sum)."""
    if device.type != "cuda":  # the interpreter (tests): a few programs, each summing several tiles
        return max(1, min(n_tiles, 4))
    per_sm = max(1, 16 // num_warps)
    return max(1, min(n_tiles, torch.cuda.get_device_properties(device).multi_processor_count * per_sm))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_MN = _rows(x)
        n_rows, n_cols = x_MN.shape
        y_MN = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd_M = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_m, block_n, num_warps = _tiles(n_cols)
        if n_rows:
            _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
                x_MN, weight, y_MN, rstd_M, x_MN.stride(0), n_rows, n_cols, eps,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
            )  # fmt: skip
        ctx.save_for_backward(x_MN, weight, rstd_M)
        return y_MN.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_MN, weight, rstd_M = ctx.saved_tensors
        dy_MN = _rows(dy)
        n_rows, n_cols = x_MN.shape
        block_m, block_n, num_warps = _tiles(n_cols)
        n_progs = _num_programs(x_MN.device, triton.cdiv(n_rows, block_m), num_warps)
        dx_MN = torch.empty((n_rows, n_cols), dtype=x_MN.dtype, device=x_MN.device)
        dw_PN = torch.empty((n_progs, n_cols), dtype=torch.float32, device=x_MN.device)
        _rmsnorm_bwd_kernel[(n_progs,)](
            dy_MN, x_MN, weight, rstd_M, dx_MN, dw_PN, dy_MN.stride(0), x_MN.stride(0), n_rows, n_cols,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
        return dx_MN.view(dy.shape), dw_PN.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """RMSNorm of x's last dim times ``weight``, differentiable in both; see the module doc for the numerics.

    x: [..., N] with N <= ``MAX_N`` (rows may be strided; a non-contiguous last dim is copied first);
    ``supports(x, weight)`` says whether it applies.
    """
    if not supports(x, weight):
        raise ValueError(
            f"rms_norm needs triton on {x.device}, fp32/bf16/fp16 and a 1-D weight as wide as x's last dim "
            f"(at most {MAX_N}); got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    return _RMSNorm.apply(x, weight, torch.finfo(torch.float32).eps if eps is None else float(eps))
