"""Qwen2 / Qwen2.5: the dense decoder with a bias on the query, key and value projections."""

from __future__ import annotations

from typing import Any

from megatron_opd.models.families.base import ModelFamily


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    # Qwen2 configs have no attention_bias field: the QKV bias is always there unless a config turns it off.
    return dict(qkv_bias=cfg.get("attention_bias", True) is not False, qk_norm=False)


FAMILY = ModelFamily(
    name="qwen2",
    model_types=("qwen2",),
    read_config=read_config,
    # Qwen2 derives head_dim from hidden_size / heads in vLLM: keep the two consistent (and >= 32).
    tiny_config=dict(rope_theta=1000000.0, hidden_size=128),
    test_shapes={"qwen2_mha_v97": dict(tied=False, kv_heads=4, vocab_size=97, rope="linear")},
)
