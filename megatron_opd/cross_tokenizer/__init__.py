"""Distillation between a student and a teacher that tokenize differently: token groups aligned by byte offsets,
and a map between the tokens both vocabularies hold."""

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
from megatron_opd.cross_tokenizer.vocabulary_map import VocabularyMap

__all__ = [
    "Alignment",
    "AlignmentStats",
    "Group",
    "TextMismatchError",
    "TokenBytes",
    "VocabularyMap",
    "align",
    "align_batch",
    "alignment_stats",
]
