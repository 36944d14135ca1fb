"""Megatron-Core GPT models built from Hugging Face configs and weights of the families in ``models/families/``."""

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.builder import ModelBuildConfig, build_model, transformer_config, validate_layout
from megatron_opd.models.hf_config import architecture_from_hf_config, load_architecture
from megatron_opd.models.hf_io import CheckpointError, HFCheckpointReader, HFCheckpointWriter
from megatron_opd.models.loading import load_hf_weights

__all__ = [
    "CheckpointError",
    "HFCheckpointReader",
    "HFCheckpointWriter",
    "ModelArchitecture",
    "ModelBuildConfig",
    "UnsupportedArchitectureError",
    "architecture_from_hf_config",
    "build_model",
    "load_architecture",
    "load_hf_weights",
    "transformer_config",
    "validate_layout",
]
