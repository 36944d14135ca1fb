"""Names and errors about model folders that the loader, the converter and the tokenizer code all use.

A leaf module (it imports nothing from the package), so ``checkpoint/``, ``models/``, ``vocab.py`` and
``tokenizer.py`` import these without import cycles; the modules that used to define them re-export them.
"""

HF_CONFIG_DIR = "hf_config"
"""Subfolder of a dist_ckpt holding the Hugging Face ``config.json`` and tokenizer files (tools/checkpoint writes it)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or disagrees with its config."""


class TokenizerError(ValueError):
    """A tokenizer cannot be found or does not fit its model."""


class UnsupportedArchitectureError(ValueError):
    """The config names a model family megatron-opd cannot build."""


class ConfigFileError(ValueError):
    """``config.json`` is not valid JSON, or lacks or mistypes a field every supported model sets."""
