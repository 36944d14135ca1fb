"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK-norm, no bias) with routed experts, dense
MLPs in ``mlp_only_layers`` and off the ``decoder_sparse_step``."""

from __future__ import annotations

from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.moe import QWEN_MOE_NAMES, TINY_MOE, MoEFamily, read_moe


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for qwen3_moe models")
    return dict(
        qkv_bias=False, qk_norm=True, moe=read_moe(cfg, source, expert_ffn_key="moe_intermediate_size", shared=False)
    )


def upcycle_config(dense: dict[str, Any], experts: int, top_k: int) -> dict[str, Any]:
    """A Qwen3 ``config.json`` as Qwen3-MoE's: every layer MoE, experts as wide as the dense MLP, top-k renormalised
    (so that identical experts compute the dense MLP exactly)."""
    fields = {k: v for k, v in dense.items() if k not in ("architectures", "model_type")}
    return {**fields, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": dense["intermediate_size"],
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


FAMILY = MoEFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    read_config=read_config,
    upcycles_from=("qwen3",),
    upcycle_config=upcycle_config,
    expert_names=QWEN_MOE_NAMES,
    tiny_config=dict(**TINY_MOE, mlp_only_layers=[0], norm_topk_prob=True),
    test_shapes={"qwen3_moe_dense0": dict(tied=False, kv_heads=2, vocab_size=1001, rope="none", mlp="moe+dense-layer")},
    memory_configs={
        "Qwen3-30B-A3B": dict(
            model_type="qwen3_moe",
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    },
)
