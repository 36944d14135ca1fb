"""DeepSeek-V2 and V2.5 (``deepseek_v2``): DeepSeek-V3's multi-latent attention with V2's softmax router.

Attention, YaRN and the weight names are DeepSeek-V3's (:mod:`~megatron_opd.models.families.deepseek_v3`;
V2-Lite has no query latent, ``q_lora_rank`` null). The router takes the softmax over every expert and keeps the
top-k scores as they are (transformers' DeepSeek-V2 never renormalises them, whatever ``norm_topk_prob`` says),
scaled by ``routed_scaling_factor``: Megatron's ``softmax`` router with ``moe_router_pre_softmax``.
``topk_method=group_limited_greedy`` first keeps the ``topk_group`` of ``n_group`` groups with the best single
score; Megatron ranks a group by the sum of its top ``top_k / topk_group`` scores (the same ranking only when
``num_experts_per_tok == topk_group``), so the MoE layers take
:func:`~megatron_opd.models.group_routers.group_max_router`, Megatron's router with the group ranking by the best
score: every group shape, the published DeepSeek-V2's top-6 of 160 experts in 3 of 8 groups included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.deepseek_v3 import (
    TINY_DEEPSEEK,
    DeepSeekV3Family,
    check_mla_moe,
    read_deepseek_moe,
    read_mla,
    read_routing,
)
from megatron_opd.models.families.moe import QWEN_MOE_NAMES

METHODS = ("greedy", "group_limited_greedy")


def check_config(cfg: dict[str, Any]) -> None:
    check_mla_moe(cfg, "deepseek_v2")
    method, scoring = cfg.get("topk_method") or "greedy", cfg.get("scoring_func") or "softmax"
    if method not in METHODS or scoring != "softmax":
        raise UnsupportedArchitectureError(
            f"config.json topk_method={method!r} scoring_func={scoring!r}: deepseek_v2 models route with softmax "
            f"scores and one of {METHODS} (DeepSeek-V3's sigmoid noaux_tc router is model_type deepseek_v3)"
        )
    top_k, n_group, topk_group = cfg.get("num_experts_per_tok"), cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    experts = cfg.get("n_routed_experts") or 0
    if method == "group_limited_greedy" and n_group > 1 and top_k > topk_group * (experts // n_group):
        raise UnsupportedArchitectureError(
            f"config.json topk_method=group_limited_greedy with num_experts_per_tok={top_k}, topk_group="
            f"{topk_group}, n_group={n_group}, n_routed_experts={experts}: the {topk_group} chosen groups hold "
            f"fewer than {top_k} experts; raise topk_group"
        )


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    routing = read_routing(cfg, source, score_function="softmax", expert_bias=False)
    if (cfg.get("topk_method") or "greedy") == "greedy":  # transformers ignores the groups then
        routing = replace(routing, n_group=1, topk_group=1)
    return dict(**read_mla(cfg, source), moe=read_deepseek_moe(cfg, source, norm_topk_prob=False), routing=routing)


@dataclass(frozen=True)
class DeepSeekV2Family(DeepSeekV3Family):
    def check_vllm_config(self, cfg, source: str) -> None:
        """vLLM 0.32's DeepSeek-V2 renormalises the top-k when ``norm_topk_prob`` is true and groups the experts
        with ``topk_method=greedy`` too; transformers (and the trainer) do neither."""
        if cfg.get("norm_topk_prob"):
            raise ValueError(
                f"{source} has norm_topk_prob=true: vLLM would renormalise this deepseek_v2 model's top-k scores, "
                "transformers and the trainer do not; set it to false (as published DeepSeek-V2 checkpoints have)"
            )
        method, n_group, topk_group = cfg.get("topk_method") or "greedy", cfg.get("n_group"), cfg.get("topk_group")
        if method == "greedy" and (n_group or 1) > (topk_group or 1):
            raise ValueError(
                f"{source} has topk_method=greedy with n_group={n_group}, topk_group={topk_group}: vLLM would limit "
                "the experts to the best groups, transformers and the trainer do not; set n_group and topk_group to 1"
            )
        super().check_vllm_config(cfg, source)

    def mla_layer_spec(self, arch, options, num_experts: int | None = None):
        """DeepSeek-V3's layer spec; MoE layers routed within groups take the group-max router."""
        spec = super().mla_layer_spec(arch, options, num_experts=num_experts)
        if num_experts and arch.routing.n_group > 1:
            from megatron_opd.models.families.base import mlp_submodules
            from megatron_opd.models.group_routers import group_max_router

            mlp_submodules(spec).router = group_max_router()
        return spec

    def vllm_config_fields(self, cfg) -> dict[str, Any]:
        """``n_group`` and ``topk_group`` 1 where ``topk_method=greedy`` leaves them null (transformers'
        ``DeepseekV2Config`` default): vLLM 0.32's CPU router asserts ``topk_group`` is set."""
        if (cfg.get("topk_method") or "greedy") != "greedy":
            return {}
        return {k: 1 for k in ("n_group", "topk_group") if cfg.get(k) is None}


DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    num_experts_per_tok=6, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, first_k_dense_replace=1,
    norm_topk_prob=False, scoring_func="softmax", max_position_embeddings=163840, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
)  # fmt: skip
"""DeepSeek-V2-Lite's published ``config.json`` sizes (published as 16B-A2.4B)."""

FAMILY = DeepSeekV2Family(
    name="deepseek_v2",
    local_spec_only=True,
    model_types=("deepseek_v2",),
    read_config=read_config,
    check_config=check_config,
    vllm_fields={},  # vLLM's defaults (softmax, no bias without noaux_tc) are transformers' for DeepSeek-V2
    expert_names=replace(QWEN_MOE_NAMES, shared="model.layers.{layer}.mlp.shared_experts"),
    # DeepSeek-V3's tiny model without a query latent (V2-Lite), routed group-limited as the published V2 (top-k
    # twice topk_group, where Megatron's group ranking, the sum of a group's top-2, and the best score differ: on
    # 15-20% of the matrix's tokens): the top 2 of 8 experts, from the best of 2 groups by its best score, scaled by
    # 2.5, not renormalised (8, not 16: softmax scores of 16 experts come within 3e-7 of a tie on the matrix's
    # tokens).
    tiny_config={
        **TINY_DEEPSEEK,
        "q_lora_rank": None,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "group_limited_greedy",
        "norm_topk_prob": False,
    },
    test_shapes={
        "deepseek_v2_softmax": dict(
            tied=False, kv_heads=4, vocab_size=1000, rope="yarn", mlp="moe+shared-expert+dense-layer"
        ),
    },
    memory_configs={"DeepSeek-V2-Lite": DEEPSEEK_V2_LITE},
)
