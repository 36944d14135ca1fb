"""Divergences against a remote teacher that sends only its top-k (global token ids, log-probabilities) per position.

The student's logits stay vocab-sharded. Per token, each rank contributes its local max and sum of exponentials
(one pass over its shard), the student's logits at those of the k ids that fall in its shard (ids held elsewhere
contribute 0: they are never redirected to a local column) and, for the ``bucket`` tail, the sum of exponentials
over its columns *outside* the top-k, which gives the student's tail mass exactly rather than as ``1 - sum q``.
What crosses ranks is ``[tokens, 1]`` (max) and ``[tokens, 2 + k]`` (rescaled sums and gathered logits).

Everything after that lives on small ``[tokens, k(+1)]`` tensors, replicated on every rank:

- ``tail="bucket"``: the exact divergence between the two distributions coarsened to the k ids plus one bucket
  holding all remaining mass (``1 - sum p`` for the teacher, the student's true tail mass). No mass is dropped.
- ``tail="renorm"``: both distributions renormalised over the k ids.
- ``tail="ignore"``: the per-id divergence terms summed over the k ids with both masses as they are (verl's GKD
  recipe for ``forward_kl``). Not a divergence (it can be negative); provided for comparison.

Backward is exact and hand-written: with l_i = log q_i at the k ids and c_i = dLoss/dl_i (closed form per kind
and tail, ``divergences.elementwise_divergence``), the student's gradient is
``dLoss/dz_j = [j in top-k] c_j - q_j * sum_i c_i``, with ``q`` recomputed per chunk from the saved per-token
normaliser or, with ``inplace_backward`` on the torch path, read from the exponentials the forward left in the
logits' storage (one multiply per element instead of a second exponential).

Teacher log-probabilities are used as given (any teacher temperature must already be applied); only the student's
logits are divided by ``student_temperature``.

Two generalisations serve the union support (``losses.union``, TCAD):

- ``support_mask``: slots marked ``False`` hold no id. They never touch the shard (their local id is -1, like an
  id held on another rank), are left out of validation, carry log-probability ``-inf`` on both sides of the
  ``[tokens, k]`` algebra (where zero-weight terms count as 0, so their coefficient ``c`` is exactly 0) and get no
  gradient. A fixed ``[tokens, k]`` shape thus holds a different number of ids per token.
- ``coverage_weight``: adds ``coverage_weight * -log(sum of q over the support)`` per token; its derivative with
  respect to ``log q_i`` is ``-coverage_weight * q_i / sum q``, folded into ``c``, so backward is unchanged.

Shape legend: ``T`` tokens (leading dims flattened), ``V`` local shard columns, ``K`` support slots (the teacher's
top-k ids, or the union's teacher + student slots).
"""

from __future__ import annotations

import math

import torch

from megatron_opd.losses.dense import as_rows, check_inplace, check_temperature, chunk_rows, where_token
from megatron_opd.losses.divergences import DivergenceKind, elementwise_divergence, resolve_kind
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

TAILS: tuple[str, ...] = ("bucket", "renorm", "ignore")

TOPK_CHUNK_ELEMENTS = 1 << 18
"""Automatic chunks hold at most this many ``tokens x k`` entries, so the per-chunk id and log-probability
temporaries stay small next to what is kept for backward (measured on an H100: with the Triton path's single
chunk they made the peak 1.4x verl's algorithm's)."""

MIN_TAIL_MASS = 1e-30
"""Tail masses (teacher's and student's) are floored here before taking logs. A teacher whose top-k mass rounds to
1 would otherwise make ``reverse_kl`` infinite; the floor turns that into a large finite penalty on the student's
tail instead."""

MASS_TOLERANCE = 1e-3
"""Teacher top-k probabilities may sum to at most ``1 + MASS_TOLERANCE`` (rounding in the teacher's engine); above
that the input is rejected, and below it any excess over 1 is treated as an empty teacher tail."""


def _first_row(bad_T: torch.Tensor) -> int | None:
    if not bool(bad_T.any()):
        return None
    return int(bad_T.nonzero()[0, 0])


def _slot_name(slot: int, student_slots_from: int | None) -> tuple[str, str]:
    """The argument names (ids, log-probabilities) an error about support slot ``slot`` should mention."""
    if student_slots_from is not None and slot >= student_slots_from:
        return "student_topk_ids", "teacher_logprobs_at_student_ids"
    return "teacher_topk_ids", "teacher_topk_logprobs"


def validate_topk(
    ids_TK: torch.Tensor,
    logprobs_TK: torch.Tensor,
    vocab_size: int,
    kind: str,
    tail: str,
    leading_shape: torch.Size,
    *,
    unsharded_guess: bool = False,
    support_TK: torch.Tensor | None = None,
    student_slots_from: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first offending token for inputs the losses cannot handle.

    ``unsharded_guess=True`` (no tensor-parallel group and no ``vocab_size``: the logits' width was taken as the
    vocabulary) adds to an out-of-range id's message that logits which are one rank's shard need a group.
    ``support_TK`` (bool): only slots marked ``True`` are checked; a token with none is refused.
    ``student_slots_from``: slots from this index on are the student's (union support), for the messages.

    Accepted: ``-inf`` log-probabilities (an id the teacher gives zero mass, e.g. padding of a short top-k list)
    for ``forward_kl`` and ``jsd``. Rejected: non-integer ids, ``k`` larger than the vocabulary, ids outside
    ``[0, vocab_size)``, an id repeated within a token, NaN or ``+inf`` log-probabilities, log-probabilities above
    0 or summing above ``1 + MASS_TOLERANCE``, ``-inf`` with ``reverse_kl`` (infinite), and a token whose k
    log-probabilities are all ``-inf`` with ``tail="renorm"`` (nothing to renormalise).
    """
    present_TK = torch.ones_like(ids_TK, dtype=torch.bool) if support_TK is None else support_TK

    def first_bad(bad_TK: torch.Tensor) -> tuple[int, int] | None:
        row = _first_row((bad_TK & present_TK).any(dim=1))
        if row is None:
            return None
        return row, int((bad_TK[row] & present_TK[row]).nonzero()[0, 0])

    if support_TK is not None:
        row = _first_row(~present_TK.any(dim=1))
        if row is not None:
            raise ValueError(f"support_mask holds no id at {where_token(row, leading_shape)}; every token needs one")
    bad = first_bad((ids_TK < 0) | (ids_TK >= vocab_size))
    if bad is not None:
        row, slot = bad
        shard_hint = (
            "; or, if student_logits is one rank's shard of the vocabulary, no tensor-parallel group was found: "
            "pass group= (and vocab_size=) or initialise Megatron's parallel state"
        )
        raise ValueError(
            f"{_slot_name(slot, student_slots_from)[0]} has id {int(ids_TK[row, slot])} at "
            f"{where_token(row, leading_shape)}, outside [0, vocab_size={vocab_size}); map teacher ids into the "
            "student's vocabulary (and drop ids it lacks) before calling" + (shard_hint if unsharded_guess else "")
        )
    if ids_TK.shape[1] > 1:
        # Absent slots get distinct negative ids, so they never match anything.
        absent_ids_TK = -1 - torch.arange(ids_TK.shape[1], device=ids_TK.device).expand_as(ids_TK)
        keyed_TK = torch.where(present_TK, ids_TK.long(), absent_ids_TK)
        sorted_TK, order_TK = keyed_TK.sort(dim=1, stable=True)
        repeat_TK = torch.zeros_like(present_TK)
        repeat_TK.scatter_(1, order_TK[:, 1:], sorted_TK[:, 1:] == sorted_TK[:, :-1])
        bad = first_bad(repeat_TK)
        if bad is not None:
            row, slot = bad
            raise ValueError(
                f"{_slot_name(slot, student_slots_from)[0]} contains duplicate ids at {where_token(row, leading_shape)}"
                "; deduplicate before calling (pad a short list with unused ids and -inf log-probabilities)"
            )
    checks = [
        (torch.isnan(logprobs_TK), "is NaN", "fix the teacher's output"),
        (logprobs_TK > math.log1p(MASS_TOLERANCE), "is above 0", "pass log-probabilities, not logits"),
    ]
    if kind == "reverse_kl":
        checks.append(
            (
                logprobs_TK == float("-inf"),
                "is -inf, where reverse_kl is infinite",
                "use forward_kl or jsd, or drop those ids",
            )
        )
    for bad_TK, what, fix in checks:
        bad = first_bad(bad_TK)
        if bad is not None:
            row, slot = bad
            name = _slot_name(slot, student_slots_from)[1]
            raise ValueError(f"{name} {what} at {where_token(row, leading_shape)}; {fix}")
    lse_T = torch.logsumexp(logprobs_TK.double().masked_fill(~present_TK, float("-inf")), dim=1)
    bad = _first_row(lse_T > math.log1p(MASS_TOLERANCE))
    if bad is not None:
        name = "teacher_topk_logprobs" if student_slots_from is None else "the teacher's log-probabilities"
        raise ValueError(
            f"{name} sum to probability {math.exp(float(lse_T[bad])):.6f} > 1 at "
            f"{where_token(bad, leading_shape)}; pass log-probabilities normalised over the full vocabulary"
        )
    if tail == "renorm":
        bad = _first_row(lse_T == float("-inf"))
        if bad is not None:
            name = "teacher_topk_logprobs" if student_slots_from is None else "the teacher's log-probabilities"
            raise ValueError(
                f"{name} are all -inf at {where_token(bad, leading_shape)}; "
                "tail='renorm' has nothing to renormalise there (mask that token or use tail='bucket')"
            )


def topk_coarse_divergence(
    logq_TK: torch.Tensor, logp_TK: torch.Tensor, logq_tail_T: torch.Tensor, kind: str, beta: float, tail: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and its derivative ``c = dLoss/dlog q`` at the k ids, for one tail mode.

    ``logq_TK`` are the student's log-probabilities (full-vocabulary normalisation) at the teacher's ids,
    ``logq_tail_T`` the log of the student's mass outside them (used by ``bucket`` only).
    """
    if tail == "ignore":
        d_TK, dlogq_TK = elementwise_divergence(logp_TK, logq_TK, kind, beta)
        return d_TK.sum(dim=1), dlogq_TK
    if tail == "renorm":
        logq_renorm_TK = logq_TK - torch.logsumexp(logq_TK, dim=1, keepdim=True)
        logp_renorm_TK = logp_TK - torch.logsumexp(logp_TK, dim=1, keepdim=True)
        d_TK, dlogq_TK = elementwise_divergence(logp_renorm_TK, logq_renorm_TK, kind, beta)
        # Chain through the renormalisation: d log q~_c / d log q_i = [c == i] - q~_i.
        c_TK = dlogq_TK - torch.exp(logq_renorm_TK) * dlogq_TK.sum(dim=1, keepdim=True)
        return d_TK.sum(dim=1), c_TK
    # bucket: teacher tail 1 - sum p (computed as -expm1(logsumexp) for accuracy near 1), both floored.
    log_floor = math.log(MIN_TAIL_MASS)
    p_tail_T = (-torch.expm1(torch.logsumexp(logp_TK, dim=1))).clamp(min=0.0)
    logp_tail_T = torch.log(p_tail_T).clamp(min=log_floor)
    logq_tail_T = logq_tail_T.clamp(min=log_floor)
    logp_TN = torch.cat([logp_TK, logp_tail_T[:, None]], dim=1)
    logq_TN = torch.cat([logq_TK, logq_tail_T[:, None]], dim=1)
    d_TN, dlogq_TN = elementwise_divergence(logp_TN, logq_TN, kind, beta)
    # The tail is 1 - sum q: d log q_tail / d log q_i = -q_i / q_tail.
    c_TK = dlogq_TN[:, :-1] - torch.exp(logq_TK - logq_tail_T[:, None]) * dlogq_TN[:, -1:]
    return d_TN.sum(dim=1), c_TK


def coverage_term(logq_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TCAD's coverage term ``-log sum_i q_i`` over the support slots and its derivative w.r.t. each ``log q_i``.

    ``-(logZ_sub - logZ_global)`` in TCAD's terms: 0 when all the student's mass is on the support, growing as it
    leaks outside, so it pulls the student's mass onto the ids the loss sees. Absent slots (``log q = -inf``) add
    nothing and get 0.
    """
    log_mass_T = torch.logsumexp(logq_TK, dim=1)
    return -log_mass_T, -torch.exp(logq_TK - log_mass_T[:, None])


class _TopkDivergence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        student_TV: torch.Tensor,
        ids_TK: torch.Tensor,
        logprobs_TK: torch.Tensor,
        support_TK: torch.Tensor | None,
        kind: str,
        beta: float,
        tail: str,
        coverage_weight: float,
        inv_ts: float,
        rows_per_chunk: int,
        shard: VocabShard,
        ops: LocalOps,
        inplace_backward: bool,
        outputs: PassStatistics | None,
    ) -> torch.Tensor:
        n_tokens, n_valid = student_TV.shape[0], shard.valid_width
        k = ids_TK.shape[1]
        cd = compute_dtype(student_TV.dtype)
        device = student_TV.device
        s_TV = student_TV[:, :n_valid]
        # int32 (half the memory of int64; chunks are widened for indexing): the column of each id held here, -1 else.
        local_ids_TK = ids_TK.to(torch.int32, copy=True).sub_(shard.start)
        local_ids_TK.masked_fill_((local_ids_TK < 0) | (local_ids_TK >= n_valid), -1)
        if support_TK is not None:
            local_ids_TK.masked_fill_(~support_TK, -1)  # absent slots: like ids held on another rank
        need_tail = tail == "bucket"
        # In place, the student's chunks keep their exponentials for backward (see kernels.divergence_torch).
        stash = inplace_backward and ops.supports_stash and student_TV.dtype == cd

        max_T = torch.full((n_tokens,), float("-inf"), dtype=cd, device=device)
        # One buffer for the sum all-reduce: [sum exp, sum exp outside top-k, student logits at the k ids].
        payload_TN = torch.zeros(n_tokens, 2 + k, dtype=cd, device=device)
        if n_valid > 0:
            for lo in range(0, n_tokens, rows_per_chunk):
                hi = min(lo + rows_per_chunk, n_tokens)
                ids_CK = local_ids_TK[lo:hi].long()
                max_C, sums_C2, z_CK = ops.topk_stats(s_TV[lo:hi], inv_ts, ids_CK, need_tail, stash)
                max_T[lo:hi] = max_C
                payload_TN[lo:hi, :2] = sums_C2
                payload_TN[lo:hi, 2:] = z_CK

        global_max_T = all_reduce_max_(max_T.clone(), shard)
        payload_TN[:, :2] *= rescale_factor(max_T, global_max_T)[:, None]
        all_reduce_sum_(payload_TN, shard)

        log_total_T = torch.log(payload_TN[:, 0])
        lse_s_T = (finite_or_zero(global_max_T) + log_total_T).contiguous()
        if outputs is not None:
            outputs.student_lse = lse_s_T.clone()
        logq_TK = payload_TN[:, 2:].sub_(lse_s_T[:, None])  # in the payload's storage
        if support_TK is not None:
            logq_TK.masked_fill_(~support_TK, float("-inf"))  # absent: zero mass on both sides
        logq_tail_T = torch.log(payload_TN[:, 1]) - log_total_T
        # The [tokens, k] algebra in blocks of rows, so its temporaries stay small next to the saved [tokens, k].
        loss_T = torch.empty(n_tokens, dtype=cd, device=device)
        c_TK = torch.empty(n_tokens, k, dtype=cd, device=device)
        block = max(1, (1 << 18) // k)
        for lo in range(0, n_tokens, block):
            hi = min(lo + block, n_tokens)
            lp_BK = logprobs_TK[lo:hi].to(cd)
            if support_TK is not None:
                lp_BK = lp_BK.masked_fill(~support_TK[lo:hi], float("-inf"))
            loss_T[lo:hi], c_TK[lo:hi] = topk_coarse_divergence(
                logq_TK[lo:hi], lp_BK, logq_tail_T[lo:hi], kind, beta, tail
            )
            if coverage_weight:
                cover_B, dcover_BK = coverage_term(logq_TK[lo:hi])
                loss_T[lo:hi] += coverage_weight * cover_B
                c_TK[lo:hi] += coverage_weight * dcover_BK

        # With a stash, q = exp(z - local max) * q_scale off the top-k; else q is recomputed from lse.
        q_scale_T = torch.exp(finite_or_zero(max_T) - lse_s_T) if stash else lse_s_T
        ctx.save_for_backward(student_TV, local_ids_TK, q_scale_T, c_TK, c_TK.sum(dim=1), logq_TK if stash else None)
        ctx.config = (inv_ts, rows_per_chunk, n_valid, ops, inplace_backward, stash)
        ops.release()
        return loss_T

    @staticmethod
    def backward(ctx, grad_T: torch.Tensor):
        student_TV, local_ids_TK, q_scale_T, c_TK, c_sum_T, logq_TK = ctx.saved_tensors
        inv_ts, rows_per_chunk, n_valid, ops, inplace_backward, stash = ctx.config
        grad_T = grad_T.to(c_TK.dtype)
        coef_sum_T = c_sum_T * grad_T
        grad_TV = student_TV if inplace_backward else torch.empty_like(student_TV)
        grad_TV[:, n_valid:] = 0  # padding columns get no gradient
        n_tokens = student_TV.shape[0]
        for lo in range(0, n_tokens if n_valid > 0 else 0, rows_per_chunk):
            hi = min(lo + rows_per_chunk, n_tokens)
            ids_CK, coef_sum_C = local_ids_TK[lo:hi].long(), coef_sum_T[lo:hi]
            coef_CK = c_TK[lo:hi] * grad_T[lo:hi, None]
            if stash:
                ops.topk_grad_stashed(
                    grad_TV[lo:hi, :n_valid], inv_ts, q_scale_T[lo:hi], logq_TK[lo:hi], ids_CK, coef_CK, coef_sum_C
                )
            else:
                s_CV = student_TV[lo:hi, :n_valid]
                ops.topk_grad(s_CV, inv_ts, q_scale_T[lo:hi], ids_CK, coef_CK, coef_sum_C, grad_TV[lo:hi, :n_valid])
        ops.release()
        return grad_TV, None, None, None, None, None, None, None, None, None, None, None, None, None


SIGNED_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def check_id_columns(
    ids_name: str, ids: torch.Tensor, logprobs_name: str, logprobs: torch.Tensor, lead, k: str, signed: bool = False
) -> None:
    """Ids and their log-probabilities as the losses take them: both ``[*lead, k]``, integer ids (``signed``: no
    uint8, the student's ids may be -1), floating-point log-probabilities."""
    if ids.shape != logprobs.shape or ids.shape[:-1] != lead:
        raise ValueError(
            f"{ids_name} {tuple(ids.shape)} and {logprobs_name} {tuple(logprobs.shape)} must both be "
            f"[*{tuple(lead)}, {k}] to match student_logits"
        )
    if ids.dtype not in (SIGNED_INT_DTYPES if signed else (*SIGNED_INT_DTYPES, torch.uint8)):
        raise ValueError(f"{ids_name} must be a{' signed' if signed else 'n'} integer tensor, got {ids.dtype}")
    if not torch.is_floating_point(logprobs):
        raise ValueError(f"{logprobs_name} must be floating point, got {logprobs.dtype}")


def topk_divergence(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    kind: DivergenceKind,
    *,
    support_mask: torch.Tensor | None = None,
    options: DivergenceOptions | None = None,
    **keywords,
) -> torch.Tensor:
    """Per-token divergence between a vocab-sharded student and a teacher's top-k log-probabilities.

    Args:
        student_logits: ``[tokens, V/TP]`` or ``[batch, seq, V/TP]``; this rank's shard of the student's logits.
        teacher_topk_ids: ``[..., k]`` global token ids (same leading shape), distinct within each token.
        teacher_topk_logprobs: ``[..., k]`` the teacher's log-probabilities at those ids, normalised over the
            full vocabulary and already at the teacher's temperature. ``-inf`` means zero mass (not allowed with
            ``reverse_kl``). Treated as constant.
        kind: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"`` (see ``dense_divergence``).
        support_mask: optional ``[..., k]`` bool; ``False`` marks a slot holding no id (its id and
            log-probability are ignored, it gets no gradient). Lets a fixed shape carry a varying number of ids
            per token (the union support of ``union_divergence``). Every token needs at least one id.
        options: ``DivergenceOptions`` (all but the dense teacher's ``teacher_temperature``), or its fields as
            keyword arguments.

    Returns:
        Per-token losses with the logits' leading shape, float32 (float64 for float64 logits), equal on every
        rank of ``group``.
    """
    o = DivergenceOptions.of(options, keywords, loss="topk_divergence", unused=("teacher_temperature",))
    beta, tail, chunk_size, inplace_backward, outputs = o.beta, o.tail, o.chunk_size, o.inplace_backward, o.outputs
    kind, beta = resolve_kind(kind, beta)
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    lead = student_logits.shape[:-1]
    check_id_columns("teacher_topk_ids", teacher_topk_ids, "teacher_topk_logprobs", teacher_topk_logprobs, lead, "k")
    if teacher_topk_ids.shape[-1] == 0:
        raise ValueError("teacher top-k is empty (k == 0); send at least one id per token")
    if support_mask is not None and (support_mask.shape != teacher_topk_ids.shape or support_mask.dtype != torch.bool):
        raise ValueError(
            f"support_mask must be a bool tensor of the ids' shape {tuple(teacher_topk_ids.shape)}, got "
            f"{support_mask.dtype} {tuple(support_mask.shape)}"
        )
    coverage_weight = float(o.coverage_weight)
    if not coverage_weight >= 0.0 or math.isinf(coverage_weight):
        raise ValueError(f"coverage_weight must be a finite number >= 0, got {coverage_weight}")
    inv_ts = 1.0 / check_temperature("student_temperature", o.student_temperature)
    check_inplace(student_logits, inplace_backward)
    student_TV = as_rows(student_logits, "student_logits")
    ids_TK = teacher_topk_ids.reshape(-1, teacher_topk_ids.shape[-1]).to(student_TV.device)
    logprobs_TK = teacher_topk_logprobs.detach().reshape(ids_TK.shape).to(student_TV.device)
    shard = make_vocab_shard(student_TV.shape[1], o.group, o.vocab_size)
    k = ids_TK.shape[1]
    support_TK = None if support_mask is None else support_mask.reshape(ids_TK.shape).to(student_TV.device)
    if k > shard.vocab_size and support_TK is None:  # with a mask, validation counts the ids actually present
        raise ValueError(
            f"teacher top-k has k={k} ids per token, more than vocab_size={shard.vocab_size}; send at most that many"
        )
    if o.validate:
        guessed = shard.group is None and o.vocab_size is None
        validate_topk(
            ids_TK, logprobs_TK, shard.vocab_size, kind, tail, lead, unsharded_guess=guessed, support_TK=support_TK
        )
    ops = select_local_ops(o.backend, student_TV.device)
    rows = chunk_rows(chunk_size, student_TV.shape[0], shard.valid_width, ops, student_TV.device)
    if chunk_size is None:  # also bound the per-chunk [rows, k] temporaries (one chunk on the Triton path)
        rows = min(rows, max(1, TOPK_CHUNK_ELEMENTS // max(1, ids_TK.shape[1])))
    loss_T = _TopkDivergence.apply(
        student_TV, ids_TK, logprobs_TK, support_TK, kind, beta, tail, coverage_weight, inv_ts, rows, shard, ops,
        inplace_backward, outputs,
    )  # fmt: skip
    if outputs is not None:
        outputs.student_lse = outputs.student_lse.reshape(lead)
    return loss_T.reshape(lead)
