"""Llama (Llama 2, Llama 3.x): the dense decoder with no attention bias; Llama 3.1's RoPE scaling."""

from __future__ import annotations

from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        # attention_bias also puts a bias on o_proj, which Megatron's GPTModel cannot hold alone.
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for llama models")
    return dict(qkv_bias=False, qk_norm=False)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip

FAMILY = ModelFamily(
    name="llama",
    model_types=("llama",),
    read_config=read_config,
    tiny_config=dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    test_shapes={"llama_tied": dict(tied=True, kv_heads=2, vocab_size=1001, rope="llama3")},
    memory_configs={
        "Llama-3.1-70B-Instruct": dict(
            model_type="llama",
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_scaling=_LLAMA3_ROPE,
            tie_word_embeddings=False,
        ),
        "Llama-3.1-8B-Instruct": dict(
            model_type="llama",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_scaling=_LLAMA3_ROPE,
            tie_word_embeddings=False,
        ),
    },  # fmt: skip
)
