"""Mixtral (8x7B, 8x22B): Llama's attention with every MLP a top-2 MoE layer of ``intermediate_size``-wide experts
(``block_sparse_moe.experts.N.w1/w3/w2`` = gate/up/down), untied embeddings."""

from __future__ import annotations

from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.moe import ExpertNames, MoEFamily, read_moe


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for mixtral models")
    return dict(
        qkv_bias=False,
        qk_norm=False,
        moe=read_moe(cfg, source, expert_ffn_key="intermediate_size", shared=False, experts_key="num_local_experts"),
    )


_MOE = "model.layers.{layer}.block_sparse_moe"

FAMILY = MoEFamily(
    name="mixtral",
    model_types=("mixtral",),
    read_config=read_config,
    expert_names=ExpertNames(
        router=f"{_MOE}.gate.weight",
        gate=f"{_MOE}.experts.{{expert}}.w1.weight",
        up=f"{_MOE}.experts.{{expert}}.w3.weight",
        down=f"{_MOE}.experts.{{expert}}.w2.weight",
    ),
    tiny_config=dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, rope_theta=1000000.0),
    test_shapes={"mixtral_untied": dict(tied=False, kv_heads=2, vocab_size=1001, rope="none", mlp="moe")},
)
