"""Seed-OSS (ByteDance): the dense decoder with a bias on the query, key and value projections but none on the
output projection (``attention_bias`` / ``attention_out_bias``), and a head dim that is not hidden / heads."""

from __future__ import annotations

from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_out_bias"):
        # A bias on o_proj alone: Megatron's GPTModel has one add_bias_linear for every output projection.
        raise UnsupportedArchitectureError(f"{source} attention_out_bias=true is not supported for seed_oss models")
    return dict(qkv_bias=cfg.get("attention_bias", True) is not False, qk_norm=False)


FAMILY = ModelFamily(
    name="seed_oss",
    model_types=("seed_oss",),
    read_config=read_config,
    # head_dim 32 against hidden 64 / 4 heads = 16: a head dim derived from the hidden size shows. Dropout off (the
    # class defaults to 0.1; megatron-opd's dropout is build.attention_dropout / build.hidden_dropout).
    tiny_config=dict(attention_bias=True, attention_dropout=0.0, residual_dropout=0.0),
    test_shapes={"seed_oss_qkv_bias": dict(tied=False, kv_heads=2, vocab_size=1001, rope="none")},
    memory_configs={
        "Seed-OSS-36B-Instruct": dict(
            model_type="seed_oss",
            hidden_size=5120,
            num_hidden_layers=64,
            num_attention_heads=80,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=27648,
            vocab_size=155136,
            max_position_embeddings=524288,
            rope_theta=10000000.0,
            attention_bias=True,
            attention_out_bias=False,
            tie_word_embeddings=False,
        ),
    },  # fmt: skip
)
