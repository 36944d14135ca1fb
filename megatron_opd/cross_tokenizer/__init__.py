"""Distillation between a student and a teacher that tokenize differently: token groups aligned by byte offsets."""

from megatron_opd.cross_tokenizer.alignment import (
    Alignment,
    AlignmentStats,
    Group,
    TextMismatchError,
    TokenBytes,
    align,
    align_batch,
    alignment_stats,
)

__all__ = [
    "Alignment",
    "AlignmentStats",
    "Group",
    "TextMismatchError",
    "TokenBytes",
    "align",
    "align_batch",
    "alignment_stats",
]
