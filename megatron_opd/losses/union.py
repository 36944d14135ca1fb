"""The union support (TCAD): the top-k loss over the teacher's top-k ids together with the student's own top-k.

A teacher-top-k loss only sees the ids the teacher finds likely; mass the student puts elsewhere is one lump (the
``bucket`` tail) or invisible (``renorm``, ``ignore``). Adding the student's own most probable ids to the support
lets the loss correct them one by one, with the teacher's log-probabilities at those ids (which the teacher
request returns beside its top-k).

Per token the support is the concatenation ``[teacher ids (K), student ids (R)]``; a student id already among the
teacher's, or negative (no id: a short list, or a position that is never trained), is an *absent* slot of
``topk_divergence``'s ``support_mask``: it never touches the shard, gets no gradient, and the teacher's slot with
the same id is the one counted. The rest (one all-reduce of ``[tokens, 2 + K + R]``, the exact hand-written
backward, the in-place stash) is ``topk_divergence`` unchanged.

Shape legend: ``T`` tokens (leading dims flattened), ``K`` teacher top-k, ``R`` student top-k, ``N = K + R``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_opd.losses.dense import as_rows
from megatron_opd.losses.divergences import DivergenceKind, resolve_kind
from megatron_opd.losses.options import DivergenceOptions
from megatron_opd.losses.topk import TAILS, check_id_columns, topk_divergence, validate_topk
from megatron_opd.losses.vocab_parallel import make_vocab_shard

_COMPARE_ELEMENTS = 1 << 24
"""The ``[rows, R, K]`` comparison that finds repeated ids runs in blocks of rows of about this many elements."""


def union_support(teacher_ids_TK: torch.Tensor, student_ids_TR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids_TN, present_TN)``: the teacher's ids then the student's, and which slots hold an id of the union.

    A student slot is absent when its id is negative or already among the teacher's ids at that token (compared
    as ``[T, R, K]`` in blocks of rows). Absent slots' ids are never read (negative ones become 0).
    """
    n_tokens, r = student_ids_TR.shape
    repeated_TR = torch.zeros(n_tokens, r, dtype=torch.bool, device=student_ids_TR.device)
    block = max(1, _COMPARE_ELEMENTS // max(1, r * teacher_ids_TK.shape[1]))
    for lo in range(0, n_tokens, block):
        hi = min(lo + block, n_tokens)
        repeated_TR[lo:hi] = (student_ids_TR[lo:hi, :, None] == teacher_ids_TK[lo:hi, None, :]).any(dim=-1)
    student_present_TR = (student_ids_TR >= 0) & ~repeated_TR
    ids_TN = torch.cat([teacher_ids_TK.long(), student_ids_TR.long().clamp(min=0)], dim=1)
    present_TN = torch.cat([torch.ones_like(teacher_ids_TK, dtype=torch.bool), student_present_TR], dim=1)
    return ids_TN, present_TN


def union_divergence(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    student_topk_ids: torch.Tensor,
    teacher_logprobs_at_student_ids: torch.Tensor,
    kind: DivergenceKind,
    *,
    options: DivergenceOptions | None = None,
    **keywords,
) -> torch.Tensor:
    """Per-token divergence over the union of the teacher's top-k and the student's top-k ids (TCAD).

    Args:
        student_logits: ``[..., V/TP]`` this rank's shard of the student's logits.
        teacher_topk_ids, teacher_topk_logprobs: ``[..., K]`` as for ``topk_divergence``.
        student_topk_ids: ``[..., R]`` the student's own top ids (any order); negative entries hold no id. Ids the
            teacher's list already has are counted once (the teacher's slot).
        teacher_logprobs_at_student_ids: ``[..., R]`` the teacher's log-probabilities at ``student_topk_ids``
            (normalised over the full vocabulary, at the teacher's temperature); ignored where no id is held.
        kind: as for ``topk_divergence``.
        options: as for ``topk_divergence`` (or its fields as keyword arguments); ``tail`` applies to the mass
            outside the union, ``coverage_weight`` to the student's mass on it, and ``validate`` also checks the
            student's ids (in range, distinct) and the teacher's log-probabilities at them.

    Returns:
        Per-token losses with the logits' leading shape, equal on every rank of ``group``.
    """
    o = DivergenceOptions.of(options, keywords, loss="union_divergence", unused=("teacher_temperature",))
    kind, beta = resolve_kind(kind, o.beta)
    if o.tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {o.tail!r}")
    lead = student_logits.shape[:-1]
    check_id_columns("student_topk_ids", student_topk_ids, "teacher_logprobs_at_student_ids",
                     teacher_logprobs_at_student_ids, lead, "R", signed=True)  # fmt: skip
    check_id_columns("teacher_topk_ids", teacher_topk_ids, "teacher_topk_logprobs", teacher_topk_logprobs, lead, "K")
    k, r = teacher_topk_ids.shape[-1], student_topk_ids.shape[-1]
    device = student_logits.device
    ids_TN, present_TN = union_support(
        teacher_topk_ids.reshape(-1, k).to(device), student_topk_ids.reshape(-1, r).to(device)
    )
    dtype = torch.promote_types(teacher_topk_logprobs.dtype, teacher_logprobs_at_student_ids.dtype)
    logprobs_TN = torch.cat(
        [
            teacher_topk_logprobs.detach().reshape(-1, k).to(device, dtype),
            teacher_logprobs_at_student_ids.detach().reshape(-1, r).to(device, dtype),
        ],
        dim=1,
    )
    if o.validate:  # here, so that errors name the student's or the teacher's list
        shard = make_vocab_shard(as_rows(student_logits, "student_logits").shape[1], o.group, o.vocab_size)
        guessed = shard.group is None and o.vocab_size is None
        validate_topk(
            ids_TN, logprobs_TN, shard.vocab_size, kind, o.tail, lead, unsharded_guess=guessed, support_TK=present_TN,
            student_slots_from=k,
        )  # fmt: skip
    n = k + r
    return topk_divergence(
        student_logits,
        ids_TN.reshape(*lead, n),
        logprobs_TN.reshape(*lead, n),
        kind,
        support_mask=present_TN.reshape(*lead, n),
        options=replace(o, beta=beta, validate=False),
    )
