"""The settings every divergence of this package shares, in one object (``DivergenceOptions``), and the per-token
statistics a forward pass hands back beside its loss (``PassStatistics``).

``dense_divergence``, ``topk_divergence`` and ``union_divergence`` take ``options=DivergenceOptions(...)`` or the
same fields as keyword arguments (``tail="renorm"``); keywords override the object's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist


@dataclass
class PassStatistics:
    """What a divergence's forward computes anyway and the caller may read, at no extra pass."""

    student_lse: torch.Tensor | None = None
    """The student's log-normaliser at ``student_temperature`` over the whole vocabulary (the logits' leading shape).
    With the logits gathered at a label before an in-place call (which overwrites them), it gives the label's
    log-probability: the rollout-fidelity monitor reads it that way."""


@dataclass(frozen=True)
class DivergenceOptions:
    """How a divergence is computed (each loss reads the fields that apply to it)."""

    beta: float = 0.5
    """The teacher's weight in the JSD mixture ``beta * teacher + (1 - beta) * student``, in [0, 1]; ignored by the
    KLs."""
    tail: str = "bucket"
    """Top-k losses: ``"bucket"`` (k ids plus one bucket for the remaining mass; exact), ``"renorm"`` (both
    renormalised over the k ids) or ``"ignore"`` (k ids' terms with masses as they are, as verl does)."""
    coverage_weight: float = 0.0
    """Top-k losses: adds ``coverage_weight * -log(student mass on the support)`` per token (TCAD's coverage term),
    with its exact gradient."""
    student_temperature: float = 1.0
    """The student's logits are divided by it."""
    teacher_temperature: float = 1.0
    """The dense teacher's logits are divided by it (a top-k teacher's log-probabilities come at its temperature)."""
    chunk_size: int | None = None
    """Tokens per chunk (peak extra memory grows with it, not with the sequence); ``None`` picks about 1M shard
    elements per chunk on CPU, 64M with torch on GPU, and one chunk with the Triton kernels."""
    group: dist.ProcessGroup | None = None
    """The tensor-parallel group the vocabulary is split over; ``None`` means Megatron-Core's tensor-parallel group if
    ``parallel_state`` is initialised, else a single process."""
    vocab_size: int | None = None
    """The true vocabulary size when the shards include Megatron's padding columns; those columns are excluded from
    both distributions and get zero gradient (ids must be below it). Defaults to the full padded width."""
    validate: bool = True
    """Check the inputs: dense, a ``ValueError`` naming the first token whose logits hold a NaN or ``+inf`` or no
    finite value (one reduction and a host sync); top-k, the teacher's ids and log-probabilities (a few reductions and
    host syncs). With ``False`` such inputs give undefined (NaN) losses; a trainer with its own NaN check passes it."""
    inplace_backward: bool = False
    """Reuse ``student_logits``' storage, as Megatron's vocab-parallel cross entropy does: no ``tokens x V/TP``
    gradient is allocated, and on the torch path the forward leaves the student's exponentials there for backward.
    From the call on, the logits hold intermediates and then the gradient: use it only when nothing reads them after
    the loss (true for the output layer's logits in training)."""
    backend: str = "auto"
    """``"auto"`` (Triton kernels on CUDA when available), ``"torch"`` or ``"triton"``."""
    outputs: PassStatistics | None = None
    """Receives the forward's per-token statistics (``PassStatistics``); None: not kept."""

    @classmethod
    def of(cls, options: DivergenceOptions | None, keywords: dict, *, loss: str, unused: tuple[str, ...] = ()):
        """``options`` (default: all defaults) with ``keywords`` overriding its fields; a keyword that is no field,
        or one of ``unused`` (which ``loss`` does not take), is refused as Python refuses an unknown argument."""
        names = {f.name for f in fields(cls)}
        unknown = [k for k in keywords if k not in names or k in unused]
        if unknown:
            raise TypeError(f"{loss}() got an unexpected keyword argument {unknown[0]!r}")
        return replace(options if options is not None else cls(), **keywords)
