"""Qwen3 (dense): the dense decoder with RMSNorm on each head's queries and keys (QK-norm), no attention bias."""

from __future__ import annotations

from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        # attention_bias also puts a bias on o_proj, which Megatron's GPTModel cannot hold alone.
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for qwen3 models")
    return dict(qkv_bias=False, qk_norm=True)


FAMILY = ModelFamily(
    name="qwen3",
    model_types=("qwen3",),
    read_config=read_config,
    test_shapes={
        "qwen3_tied": dict(tied=True, kv_heads=2, vocab_size=1001, rope="yarn"),
        "qwen3_one_kv": dict(tied=False, kv_heads=1, vocab_size=1001, rope="yarn"),
    },
    memory_configs={
        "Qwen3-32B": dict(
            model_type="qwen3",
            hidden_size=5120,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=25600,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        "Qwen3-1.7B": dict(
            model_type="qwen3",
            hidden_size=2048,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=6144,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    },  # fmt: skip
)
