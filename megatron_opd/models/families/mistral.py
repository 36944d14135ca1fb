"""Mistral (Mistral 7B, Ministral, Mistral Small): the Llama decoder with ``sliding_window`` honoured when set."""

from __future__ import annotations

from typing import Any

from megatron_opd.models.families.base import ModelFamily, read_sliding_window


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    return dict(qkv_bias=False, qk_norm=False, sliding_window=read_sliding_window(cfg, source))


FAMILY = ModelFamily(
    name="mistral",
    model_types=("mistral",),
    read_config=read_config,
    # A window of 5 keys: shorter than every tested sequence, so a window that is ignored shows.
    tiny_config=dict(sliding_window=5, rope_theta=1000000.0),
    test_shapes={"mistral_window": dict(tied=False, kv_heads=2, vocab_size=1001, rope="none")},
    memory_configs={
        "Mistral-7B-v0.1": dict(
            model_type="mistral",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            sliding_window=4096,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    },  # fmt: skip
)
