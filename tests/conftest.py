"""Shared fixtures: tiny Hugging Face checkpoints built once per test session."""

from __future__ import annotations

import pytest

from megatron_opd.testing.tiny_models import make_tiny_hf_model

# family -> overrides. Together they cover llama3 RoPE scaling, QKV bias, QK-norm, tied embeddings,
# and a vocabulary (1001) that divides by neither TP nor 128.
TINY_MODELS = {
    "llama": dict(),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(vocab_size=1001),
}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: str(make_tiny_hf_model(family, root / family, seed=i, **overrides))
        for i, (family, overrides) in enumerate(TINY_MODELS.items())
    }
