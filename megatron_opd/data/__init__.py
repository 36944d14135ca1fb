"""Prompt data: records from JSONL/Parquet files, their token ids, the per-rank prompt stream, and the packed batch
of a step (``data.batch``)."""

from megatron_opd.data.prompts import PromptEncoder, load_prompts
from megatron_opd.data.records import DataError, read_record_files, read_records
from megatron_opd.data.stream import PromptItem, PromptStream

__all__ = [
    "DataError",
    "PromptEncoder",
    "PromptItem",
    "PromptStream",
    "load_prompts",
    "read_record_files",
    "read_records",
]
