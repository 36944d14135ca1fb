"""Dense divergences between a student and a colocated teacher whose logits are sharded the same way.

Each tensor-parallel rank holds ``[tokens, V/TP]`` student and teacher logits. The loss is computed without ever
gathering the vocabulary: per chunk of tokens, each rank reduces its shard to a few per-token scalars; only those
cross ranks. Forward KL and reverse KL need one pass over the shard and two all-reduces of ``[tokens, <=3]``
(max, then rescaled sums); the generalized JSD needs the global normalisers before its sums, so it takes a second
pass and a third all-reduce of ``[tokens, 2]``. Backward needs no communication at all: it recomputes the
probabilities per chunk from the saved per-token log-normalisers, so no ``[tokens, V]`` softmax is ever kept.

Per token, with z = student logits / T_s, u = teacher logits / T_t, q = softmax(z), p = softmax(u):

- forward_kl = sum p (log p - log q);       d/dz = q - p
- reverse_kl = sum q (log q - log p) = R;   d/dz = q (log q - log p - R)
- jsd        = beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q;
                                            d/dz = (1-beta) q (log q - log m - KL(q||m))

Every rank computes the same per-token loss, and each rank's backward writes only its own shard's gradient, so the
gradient is not double counted across ranks.

Shape legend: ``T`` tokens (leading dims flattened), ``V`` local shard columns, ``C`` tokens in a chunk.
"""

from __future__ import annotations

import torch

from megatron_opd.losses.divergences import DivergenceKind, resolve_kind
from megatron_opd.losses.local_ops import LocalOps, compute_dtype, select_local_ops
from megatron_opd.losses.options import DivergenceOptions, PassStatistics
from megatron_opd.losses.vocab_parallel import (
    VocabShard,
    all_reduce_max_,
    all_reduce_sum_,
    finite_or_zero,
    make_vocab_shard,
    rescale_factor,
)


def chunk_rows(chunk_size: int | None, n_tokens: int, n_cols: int, ops: LocalOps, device: torch.device) -> int:
    """Tokens per chunk: ``chunk_size`` if given, else about ``ops.chunk_elements(device) / n_cols``."""
    if chunk_size is None:
        return max(1, min(n_tokens, ops.chunk_elements(device) // max(n_cols, 1)))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be a positive int (tokens per chunk) or None for automatic, got {chunk_size!r}"
        )
    return chunk_size


def check_temperature(name: str, value: float) -> float:
    """Temperatures divide logits; they must be positive and finite."""
    value = float(value)
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


def check_inplace(logits: torch.Tensor, inplace_backward: bool) -> None:
    """In-place backward turns the logits into their own gradient: never allowed for a leaf (``.grad`` would alias
    the tensor itself)."""
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            "inplace_backward=True needs student_logits computed by the model (a non-leaf tensor); for a leaf "
            "its .grad would be the tensor itself. Pass inplace_backward=False"
        )


def as_rows(logits: torch.Tensor, name: str) -> torch.Tensor:
    """Flatten leading dims to ``[T, V]`` with unit stride along the vocabulary."""
    if not torch.is_floating_point(logits):
        raise ValueError(f"{name} must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"{name} must be [tokens, V/TP] or [batch, seq, V/TP], got shape {tuple(logits.shape)}")
    rows_TV = logits.reshape(-1, logits.shape[-1])
    return rows_TV if rows_TV.stride(1) == 1 else rows_TV.contiguous()


def where_token(flat_index: int, leading_shape: torch.Size) -> str:
    """``token 3`` for ``[tokens, V]`` inputs, ``position (0, 3)`` for ``[batch, seq, V]`` ones."""
    if len(leading_shape) <= 1:
        return f"token {flat_index}"
    index = []
    for size in reversed(leading_shape):
        index.append(flat_index % size)
        flat_index //= size
    return f"position {tuple(reversed(index))}"


def check_finite_rows(global_max_T2: torch.Tensor, sums_T2: torch.Tensor, leading_shape: torch.Size) -> None:
    """Raise a ``ValueError`` naming the first token whose student or teacher logits hold a NaN or ``+inf``, or
    no finite value at all, which would make its loss NaN.

    Reads only the global per-token maxima and sums of ``exp(x - max)`` (column 0 student, 1 teacher), equal on
    every rank, so every rank raises together: a NaN makes the sum NaN, ``+inf`` makes the max ``+inf`` and the
    sum NaN, and a row of ``-inf`` leaves the max ``-inf``. One reduction over the tokens; a host sync.
    """
    ok_T2 = torch.isfinite(global_max_T2) & torch.isfinite(sums_T2)
    if bool(ok_T2.all()):  # this is a sync point
        return
    bad_T2 = ~ok_T2
    row = int(bad_T2.any(dim=1).nonzero()[0, 0])
    name = "student_logits" if bool(bad_T2[row, 0]) else "teacher_logits"
    col = 0 if name == "student_logits" else 1
    what = "no finite logit (all -inf)" if float(global_max_T2[row, col]) == float("-inf") else "a NaN or +inf logit"
    raise ValueError(
        f"{name} has {what} at {where_token(row, leading_shape)}; fix the logits there (-inf may mask some of a "
        "token's columns, but each token needs a finite logit), or pass validate=False to skip this check"
    )


class _DenseDivergence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        student_TV: torch.Tensor,
        teacher_TV: torch.Tensor,
        kind: str,
        beta: float,
        inv_ts: float,
        inv_tt: float,
        rows_per_chunk: int,
        shard: VocabShard,
        ops: LocalOps,
        inplace_backward: bool,
        validate: bool,
        leading_shape: torch.Size,
        outputs: PassStatistics | None,
    ) -> torch.Tensor:
        n_tokens, n_valid = student_TV.shape[0], shard.valid_width
        cd = compute_dtype(student_TV.dtype)
        s_TV, t_TV = student_TV[:, :n_valid], teacher_TV[:, :n_valid]
        device = student_TV.device
        # forward_kl in place: the student's chunks keep their exponentials for backward (q - p needs no log q).
        stash = inplace_backward and kind == "forward_kl" and ops.supports_stash and student_TV.dtype == cd

        # Pass 1: local maxima and sums, relative to the local maxima.
        max_T2 = torch.full((n_tokens, 2), float("-inf"), dtype=cd, device=device)
        sums_T3 = torch.zeros(n_tokens, 3, dtype=cd, device=device)
        if n_valid > 0:
            for lo in range(0, n_tokens, rows_per_chunk):
                hi = min(lo + rows_per_chunk, n_tokens)
                max_C2, sums_C3 = ops.dense_stats(s_TV[lo:hi], t_TV[lo:hi], inv_ts, inv_tt, kind, stash)
                max_T2[lo:hi] = max_C2
                sums_T3[lo:hi] = sums_C3

        # Per-token collectives: global maxima, then the partial sums rescaled to them.
        global_max_T2 = all_reduce_max_(max_T2.clone(), shard)
        factor_T2 = rescale_factor(max_T2, global_max_T2)
        shift_delta_T2 = finite_or_zero(max_T2) - finite_or_zero(global_max_T2)
        if kind == "forward_kl":  # A is weighted by the teacher: re-reference it to the global maxima
            sums_T3[:, 2] = factor_T2[:, 1] * (
                sums_T3[:, 2] + sums_T3[:, 1] * (shift_delta_T2[:, 1] - shift_delta_T2[:, 0])
            )
        elif kind == "reverse_kl":
            sums_T3[:, 2] = factor_T2[:, 0] * (
                sums_T3[:, 2] + sums_T3[:, 0] * (shift_delta_T2[:, 0] - shift_delta_T2[:, 1])
            )
        sums_T3[:, :2] *= factor_T2
        all_reduce_sum_(sums_T3, shard)
        if validate:
            check_finite_rows(global_max_T2, sums_T3[:, :2], leading_shape)

        log_sums_T2 = torch.log(sums_T3[:, :2])
        lse_T2 = finite_or_zero(global_max_T2) + log_sums_T2
        lse_s_T, lse_t_T = lse_T2[:, 0].contiguous(), lse_T2[:, 1].contiguous()
        if outputs is not None:
            outputs.student_lse = lse_s_T.clone()
        if kind == "forward_kl":
            loss_T = sums_T3[:, 2] / sums_T3[:, 1] - log_sums_T2[:, 1] + log_sums_T2[:, 0]
            coef_T = torch.zeros_like(loss_T)
        elif kind == "reverse_kl":
            loss_T = sums_T3[:, 2] / sums_T3[:, 0] - log_sums_T2[:, 0] + log_sums_T2[:, 1]
            coef_T = loss_T.clone()  # the returned loss may be modified in place by the caller
        else:
            # Pass 2 (jsd only): KL(p||m) and KL(q||m) need the global normalisers first.
            kl_T2 = torch.zeros(n_tokens, 2, dtype=cd, device=device)
            if n_valid > 0:
                for lo in range(0, n_tokens, rows_per_chunk):
                    hi = min(lo + rows_per_chunk, n_tokens)
                    kl_T2[lo:hi] = ops.dense_jsd_sums(
                        s_TV[lo:hi], t_TV[lo:hi], inv_ts, inv_tt, lse_s_T[lo:hi], lse_t_T[lo:hi], beta
                    )
            all_reduce_sum_(kl_T2, shard)
            loss_T = beta * kl_T2[:, 0] + (1.0 - beta) * kl_T2[:, 1]
            coef_T = kl_T2[:, 1].contiguous()

        # With a stash, q = exp(z - local max) * q_scale; else q is recomputed from lse_s.
        student_norm_T = torch.exp(finite_or_zero(max_T2[:, 0]) - lse_s_T) if stash else lse_s_T
        ctx.save_for_backward(student_TV, teacher_TV, student_norm_T, lse_t_T, coef_T)
        ctx.config = (kind, beta, inv_ts, inv_tt, rows_per_chunk, n_valid, ops, inplace_backward, stash)
        ops.release()
        return loss_T

    @staticmethod
    def backward(ctx, grad_T: torch.Tensor):
        student_TV, teacher_TV, student_norm_T, lse_t_T, coef_T = ctx.saved_tensors
        kind, beta, inv_ts, inv_tt, rows_per_chunk, n_valid, ops, inplace_backward, stash = ctx.config
        # In place: the gradient overwrites the student logits chunk by chunk (each chunk is read before written).
        grad_TV = student_TV if inplace_backward else torch.empty_like(student_TV)
        grad_TV[:, n_valid:] = 0  # padding columns get no gradient
        grad_T = grad_T.contiguous()
        n_tokens = student_TV.shape[0]
        for lo in range(0, n_tokens if n_valid > 0 else 0, rows_per_chunk):
            hi = min(lo + rows_per_chunk, n_tokens)
            t_CV, lse_t_C = teacher_TV[lo:hi, :n_valid], lse_t_T[lo:hi]
            if stash:
                scale_C = grad_T[lo:hi].to(lse_t_C.dtype) * inv_ts
                ops.dense_grad_stashed(grad_TV[lo:hi, :n_valid], t_CV, inv_tt, student_norm_T[lo:hi], lse_t_C, scale_C)
                continue
            ops.dense_grad(
                student_TV[lo:hi, :n_valid],
                t_CV,
                inv_ts,
                inv_tt,
                student_norm_T[lo:hi],
                lse_t_C,
                coef_T[lo:hi],
                grad_T[lo:hi],
                kind,
                beta,
                grad_TV[lo:hi, :n_valid],
            )
        ops.release()
        return grad_TV, None, None, None, None, None, None, None, None, None, None, None, None


def dense_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: DivergenceKind,
    *,
    options: DivergenceOptions | None = None,
    **keywords,
) -> torch.Tensor:
    """Per-token divergence between a student and a colocated teacher, both vocab-sharded over ``options.group``.

    Args:
        student_logits: ``[tokens, V/TP]`` or ``[batch, seq, V/TP]``; this rank's shard of the student's logits.
        teacher_logits: the teacher's logits, same shape and sharding; treated as constant (no gradient).
        kind: ``"forward_kl"`` KL(teacher || student), ``"reverse_kl"`` KL(student || teacher) or ``"jsd"``
            (generalized JSD, mixture ``beta * teacher + (1 - beta) * student``; beta 0 / 1 give the two KLs).
        options: ``DivergenceOptions`` (all but the top-k losses' ``tail`` and ``coverage_weight``), or its fields
            as keyword arguments.

    Returns:
        Per-token losses with the logits' leading shape, float32 (float64 for float64 logits). Every rank of
        ``group`` returns the same values. Mask and reduce them with ``reduce_loss``.
    """
    o = DivergenceOptions.of(options, keywords, loss="dense_divergence", unused=("tail", "coverage_weight"))
    beta, chunk_size, inplace_backward, outputs = o.beta, o.chunk_size, o.inplace_backward, o.outputs
    kind, beta = resolve_kind(kind, beta)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"teacher_logits must have the student's shape {tuple(student_logits.shape)}, got "
            f"{tuple(teacher_logits.shape)}; for a teacher that sends top-k log-probabilities use topk_divergence"
        )
    if student_logits.device != teacher_logits.device:
        raise ValueError(f"teacher_logits is on {teacher_logits.device}, student_logits on {student_logits.device}")
    inv_ts = 1.0 / check_temperature("student_temperature", o.student_temperature)
    inv_tt = 1.0 / check_temperature("teacher_temperature", o.teacher_temperature)
    check_inplace(student_logits, inplace_backward)
    student_TV = as_rows(student_logits, "student_logits")
    teacher_TV = as_rows(teacher_logits.detach(), "teacher_logits")
    shard = make_vocab_shard(student_TV.shape[1], o.group, o.vocab_size)
    ops = select_local_ops(o.backend, student_TV.device)
    rows = chunk_rows(chunk_size, student_TV.shape[0], shard.valid_width, ops, student_TV.device)
    lead = student_logits.shape[:-1]
    args = (kind, beta, inv_ts, inv_tt, rows, shard, ops, inplace_backward, o.validate, lead, outputs)
    loss_T = _DenseDivergence.apply(student_TV, teacher_TV, *args)
    if outputs is not None:
        outputs.student_lse = outputs.student_lse.reshape(lead)
    return loss_T.reshape(lead)
