"""Vocab-parallel distillation losses that never gather the vocabulary.

- ``dense_divergence``: student vs a colocated teacher whose logits are sharded the same way.
- ``topk_divergence``: student vs a remote teacher's top-k (global ids, log-probabilities).
- ``union_divergence``: the top-k loss over the union of the teacher's and the student's top-k ids (TCAD).
- ``reduce_loss``: masking and token / sequence mean / sum of the per-token losses they return.
- ``DivergenceOptions``: the settings the three share (``beta``, ``tail``, ``chunk_size``, ...), as one object or
  as keyword arguments.

See ``docs/losses.md`` for the maths, the gradients and what crosses ranks.
"""

from megatron_opd.losses.dense import dense_divergence
from megatron_opd.losses.divergences import KINDS, DivergenceKind
from megatron_opd.losses.options import DivergenceOptions, PassStatistics
from megatron_opd.losses.reduction import ReductionMode, reduce_loss
from megatron_opd.losses.topk import MASS_TOLERANCE, MIN_TAIL_MASS, TAILS, topk_divergence
from megatron_opd.losses.union import union_divergence

__all__ = [
    "KINDS",
    "MASS_TOLERANCE",
    "MIN_TAIL_MASS",
    "TAILS",
    "DivergenceKind",
    "DivergenceOptions",
    "PassStatistics",
    "ReductionMode",
    "dense_divergence",
    "reduce_loss",
    "topk_divergence",
    "union_divergence",
]
