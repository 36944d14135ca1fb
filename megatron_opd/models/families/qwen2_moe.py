"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (QKV bias) with routed experts and a shared
expert every token goes through, its output scaled by a sigmoid gate."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_opd.models.families.moe import QWEN_MOE_NAMES, TINY_MOE, MoEFamily, read_moe


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    # Qwen2-MoE configs say qkv_bias (transformers 5) or nothing (always there).
    bias = cfg.get("qkv_bias", cfg.get("attention_bias", True)) is not False
    return dict(
        qkv_bias=bias, qk_norm=False, moe=read_moe(cfg, source, expert_ffn_key="moe_intermediate_size", shared=True)
    )


FAMILY = MoEFamily(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    read_config=read_config,
    expert_names=replace(
        QWEN_MOE_NAMES,
        shared="model.layers.{layer}.mlp.shared_expert",
        shared_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
    ),
    tiny_config=dict(**TINY_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False),
    test_shapes={
        "qwen2_moe_shared": dict(tied=True, kv_heads=4, vocab_size=97, rope="linear", mlp="moe+shared-expert")
    },
)
