"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's multi-latent attention (with a query latent) and router.

The layers, weight names and router are DeepSeek-V3's (:mod:`~megatron_opd.models.families.deepseek_v3`); the
dense first layers are named by ``mlp_layer_types`` (``["dense", "sparse", ...]``) where DeepSeek-V3 has
``first_k_dense_replace``, and the router fields vLLM's DeepSeek code reads are fixed in vLLM's GLM one. vLLM 0.32
reads ``first_k_dense_replace``, which transformers' ``Glm4MoeLiteConfig`` does not write: the HF export and the
engine complete it (:meth:`vllm_config_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.models.families.deepseek_v3 import (
    TINY_DEEPSEEK,
    DeepSeekV3Family,
    check_mla_moe,
    check_sigmoid_router,
    dense_prefix,
    read_config,
)
from megatron_opd.models.families.moe import QWEN_MOE_NAMES


def check_config(cfg: dict[str, Any]) -> None:
    check_mla_moe(cfg, "glm4_moe_lite")
    check_sigmoid_router(cfg, "glm4_moe_lite")


@dataclass(frozen=True)
class Glm4MoeLiteFamily(DeepSeekV3Family):
    def vllm_config_fields(self, cfg) -> dict[str, Any]:
        """``first_k_dense_replace`` from ``mlp_layer_types`` where the file lacks it (vLLM reads only the former)."""
        if "first_k_dense_replace" in cfg:
            return {}
        return {"first_k_dense_replace": dense_prefix(dict(cfg), int(cfg.get("num_hidden_layers") or 0))}


GLM_4_7_FLASH = dict(
    model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048, intermediate_size=10240,
    moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20,
    n_shared_experts=1, n_routed_experts=64, num_experts_per_tok=4, routed_scaling_factor=1.8, kv_lora_rank=512,
    q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=202752, rope_theta=1000000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=1,
)  # fmt: skip
"""GLM-4.7-Flash's published ``config.json`` sizes (published as 30B-A3B; its MTP layer is skipped)."""

_TINY = {k: v for k, v in TINY_DEEPSEEK.items() if k != "first_k_dense_replace"}

FAMILY = Glm4MoeLiteFamily(
    name="glm4_moe_lite",
    local_spec_only=True,
    model_types=("glm4_moe_lite",),
    read_config=read_config,
    check_config=check_config,
    vllm_fields={},  # vLLM's GLM router is sigmoid with the bias whatever the file says
    expert_names=replace(QWEN_MOE_NAMES, shared="model.layers.{layer}.mlp.shared_experts"),
    # DeepSeek-V3's tiny model (q-LoRA, YaRN, 16 experts in 4 groups), its dense layer 0 named by
    # ``mlp_layer_types`` (transformers' default) and no ``first_k_dense_replace`` in the file.
    tiny_config=_TINY,
    test_shapes={
        "glm4_moe_lite_mla": dict(
            tied=False, kv_heads=4, vocab_size=1000, rope="yarn", mlp="moe+shared-expert+dense-layer"
        ),
    },
    memory_configs={"GLM-4.7-Flash": GLM_4_7_FLASH},
)
