"""Per-chunk work of the vocab-parallel divergence losses in plain torch: the reference, and the CPU path.

The losses (``megatron_opd.losses.dense`` / ``topk``) loop over chunks of tokens and, for each chunk, need a few
per-token numbers from the local ``[chunk, V/TP]`` shard (maxima, sums of exponentials, weighted partial sums) and,
in backward, the shard's gradient. Those are the only steps that touch ``V``-sized data, so they sit behind one
small interface (``LocalOps``): ``TorchLocalOps`` here runs anywhere, and ``divergence_triton.TritonLocalOps`` fuses
each step into one pass over the shard on CUDA. Nothing in ``kernels/`` imports the package.

All partial sums are taken relative to the chunk's own maxima made finite, so the caller can rescale them to the
global maxima after an all-reduce.

What makes the CPU path fast (measured in ``benchmarks/bench_loss.py``): the exponential dominates, and on x86
Sleef's ``exp2`` runs about 4x faster than its ``exp``, so float32 chunks use ``exp2(x log2 e)`` (the extra
rounding of the product is of the size of ``exp``'s own float32 conditioning, ``|x| 2^-24``); chunks of about 1M
elements stay in cache, so each extra elementwise step costs little; and with an in-place backward the student's
chunk is overwritten in forward by its exponentials (the *stash*), so backward is one multiply instead of a second
exponential (``supports_stash``).

Shape legend: ``C`` tokens in the chunk, ``V`` valid local vocabulary columns, ``K`` teacher top-k ids.
Inputs ``s`` (student) and ``t`` (teacher) are raw logits in their own dtype; ``inv_ts``/``inv_tt`` are the
reciprocal temperatures; maths runs in float64 for float64 students and float32 otherwise.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

KIND_CODES: dict[str, int] = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
LOG2E = 1.0 / math.log(2.0)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LocalOps(Protocol):
    """What a back end provides; every method works on one chunk of rows of the local shard."""

    name: str
    supports_stash: bool
    """Whether ``dense_stats`` / ``topk_stats`` can leave the student's exponentials in its chunk (``stash``)."""

    def chunk_elements(self, device: torch.device) -> int:
        """Automatic chunking picks about this many ``chunk x V`` elements per chunk on ``device``."""
        ...

    def release(self) -> None:
        """Free any scratch memory kept between chunks (called after each forward and backward)."""
        ...

    def dense_stats(
        self, s_CV: torch.Tensor, t_CV: torch.Tensor, inv_ts: float, inv_tt: float, kind: str, stash: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``max_C2`` (student, teacher max of scaled logits) and ``sums_C3``: student and teacher sums of
        ``exp(x - max)`` and, for ``forward_kl``, ``A = sum exp(u - mt) ((u - mt) - (z - ms))`` (for ``reverse_kl``
        the same with student and teacher swapped; 0 for ``jsd``), ``z``/``u`` the scaled student/teacher logits.
        ``stash`` (``forward_kl`` only): overwrite ``s_CV`` with ``exp(z - ms)``."""
        ...

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
        """Return ``sums_C2``: the local parts of KL(P || M) and KL(Q || M) given the global log-normalisers."""
        ...

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
        """Write d(loss)/d(student logits) into ``out_CV`` (which may alias ``s_CV``). ``coef_C`` is the per-token
        reverse KL (``reverse_kl``) or KL(Q || M) (``jsd``); ``grad_C`` the upstream gradient of each token's loss."""
        ...

    def dense_grad_stashed(
        self, e_CV: torch.Tensor, t_CV: torch.Tensor, inv_tt: float, q_scale_C: torch.Tensor, lse_t_C: torch.Tensor,
        scale_C: torch.Tensor,
    ) -> None:  # fmt: skip
        """``forward_kl`` from a stash: ``e_CV <- scale * (q_scale * e - p)``, ``p = exp(u - lse_t)``."""
        ...

    def topk_stats(
        self, s_CV: torch.Tensor, inv_ts: float, local_ids_CK: torch.Tensor, need_tail: bool, stash: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``max_C``, ``sums_C2`` (sum of ``exp(z - max)`` over all columns and over the columns *not* in
        the top-k, the latter 0 unless ``need_tail``) and ``z_CK``: the scaled logit at each top-k id held on this
        rank, 0 for ids that are not (``local_ids_CK == -1``). ``stash``: overwrite ``s_CV`` with ``exp(z - max)``,
        0 at the top-k columns."""
        ...

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
        """Write ``inv_ts * (scatter(coef at ids) - q * coef_sum)`` into ``out_CV`` (may alias ``s_CV``)."""
        ...

    def topk_grad_stashed(
        self, e_CV: torch.Tensor, inv_ts: float, q_scale_C: torch.Tensor, logq_CK: torch.Tensor,
        local_ids_CK: torch.Tensor, coef_CK: torch.Tensor, coef_sum_C: torch.Tensor,
    ) -> None:  # fmt: skip
        """The same gradient from a stash (``q = q_scale * e`` off the top-k, ``exp(logq_CK)`` at it), in place."""
        ...


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Replace ``-inf`` maxima (rows whose shard holds no finite logit) by 0 so they can be used as a shift."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def exp_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``exp``; float32 on CPU as ``exp2(x log2 e)`` (see the module docstring)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return x.mul_(LOG2E).exp2_()
    return x.exp_()


def _zero_nans_(x_CV: torch.Tensor) -> torch.Tensor:
    """In place, NaN -> 0: the ``0 * inf`` of a zero-probability term counts as 0 (one pass, unlike a mask)."""
    return torch.nan_to_num_(x_CV, nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _scaled_in_place(x_CV: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    return x_CV if inv_temperature == 1.0 else x_CV.mul_(inv_temperature)


def _local_positions(local_ids_CK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, picked)`` of the top-k ids held on this rank: ``x[rows, cols]`` are their shard entries and
    ``y_CK[picked]`` the matching ``[C, K]`` entries (ids held elsewhere are left out, never redirected)."""
    picked_CK = local_ids_CK >= 0
    rows, ks = picked_CK.nonzero(as_tuple=True)
    return rows, local_ids_CK[rows, ks], picked_CK


class TorchLocalOps:
    """Reference implementation in plain torch; its temporaries are a few chunk-sized scratch buffers.

    The buffers are reused from chunk to chunk and dropped by ``release()`` (the losses call it after each
    forward and backward): a fresh ``[chunk, V]`` tensor per chunk costs page faults whenever the allocator hands
    memory back to the OS, measured 10x the cost of the arithmetic on it. Use one instance per loss call.
    """

    name = "torch"
    supports_stash = True

    def __init__(self) -> None:
        self._scratch: dict[str, torch.Tensor] = {}

    def release(self) -> None:
        """Free the scratch buffers."""
        self._scratch.clear()

    def _buffer(self, slot: str, like_CV: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = like_CV.shape
        buf = self._scratch.get(slot)
        if buf is None or buf.dtype != dtype or buf.device != like_CV.device or buf.numel() < rows * cols:
            buf = self._scratch[slot] = torch.empty(rows * cols, dtype=dtype, device=like_CV.device)
        return buf[: rows * cols].view(rows, cols)

    def _scaled(self, slot: str, x_CV: torch.Tensor, inv_temperature: float, dtype: torch.dtype) -> torch.Tensor:
        """``x / T`` in ``dtype``, in scratch buffer ``slot`` (never a view of the input)."""
        out_CV = self._buffer(slot, x_CV, dtype)
        if x_CV.dtype == dtype:
            return torch.mul(x_CV, inv_temperature, out=out_CV)
        return _scaled_in_place(out_CV.copy_(x_CV), inv_temperature)

    def chunk_elements(self, device: torch.device) -> int:
        # CPU: ~1M elements (4 MiB per float32 buffer) stays in cache, measured ~2x faster than 16M-element chunks.
        # GPU: large chunks amortise kernel launches; 64M elements is 256 MiB per buffer.
        return 1 << 20 if device.type == "cpu" else 1 << 26

    def dense_stats(
        self, s_CV: torch.Tensor, t_CV: torch.Tensor, inv_ts: float, inv_tt: float, kind: str, stash: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cd = compute_dtype(s_CV.dtype)
        zs_CV = _scaled_in_place(s_CV, inv_ts) if stash else self._scaled("a", s_CV, inv_ts, cd)
        ut_CV = self._scaled("b", t_CV, inv_tt, cd)
        max_C2 = torch.stack([zs_CV.amax(dim=1), ut_CV.amax(dim=1)], dim=1)
        shift_C2 = finite_or_zero(max_C2)
        zs_CV.sub_(shift_C2[:, 0:1])  # z - ms
        ut_CV.sub_(shift_C2[:, 1:2])  # u - mt
        sums_C3 = torch.zeros(s_CV.shape[0], 3, dtype=cd, device=s_CV.device)
        if kind == "jsd":
            sums_C3[:, 0] = exp_(zs_CV).sum(dim=1)
            sums_C3[:, 1] = exp_(ut_CV).sum(dim=1)
            return max_C2, sums_C3
        # forward_kl weighs (u - mt) - (z - ms) by the teacher, reverse_kl weighs its negation by the student.
        weighted_CV, other_CV = (ut_CV, zs_CV) if kind == "forward_kl" else (zs_CV, ut_CV)
        diff_CV = torch.sub(weighted_CV, other_CV, out=self._buffer("c", s_CV, cd))
        w_CV = exp_(weighted_CV)
        sums_C3[:, 2] = _zero_nans_(diff_CV.mul_(w_CV)).sum(dim=1)  # 0 * inf where w == 0
        weight_sum_C = w_CV.sum(dim=1)
        other_sum_C = exp_(other_CV).sum(dim=1)  # for forward_kl with stash this leaves exp(z - ms) in s_CV
        if kind == "forward_kl":
            sums_C3[:, 0], sums_C3[:, 1] = other_sum_C, weight_sum_C
        else:
            sums_C3[:, 0], sums_C3[:, 1] = weight_sum_C, other_sum_C
        return max_C2, sums_C3

    def _log_mixture(self, logp_CV: torch.Tensor, logq_CV: torch.Tensor, beta: float, slot: str) -> torch.Tensor:
        """``log(beta p + (1 - beta) q) = log beta + logaddexp(log p, log q + log((1 - beta) / beta))`` in scratch
        buffer ``slot``; the inputs are left as they are."""
        shifted_CV = torch.add(
            logq_CV, math.log1p(-beta) - math.log(beta), out=self._buffer(slot, logq_CV, logq_CV.dtype)
        )
        return torch.logaddexp(logp_CV, shifted_CV, out=shifted_CV).add_(math.log(beta))

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
        cd = compute_dtype(s_CV.dtype)
        logq_CV = self._scaled("a", s_CV, inv_ts, cd).sub_(lse_s_C[:, None])
        logp_CV = self._scaled("b", t_CV, inv_tt, cd).sub_(lse_t_C[:, None])
        logm_CV = self._log_mixture(logp_CV, logq_CV, beta, "c")
        sums_C2 = torch.empty(s_CV.shape[0], 2, dtype=cd, device=s_CV.device)
        for col, logw_CV in enumerate((logp_CV, logq_CV)):
            term_CV = torch.sub(logw_CV, logm_CV, out=self._buffer("d", s_CV, cd))
            sums_C2[:, col] = _zero_nans_(term_CV.mul_(exp_(logw_CV))).sum(dim=1)
        return sums_C2

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
        cd = compute_dtype(s_CV.dtype)
        logq_CV = self._scaled("a", s_CV, inv_ts, cd).sub_(lse_s_C[:, None])
        logp_CV = self._scaled("b", t_CV, inv_tt, cd).sub_(lse_t_C[:, None])
        if kind == "forward_kl":
            g_CV = exp_(logq_CV).sub_(exp_(logp_CV))  # q - p
        else:
            q_CV = exp_(self._buffer("c", s_CV, cd).copy_(logq_CV))
            if kind == "reverse_kl":
                # d/dz_j KL(q||p) = q_j (log q_j - log p_j - KL(q||p))
                ratio_CV = logq_CV.sub_(logp_CV)
            else:
                # d/dz_j JSD = (1 - beta) q_j (log q_j - log m_j - KL(q||m))
                ratio_CV = logq_CV.sub_(self._log_mixture(logp_CV, logq_CV, beta, "d")).mul_(1.0 - beta)
                coef_C = coef_C * (1.0 - beta)
            g_CV = _zero_nans_(ratio_CV.sub_(coef_C[:, None]).mul_(q_CV))
        torch.mul(g_CV, (grad_C.to(cd) * inv_ts)[:, None], out=out_CV)  # out may alias s: it was read above

    def dense_grad_stashed(
        self, e_CV: torch.Tensor, t_CV: torch.Tensor, inv_tt: float, q_scale_C: torch.Tensor, lse_t_C: torch.Tensor,
        scale_C: torch.Tensor,
    ) -> None:  # fmt: skip
        p_CV = exp_(self._scaled("b", t_CV, inv_tt, e_CV.dtype).sub_(lse_t_C[:, None])).mul_(scale_C[:, None])
        e_CV.mul_((q_scale_C * scale_C)[:, None]).sub_(p_CV)

    def topk_stats(
        self, s_CV: torch.Tensor, inv_ts: float, local_ids_CK: torch.Tensor, need_tail: bool, stash: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cd = compute_dtype(s_CV.dtype)
        rows, cols, picked_CK = _local_positions(local_ids_CK)
        z_CV = _scaled_in_place(s_CV, inv_ts) if stash else self._scaled("a", s_CV, inv_ts, cd)
        z_CK = torch.zeros(local_ids_CK.shape, dtype=cd, device=s_CV.device)
        z_CK[picked_CK] = z_CV[rows, cols]
        max_C = z_CV.amax(dim=1)
        shift_C = finite_or_zero(max_C)
        e_CV = exp_(z_CV.sub_(shift_C[:, None]))
        # The top-k columns are zeroed, so the sum is the exact tail (no 1 - sum cancellation) and the total adds
        # their exponentials back.
        e_CV[rows, cols] = 0.0
        tail_C = e_CV.sum(dim=1)
        e_CK = torch.where(picked_CK, torch.exp(z_CK - shift_C[:, None]), torch.zeros((), dtype=cd))
        sums_C2 = torch.stack([tail_C + e_CK.sum(dim=1), tail_C if need_tail else torch.zeros_like(tail_C)], dim=1)
        return max_C, sums_C2, z_CK

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
        cd = compute_dtype(s_CV.dtype)
        rows, cols, picked_CK = _local_positions(local_ids_CK)
        logq_CV = self._scaled("a", s_CV, inv_ts, cd).sub_(lse_s_C[:, None])
        logq_CK = logq_CV[rows, cols]
        torch.mul(exp_(logq_CV), (-coef_sum_C * inv_ts)[:, None], out=out_CV)  # out may alias s: it was read above
        out_CV[rows, cols] = ((coef_CK[picked_CK] - torch.exp(logq_CK) * coef_sum_C[rows]) * inv_ts).to(out_CV.dtype)

    def topk_grad_stashed(
        self, e_CV: torch.Tensor, inv_ts: float, q_scale_C: torch.Tensor, logq_CK: torch.Tensor,
        local_ids_CK: torch.Tensor, coef_CK: torch.Tensor, coef_sum_C: torch.Tensor,
    ) -> None:  # fmt: skip
        rows, cols, picked_CK = _local_positions(local_ids_CK)
        e_CV.mul_((-coef_sum_C * inv_ts * q_scale_C)[:, None])  # the stash is 0 at the top-k columns
        e_CV[rows, cols] = (coef_CK[picked_CK] - torch.exp(logq_CK[picked_CK]) * coef_sum_C[rows]) * inv_ts
