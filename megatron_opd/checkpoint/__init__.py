"""Checkpoint conversion between Hugging Face safetensors and Megatron-Core ``dist_ckpt``, streamed tensor by tensor."""

from megatron_opd.checkpoint.atomic import OutputExistsError
from megatron_opd.checkpoint.hf_to_mcore import ConversionResult, convert_hf_to_mcore
from megatron_opd.checkpoint.layout import CheckpointLayout, checkpoint_layout
from megatron_opd.checkpoint.mcore_io import load_model_checkpoint
from megatron_opd.checkpoint.mcore_to_hf import convert_mcore_to_hf
from megatron_opd.checkpoint.verify import LogitsComparison, verify_conversion

__all__ = [
    "CheckpointLayout",
    "ConversionResult",
    "LogitsComparison",
    "OutputExistsError",
    "checkpoint_layout",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "load_model_checkpoint",
    "verify_conversion",
]
