"""Fused Triton kernels for the vocab-parallel divergence losses (CUDA only; import-guarded).

The torch reference (``divergence_torch.TorchLocalOps``) materialises a few ``[chunk, V]``
temporaries per step. These kernels do each step in one pass over a row of the logit shard, keeping only running
per-row scalars (online softmax: running max, rescaled sum of exponentials and rescaled weighted sums), so the
loss reads the shard once in forward (twice for ``jsd``, which needs the global normalisers before its sums) and
once in backward, and writes the gradient once. They implement the same ``LocalOps`` interface, so the chunk loop
and the per-token all-reduces in ``megatron_opd.losses`` are shared with the CPU path.

Nothing here imports Megatron. Without triton (or on a CPU machine) ``triton_available()`` is False and the losses
use the torch path. float64 inputs are delegated to the torch path (the kernels compute in float32).

Shape legend: ``C`` rows (tokens) in the chunk, ``V`` valid local vocabulary columns, ``K`` top-k ids.
"""

from __future__ import annotations

import math
import os

import torch

try:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

from .divergence_torch import KIND_CODES, TorchLocalOps

_BLOCK = 4096
_NUM_WARPS = 8


def triton_available() -> bool:
    """True when triton imports and a CUDA device is visible."""
    return triton is not None and torch.cuda.is_available()


def triton_usable_on(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA, or any device under ``TRITON_INTERPRET=1`` (tests only)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _dense_stats_kernel(
        s_ptr,
        t_ptr,
        out_ptr,
        stride_s,
        stride_t,
        n_cols,
        inv_ts,
        inv_tt,
        KIND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per row: online max / sum-exp for student (z) and teacher (u), plus for the KLs the weighted
        # sum A = sum w ((x - mx) - (y - my)) relative to the running maxima (x, w from the weighting side).
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * stride_s
        t_row = t_ptr + row * stride_t
        ms = float("-inf")
        mt = float("-inf")
        sum_s = 0.0
        sum_t = 0.0
        acc = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_ts
            u = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_tt
            ms_new = tl.maximum(ms, tl.max(z, axis=0))
            mt_new = tl.maximum(mt, tl.max(u, axis=0))
            ms_sh = tl.where(ms_new > float("-inf"), ms_new, 0.0)
            mt_sh = tl.where(mt_new > float("-inf"), mt_new, 0.0)
            ms_sh_old = tl.where(ms > float("-inf"), ms, 0.0)
            mt_sh_old = tl.where(mt > float("-inf"), mt, 0.0)
            alpha_s = tl.exp(ms - ms_sh)  # 0 while nothing finite was seen (then sum_s == acc == 0)
            alpha_t = tl.exp(mt - mt_sh)
            zs = z - ms_sh
            ut = u - mt_sh
            ez = tl.exp(zs)
            eu = tl.exp(ut)
            if KIND == 0:
                part = tl.sum(tl.where(eu > 0, eu * (ut - zs), 0.0), axis=0)
                acc = alpha_t * (acc + sum_t * ((mt_sh_old - mt_sh) - (ms_sh_old - ms_sh))) + part
            elif KIND == 1:
                part = tl.sum(tl.where(ez > 0, ez * (zs - ut), 0.0), axis=0)
                acc = alpha_s * (acc + sum_s * ((ms_sh_old - ms_sh) - (mt_sh_old - mt_sh))) + part
            sum_s = sum_s * alpha_s + tl.sum(ez, axis=0)
            sum_t = sum_t * alpha_t + tl.sum(eu, axis=0)
            ms = ms_new
            mt = mt_new
        out_row = out_ptr + row * 5
        tl.store(out_row + 0, ms)
        tl.store(out_row + 1, mt)
        tl.store(out_row + 2, sum_s)
        tl.store(out_row + 3, sum_t)
        if KIND != 2:  # jsd has no weighted sum; the wrapper's buffer is zero there
            tl.store(out_row + 4, acc)

    @triton.jit
    def _log_mixture(logp, logq, log_beta, log_1m_beta):
        a = logp + log_beta
        b = logq + log_1m_beta
        hi = tl.maximum(a, b)
        lo = tl.minimum(a, b)
        return hi + tl.log(1.0 + tl.exp(lo - hi))

    @triton.jit
    def _dense_jsd_kernel(
        s_ptr,
        t_ptr,
        lse_s_ptr,
        lse_t_ptr,
        out_ptr,
        stride_s,
        stride_t,
        n_cols,
        inv_ts,
        inv_tt,
        log_beta,
        log_1m_beta,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * stride_s
        t_row = t_ptr + row * stride_t
        lse_s = tl.load(lse_s_ptr + row)
        lse_t = tl.load(lse_t_ptr + row)
        acc_p = tl.zeros([BLOCK], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            logq = tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_ts - lse_s
            logp = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_tt - lse_t
            logm = _log_mixture(logp, logq, log_beta, log_1m_beta)
            p = tl.exp(logp)
            q = tl.exp(logq)
            acc_p += tl.where(p > 0, p * (logp - logm), 0.0)
            acc_q += tl.where(q > 0, q * (logq - logm), 0.0)
        tl.store(out_ptr + row * 2 + 0, tl.sum(acc_p, axis=0))
        tl.store(out_ptr + row * 2 + 1, tl.sum(acc_q, axis=0))

    @triton.jit
    def _dense_grad_kernel(
        s_ptr,
        t_ptr,
        out_ptr,
        lse_s_ptr,
        lse_t_ptr,
        coef_ptr,
        scale_ptr,
        stride_s,
        stride_t,
        stride_o,
        n_cols,
        inv_ts,
        inv_tt,
        log_beta,
        log_1m_beta,
        KIND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # grad_z = q - p (forward KL), q (log q - log p - KL) (reverse KL), (1-beta) q (log q - log m - KL(q||m))
        # (jsd); the stored gradient is scale * grad_z with scale = upstream grad / T_student.
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * stride_s
        t_row = t_ptr + row * stride_t
        o_row = out_ptr + row * stride_o
        lse_s = tl.load(lse_s_ptr + row)
        lse_t = tl.load(lse_t_ptr + row)
        coef = tl.load(coef_ptr + row)
        scale = tl.load(scale_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            logq = tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_ts - lse_s
            logp = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_tt - lse_t
            q = tl.exp(logq)
            if KIND == 0:
                g = q - tl.exp(logp)
            elif KIND == 1:
                g = tl.where(q > 0, q * (logq - logp - coef), 0.0)
            else:
                logm = _log_mixture(logp, logq, log_beta, log_1m_beta)
                g = tl.where(q > 0, q * (logq - logm - coef), 0.0)
            tl.store(o_row + cols, (g * scale).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _topk_stats_kernel(
        s_ptr,
        words_ptr,
        out_ptr,
        stride_s,
        stride_w,
        n_cols,
        inv_ts,
        HAS_TAIL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Online max / sum-exp over the row, and the same sum restricted to columns whose bit in the row's
        # top-k bitmask (32 columns per int64 word) is clear: the student's exact tail mass, no 1 - sum.
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * stride_s
        w_row = words_ptr + row * stride_w
        m = float("-inf")
        total = 0.0
        tail = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_ts
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_sh = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m - m_sh)
            e = tl.exp(z - m_sh)
            total = total * alpha + tl.sum(e, axis=0)
            if HAS_TAIL:
                word = tl.load(w_row + cols // 32, mask=mask, other=0)
                bit = (word >> (cols % 32).to(tl.int64)) & 1
                tail = tail * alpha + tl.sum(tl.where(bit == 0, e, 0.0), axis=0)
            m = m_new
        tl.store(out_ptr + row * 3 + 0, m)
        tl.store(out_ptr + row * 3 + 1, total)
        if HAS_TAIL:  # else the wrapper's zero stays
            tl.store(out_ptr + row * 3 + 2, tail)

    @triton.jit
    def _topk_grad_kernel(
        s_ptr,
        out_ptr,
        lse_s_ptr,
        scale_ptr,
        stride_s,
        stride_o,
        n_cols,
        inv_ts,
        BLOCK: tl.constexpr,
    ):
        # The part of the gradient every column shares: -q_j * sum_i c_i / T (scale holds -sum_i c_i / T).
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * stride_s
        o_row = out_ptr + row * stride_o
        lse_s = tl.load(lse_s_ptr + row)
        scale = tl.load(scale_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            q = tl.exp(tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_ts - lse_s)
            tl.store(o_row + cols, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scatter_ids_kernel(out_ptr, ids_ptr, vals_ptr, stride_o, stride_ids, stride_vals, K, BLOCK_K: tl.constexpr):
        # out[row, ids[row, k]] = vals[row, k] for ids held on this rank (id >= 0); other ids are skipped, never
        # redirected to column 0.
        row = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        ids = tl.load(ids_ptr + row * stride_ids + ks, mask=kmask, other=-1)
        valid = kmask & (ids >= 0)
        vals = tl.load(vals_ptr + row * stride_vals + ks, mask=valid, other=0.0)
        tl.store(out_ptr + row * stride_o + ids, vals.to(out_ptr.dtype.element_ty), mask=valid)


def _check_rows(x_CV: torch.Tensor, name: str) -> None:
    if x_CV.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along the vocabulary dimension for the Triton kernels")


def _log_betas(beta: float) -> tuple[float, float]:
    # Only used by jsd, where 0 < beta < 1; other kinds pass placeholders.
    if 0.0 < beta < 1.0:
        return math.log(beta), math.log1p(-beta)
    return 0.0, 0.0


class TritonLocalOps:
    """``LocalOps`` on CUDA with one fused kernel per step; float64 falls back to the torch reference."""

    name = "triton"
    supports_stash = False  # one fused pass recomputes the exponentials as cheaply as it would read a stash

    def chunk_elements(self, device: torch.device) -> int:
        # The kernels keep no [chunk, V] temporaries, so one chunk can hold every token of a realistic batch (and a
        # large grid keeps every SM busy); only the top-k bitmask (V/32 int64 words per row) scales with the chunk.
        return 1 << 34

    def __init__(self) -> None:
        self._torch = TorchLocalOps()  # float64 goes here (the kernels compute in float32)

    def release(self) -> None:
        """Free the float64 path's scratch buffers (the kernels keep none)."""
        self._torch.release()

    def dense_stats(
        self, s_CV: torch.Tensor, t_CV: torch.Tensor, inv_ts: float, inv_tt: float, kind: str, stash: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert not stash, "the Triton path does not stash"  # the losses check supports_stash
        if s_CV.dtype == torch.float64:
            return self._torch.dense_stats(s_CV, t_CV, inv_ts, inv_tt, kind)
        _check_rows(s_CV, "student_logits")
        _check_rows(t_CV, "teacher_logits")
        rows, n_cols = s_CV.shape
        out_C5 = torch.zeros(rows, 5, dtype=torch.float32, device=s_CV.device)
        _dense_stats_kernel[(rows,)](
            s_CV,
            t_CV,
            out_C5,
            s_CV.stride(0),
            t_CV.stride(0),
            n_cols,
            inv_ts,
            inv_tt,
            KIND=KIND_CODES[kind],
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )
        return out_C5[:, 0:2], out_C5[:, 2:5]

    def dense_jsd_sums(
        self,
        s_CV: torch.Tensor,
        t_CV: torch.Tensor,
        inv_ts: float,
        inv_tt: float,
        lse_s_C: torch.Tensor,
        lse_t_C: torch.Tensor,
        beta: float,
    ) -> torch.Tensor:
        if s_CV.dtype == torch.float64:
            return self._torch.dense_jsd_sums(s_CV, t_CV, inv_ts, inv_tt, lse_s_C, lse_t_C, beta)
        rows, n_cols = s_CV.shape
        out_C2 = torch.empty(rows, 2, dtype=torch.float32, device=s_CV.device)
        log_beta, log_1m_beta = _log_betas(beta)
        _dense_jsd_kernel[(rows,)](
            s_CV,
            t_CV,
            lse_s_C.float().contiguous(),
            lse_t_C.float().contiguous(),
            out_C2,
            s_CV.stride(0),
            t_CV.stride(0),
            n_cols,
            inv_ts,
            inv_tt,
            log_beta,
            log_1m_beta,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )
        return out_C2

    def dense_grad(
        self,
        s_CV: torch.Tensor,
        t_CV: torch.Tensor,
        inv_ts: float,
        inv_tt: float,
        lse_s_C: torch.Tensor,
        lse_t_C: torch.Tensor,
        coef_C: torch.Tensor,
        grad_C: torch.Tensor,
        kind: str,
        beta: float,
        out_CV: torch.Tensor,
    ) -> None:
        if s_CV.dtype == torch.float64:
            return self._torch.dense_grad(
                s_CV, t_CV, inv_ts, inv_tt, lse_s_C, lse_t_C, coef_C, grad_C, kind, beta, out_CV
            )
        _check_rows(out_CV, "the gradient buffer")
        rows, n_cols = s_CV.shape
        scale_C = grad_C.float() * inv_ts
        if kind == "jsd":
            scale_C = scale_C * (1.0 - beta)
        log_beta, log_1m_beta = _log_betas(beta)
        _dense_grad_kernel[(rows,)](
            s_CV,
            t_CV,
            out_CV,
            lse_s_C.float().contiguous(),
            lse_t_C.float().contiguous(),
            coef_C.float().contiguous(),
            scale_C.contiguous(),
            s_CV.stride(0),
            t_CV.stride(0),
            out_CV.stride(0),
            n_cols,
            inv_ts,
            inv_tt,
            log_beta,
            log_1m_beta,
            KIND=KIND_CODES[kind],
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )

    def topk_stats(
        self, s_CV: torch.Tensor, inv_ts: float, local_ids_CK: torch.Tensor, need_tail: bool, stash: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert not stash, "the Triton path does not stash"
        if s_CV.dtype == torch.float64:
            return self._torch.topk_stats(s_CV, inv_ts, local_ids_CK, need_tail)
        _check_rows(s_CV, "student_logits")
        rows, n_cols = s_CV.shape
        local_CK = local_ids_CK >= 0
        ids_CK = local_ids_CK.clamp(min=0)
        z_CK = torch.where(local_CK, s_CV.gather(1, ids_CK).float() * inv_ts, 0.0)
        n_words = (n_cols + 31) // 32
        if need_tail:
            # Ids are distinct per row (validated), so adding their bits is the same as or-ing them.
            words_CW = torch.zeros(rows, n_words + 1, dtype=torch.int64, device=s_CV.device)
            word_CK = torch.where(local_CK, ids_CK // 32, n_words)
            bit_CK = torch.where(local_CK, torch.bitwise_left_shift(torch.ones_like(ids_CK), ids_CK % 32), 0)
            words_CW.scatter_add_(1, word_CK, bit_CK)
        else:
            words_CW = torch.zeros(rows, 1, dtype=torch.int64, device=s_CV.device)
        out_C3 = torch.zeros(rows, 3, dtype=torch.float32, device=s_CV.device)
        _topk_stats_kernel[(rows,)](
            s_CV,
            words_CW,
            out_C3,
            s_CV.stride(0),
            words_CW.stride(0),
            n_cols,
            inv_ts,
            HAS_TAIL=need_tail,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )
        return out_C3[:, 0], out_C3[:, 1:3], z_CK

    def topk_grad(
        self,
        s_CV: torch.Tensor,
        inv_ts: float,
        lse_s_C: torch.Tensor,
        local_ids_CK: torch.Tensor,
        coef_CK: torch.Tensor,
        coef_sum_C: torch.Tensor,
        out_CV: torch.Tensor,
    ) -> None:
        if s_CV.dtype == torch.float64:
            return self._torch.topk_grad(s_CV, inv_ts, lse_s_C, local_ids_CK, coef_CK, coef_sum_C, out_CV)
        _check_rows(out_CV, "the gradient buffer")
        rows, n_cols = s_CV.shape
        lse_s_C = lse_s_C.float().contiguous()
        coef_sum_C = coef_sum_C.float()
        # The top-k columns' values are taken from the logits before the shared pass may overwrite them in place.
        ids_CK = local_ids_CK.clamp(min=0)
        q_CK = torch.exp(s_CV.gather(1, ids_CK).float() * inv_ts - lse_s_C[:, None])
        vals_CK = ((coef_CK.float() - q_CK * coef_sum_C[:, None]) * inv_ts).contiguous()
        scale_C = (-coef_sum_C * inv_ts).contiguous()
        _topk_grad_kernel[(rows,)](
            s_CV,
            out_CV,
            lse_s_C,
            scale_C,
            s_CV.stride(0),
            out_CV.stride(0),
            n_cols,
            inv_ts,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )
        ids_CK = local_ids_CK.contiguous()
        block_k = max(16, triton.next_power_of_2(ids_CK.shape[1]))
        _scatter_ids_kernel[(rows,)](
            out_CV,
            ids_CK,
            vals_CK,
            out_CV.stride(0),
            ids_CK.stride(0),
            vals_CK.stride(0),
            ids_CK.shape[1],
            BLOCK_K=block_k,
            num_warps=4,
        )


TRITON_OPS = TritonLocalOps()
