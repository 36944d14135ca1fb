"""Per-chunk work on one rank's logit shard: the torch reference, and the choice between it and the Triton kernels.

The divergence losses (``dense.py``, ``topk.py``) loop over chunks of tokens and, for each chunk, need a few
per-token numbers from the local ``[chunk, V/TP]`` shard (maxima, sums of exponentials, weighted partial sums) and,
in backward, the shard's gradient. Those are the only steps that touch ``V``-sized data, so they are isolated here
behind one small interface (``LocalOps``): ``TorchLocalOps`` below runs anywhere and is the reference, and
``kernels.divergence_triton.TritonLocalOps`` fuses each step into one pass over the shard on CUDA.

All partial sums are taken relative to the chunk's own maxima made finite (see ``vocab_parallel.finite_or_zero``),
so the caller can rescale them to the global maxima after an all-reduce.

Shape legend: ``C`` tokens in the chunk, ``V`` valid local vocabulary columns, ``K`` teacher top-k ids.
Inputs ``s`` (student) and ``t`` (teacher) are raw logits in their own dtype; ``inv_ts``/``inv_tt`` are the
reciprocal temperatures; maths runs in float64 for float64 students and float32 otherwise.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from megatron_opd.losses.vocab_parallel import finite_or_zero

KIND_CODES: dict[str, int] = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LocalOps(Protocol):
    """What a back end provides; every method works on one chunk of rows of the local shard."""

    name: str

    def chunk_elements(self, device: torch.device) -> int:
        """Automatic chunking picks about this many ``chunk x V`` elements per chunk on ``device``."""
        ...

    def dense_stats(
        self, s_CV: torch.Tensor, t_CV: torch.Tensor, inv_ts: float, inv_tt: float, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``max_C2`` (student, teacher max of scaled logits) and ``sums_C3``: student and teacher sums of
        ``exp(x - max)`` and, for ``forward_kl``, ``A = sum exp(u - mt) ((u - mt) - (z - ms))`` (for ``reverse_kl``
        the same with student and teacher swapped; 0 for ``jsd``), ``z``/``u`` the scaled student/teacher logits."""
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

    def topk_stats(
        self, s_CV: torch.Tensor, inv_ts: float, local_ids_CK: torch.Tensor, need_tail: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``max_C``, ``sums_C2`` (sum of ``exp(z - max)`` over all columns and over the columns *not* in
        the top-k, the latter 0 unless ``need_tail``) and ``z_CK``: the scaled logit at each top-k id held on this
        rank, 0 for ids that are not (``local_ids_CK == -1``)."""
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


def _zero_nans_(x_CV: torch.Tensor) -> torch.Tensor:
    """In place, NaN -> 0: the ``0 * inf`` of a zero-probability term counts as 0 (one pass, unlike a mask)."""
    return torch.nan_to_num_(x_CV, nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _scaled(x_CV: torch.Tensor, inv_temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """A fresh ``dtype`` copy of ``x / T`` (never a view of the input, so it can be modified in place)."""
    return torch.mul(x_CV.to(dtype), inv_temperature)


class TorchLocalOps:
    """Reference implementation in plain torch; its temporaries are a few ``[chunk, V]`` tensors."""

    name = "torch"

    def chunk_elements(self, device: torch.device) -> int:
        # CPU: ~1M elements (4 MiB per float32 temporary) stays in cache and below glibc's mmap threshold, which
        # measured ~2x faster than 64 MiB temporaries that are page-faulted in afresh for every chunk. GPU: large
        # chunks amortise kernel launches; 64M elements is 256 MiB per temporary.
        return 1 << 20 if device.type == "cpu" else 1 << 26

    def dense_stats(
        self, s_CV: torch.Tensor, t_CV: torch.Tensor, inv_ts: float, inv_tt: float, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cd = compute_dtype(s_CV.dtype)
        zs_CV = _scaled(s_CV, inv_ts, cd)
        ut_CV = _scaled(t_CV, inv_tt, cd)
        max_C2 = torch.stack([zs_CV.amax(dim=1), ut_CV.amax(dim=1)], dim=1)
        shift_C2 = finite_or_zero(max_C2)
        zs_CV.sub_(shift_C2[:, 0:1])  # z - ms
        ut_CV.sub_(shift_C2[:, 1:2])  # u - mt
        sums_C3 = torch.zeros(s_CV.shape[0], 3, dtype=cd, device=s_CV.device)
        if kind == "jsd":
            sums_C3[:, 0] = torch.exp(zs_CV).sum(dim=1)
            sums_C3[:, 1] = torch.exp(ut_CV).sum(dim=1)
            return max_C2, sums_C3
        # forward_kl weighs (u - mt) - (z - ms) by the teacher, reverse_kl weighs its negation by the student.
        weighted_CV, other_CV = (ut_CV, zs_CV) if kind == "forward_kl" else (zs_CV, ut_CV)
        diff_CV = weighted_CV - other_CV
        w_CV = torch.exp(weighted_CV)
        _zero_nans_(diff_CV.mul_(w_CV))  # 0 * inf where w == 0
        other_sum_C = torch.exp(other_CV).sum(dim=1)
        weight_sum_C = w_CV.sum(dim=1)
        if kind == "forward_kl":
            sums_C3[:, 0], sums_C3[:, 1] = other_sum_C, weight_sum_C
        else:
            sums_C3[:, 0], sums_C3[:, 1] = weight_sum_C, other_sum_C
        sums_C3[:, 2] = diff_CV.sum(dim=1)
        return max_C2, sums_C3

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
        logq_CV = _scaled(s_CV, inv_ts, cd).sub_(lse_s_C[:, None])
        logp_CV = _scaled(t_CV, inv_tt, cd).sub_(lse_t_C[:, None])
        logm_CV = torch.logaddexp(logp_CV + math.log(beta), logq_CV + math.log1p(-beta))
        sums_C2 = torch.empty(s_CV.shape[0], 2, dtype=cd, device=s_CV.device)
        for col, logw_CV in enumerate((logp_CV, logq_CV)):
            w_CV = torch.exp(logw_CV)
            term_CV = _zero_nans_((logw_CV - logm_CV).mul_(w_CV))
            sums_C2[:, col] = term_CV.sum(dim=1)
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
        logq_CV = _scaled(s_CV, inv_ts, cd).sub_(lse_s_C[:, None])
        logp_CV = _scaled(t_CV, inv_tt, cd).sub_(lse_t_C[:, None])
        q_CV = torch.exp(logq_CV)
        if kind == "forward_kl":
            g_CV = q_CV.sub_(torch.exp(logp_CV))  # q - p
        else:
            if kind == "reverse_kl":
                # d/dz_j KL(q||p) = q_j (log q_j - log p_j - KL(q||p))
                ratio_CV = logq_CV.sub_(logp_CV)
            else:
                # d/dz_j JSD = (1 - beta) q_j (log q_j - log m_j - KL(q||m))
                logm_CV = torch.logaddexp(logp_CV.add_(math.log(beta)), logq_CV + math.log1p(-beta))
                ratio_CV = logq_CV.sub_(logm_CV).mul_(1.0 - beta)
                coef_C = coef_C * (1.0 - beta)
            g_CV = _zero_nans_(ratio_CV.sub_(coef_C[:, None]).mul_(q_CV))
        g_CV.mul_((grad_C.to(cd) * inv_ts)[:, None])
        out_CV.copy_(g_CV)

    def topk_stats(
        self, s_CV: torch.Tensor, inv_ts: float, local_ids_CK: torch.Tensor, need_tail: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cd = compute_dtype(s_CV.dtype)
        z_CV = _scaled(s_CV, inv_ts, cd)
        n_cols = z_CV.shape[1]
        local_CK = local_ids_CK >= 0
        z_CK = torch.where(local_CK, z_CV.gather(1, local_ids_CK.clamp(min=0)), torch.zeros((), dtype=cd))
        max_C = z_CV.amax(dim=1)
        e_CV = torch.exp(z_CV.sub_(finite_or_zero(max_C)[:, None]))
        sums_C2 = torch.zeros(z_CV.shape[0], 2, dtype=cd, device=z_CV.device)
        sums_C2[:, 0] = e_CV.sum(dim=1)
        if need_tail:
            # Exclude the top-k columns exactly (no 1 - sum cancellation); non-local ids go to a spare column.
            in_topk_CV = torch.zeros(z_CV.shape[0], n_cols + 1, dtype=torch.bool, device=z_CV.device)
            in_topk_CV.scatter_(1, torch.where(local_CK, local_ids_CK, n_cols), True)
            sums_C2[:, 1] = e_CV.masked_fill_(in_topk_CV[:, :n_cols], 0.0).sum(dim=1)
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
        g_CV = torch.exp(_scaled(s_CV, inv_ts, cd).sub_(lse_s_C[:, None])).mul_(-coef_sum_C[:, None])
        local_CK = local_ids_CK >= 0
        # Ids held by other ranks add 0 at column 0: scatter_add accumulates, so nothing is overwritten.
        g_CV.scatter_add_(1, local_ids_CK.clamp(min=0), torch.where(local_CK, coef_CK, torch.zeros((), dtype=cd)))
        out_CV.copy_(g_CV.mul_(inv_ts))


_TORCH_OPS = TorchLocalOps()


def select_local_ops(backend: str, device: torch.device) -> LocalOps:
    """``"torch"``, ``"triton"`` (CUDA only), or ``"auto"``: Triton on CUDA when it imports, else torch."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return _TORCH_OPS
    from kernels import divergence_triton

    if backend == "triton":
        if not divergence_triton.triton_usable_on(device):
            raise ValueError(
                "backend='triton' needs CUDA tensors and an importable triton (or TRITON_INTERPRET=1 for the "
                "interpreter); use backend='torch' or 'auto'"
            )
        return divergence_triton.TRITON_OPS
    return (
        divergence_triton.TRITON_OPS if device.type == "cuda" and divergence_triton.triton_available() else _TORCH_OPS
    )
