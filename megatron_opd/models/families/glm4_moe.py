"""GLM-4.5, GLM-4.6 and GLM-4.7 (``glm4_moe``): grouped-query attention with DeepSeek-V3's router.

Attention is the dense decoder's: q/k/v biases (``attention_bias``), optional per-head RMSNorms on queries and keys
before the rotation (``use_qk_norm``; GLM-4.5 sets it), rotary embedding on the first ``partial_rotary_factor``
(0.5) of each head in transformers' non-interleaved (``rotate_half``) layout, as Megatron's ``rotary_percent``
rotates. The MLPs are Megatron's ``MoELayer`` after the first ``first_k_dense_replace`` dense layers, routed as
DeepSeek-V3 routes (:mod:`~megatron_opd.models.families.deepseek_v3`: sigmoid scores, ``e_score_correction_bias``,
group-limited, renormalised and scaled by ``routed_scaling_factor``), with ``n_shared_experts`` shared experts as
one ungated SwiGLU. Published checkpoints carry ``num_nextn_predict_layers`` multi-token-prediction layers after the
decoder; they are skipped (``models.mtp``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families.deepseek_v3 import (
    check_sigmoid_router,
    read_deepseek_moe,
    read_routing,
    router_fields,
    with_expert_bias,
)
from megatron_opd.models.families.moe import QWEN_MOE_NAMES, MoEFamily, check_moe_config
from megatron_opd.models.weight_rule import WeightRule


def check_config(cfg: dict[str, Any]) -> None:
    check_moe_config(cfg)
    check_sigmoid_router(cfg, "glm4_moe")


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    return dict(
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        moe=read_deepseek_moe(cfg, source),
        routing=read_routing(cfg, source, score_function="sigmoid", expert_bias=True),
    )


@dataclass(frozen=True)
class Glm4MoeFamily(MoEFamily):
    """The MoE decoder with DeepSeek-V3's router fields and expert bias."""

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        return {**super().transformer_config_fields(arch), **router_fields(arch.routing)}

    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        return with_expert_bias(super().weight_rules(arch), arch)


GLM_4_5_AIR = dict(
    model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_shared_experts=1,
    n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
    partial_rotary_factor=0.5, rope_theta=1000000, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, num_nextn_predict_layers=1,
)  # fmt: skip
"""GLM-4.5-Air's published ``config.json`` sizes (published as 106B-A12B, its MTP layer included; megatron-opd skips it)."""

FAMILY = Glm4MoeFamily(
    name="glm4_moe",
    model_types=("glm4_moe",),
    read_config=read_config,
    check_config=check_config,
    expert_names=replace(QWEN_MOE_NAMES, shared="model.layers.{layer}.mlp.shared_experts"),
    # 8 experts in 2 groups, the top 2 of the best group, a shared expert, layer 0 dense, q/k/v biases and
    # QK-norms, half of each 32-wide head rotated; no MTP layer (transformers' default declares one).
    tiny_config=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=0,
    ),
    test_shapes={
        "glm4_moe_partial_bias": dict(
            tied=False, kv_heads=2, vocab_size=1000, rope="none", mlp="moe+shared-expert+dense-layer"
        ),
    },
    memory_configs={"GLM-4.5-Air": GLM_4_5_AIR},
)
