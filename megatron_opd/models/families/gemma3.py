"""Gemma 3 (text): sandwich norms with ``1 + w`` weights, embeddings scaled by sqrt(hidden), GeGLU with tanh GELU,
``query_pre_attn_scalar``, per-head QK-norm, tied embeddings, and sliding-window layers (``layer_types``) with their
own RoPE base (``rope_local_base_freq``) between the global ones.

What Megatron-Core lacks comes through the spec: :func:`~megatron_opd.models.norms.post_normed` wraps both output
projections, :func:`~megatron_opd.models.attention.per_layer_rope_attention` picks each layer's RoPE from the
two-base rotary module (``models.rope``), and the embedding output is scaled in :meth:`Gemma3Family.build_chunk`.
The local spec runs everywhere. Gemma 2 (``families.gemma2``) adds logit soft-capping to these layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import RopeConfig
from megatron_opd.models.families.base import ModelFamily, SpecOptions, read_sliding_window
from megatron_opd.models.weight_rule import Split, WeightRule


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Gemma's ``gelu_pytorch_tanh`` (a module-level function: the config is pickled with checkpoints)."""
    return F.gelu(x, approximate="tanh")


def check_config(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"config.json hidden_activation={act!r}: gemma3 supports gelu_pytorch_tanh")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            raise UnsupportedArchitectureError(f"config.json {name}={cfg[name]!r}: logit soft-capping is not built")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("config.json use_bidirectional_attention=true is not supported")
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for gemma3 models")


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    from megatron_opd.models import rope as rope_lib

    layers = cfg.get("num_hidden_layers") or 0
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # older configs: every pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != layers:
        raise UnsupportedArchitectureError(
            f"{source} layer_types must list sliding_attention/full_attention for each of {layers} layers"
        )
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("sliding_attention"), dict):
        local = rope_lib.rope_from_hf({"rope_parameters": params["sliding_attention"]})
    else:
        local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    if rope_lib.attention_factor(local) != rope_lib.attention_factor(rope_lib.rope_from_hf(cfg)):
        raise UnsupportedArchitectureError(f"{source}: sliding and global layers' RoPE attention factors differ")
    window = read_sliding_window(cfg, source)
    return dict(
        qkv_bias=False,
        qk_norm=True,
        sliding_window=window,
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types) if window else None,
        local_rope=local,
        softmax_scale=float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim") or 256)) ** -0.5,
    )


@dataclass(frozen=True)
class Gemma3Family(ModelFamily):
    def transformer_config_fields(self, arch) -> dict[str, Any]:
        return {**super().transformer_config_fields(arch), "activation_func": gelu_tanh}

    def local_norm(self, options: SpecOptions):
        from megatron_opd.models.norms import OffsetRMSNorm

        return OffsetRMSNorm

    def final_norm(self, options: SpecOptions):
        return self.local_norm(options)

    def layer_specs(self, arch, layers: Sequence[int], options: SpecOptions) -> list:
        from megatron.core.transformer.attention import SelfAttention

        from megatron_opd.models.attention import per_layer_rope_attention
        from megatron_opd.models.families.olmo2 import sandwich_spec

        norm = self.local_norm(options)
        spec = sandwich_spec(self, options, pre_norms=True, qk_norm=(norm, norm), post_norm=norm)
        if arch.local_rope is not None:
            spec.submodules.self_attention.module = per_layer_rope_attention(SelfAttention)
        return [spec] * len(layers)

    def build_chunk(self, arch, config, block_spec, **gpt_kwargs):
        from megatron_opd.models import rope

        model = super().build_chunk(arch, config, block_spec, **gpt_kwargs)
        if arch.local_rope is not None:
            rope.install(model, arch.rope, arch.head_dim, local=arch.local_rope)
        if gpt_kwargs.get("pre_process"):
            scale = math.sqrt(arch.hidden_size)
            # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype
            model.embedding.register_forward_hook(lambda _m, _a, out: out * torch.tensor(scale, dtype=out.dtype))
        return model

    def weight_rules(self, arch) -> list[WeightRule]:
        attn, mlp, ml = "model.layers.{layer}.self_attn", "model.layers.{layer}.mlp", "decoder.layers.{layer}"
        sa, hl = f"{ml}.self_attention", "model.layers.{layer}"
        rules = [
            WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
            WeightRule(f"{ml}.input_layernorm.weight", (f"{hl}.input_layernorm.weight",), Split.REPLICATED),
            WeightRule(
                f"{sa}.linear_qkv.weight",
                (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
                Split.QKV,
            ),
            WeightRule(f"{sa}.q_layernorm.weight", (f"{attn}.q_norm.weight",), Split.REPLICATED),
            WeightRule(f"{sa}.k_layernorm.weight", (f"{attn}.k_norm.weight",), Split.REPLICATED),
            WeightRule(f"{sa}.linear_proj.weight", (f"{attn}.o_proj.weight",), Split.ROW),
            WeightRule(
                f"{sa}.linear_proj.post_norm.weight", (f"{hl}.post_attention_layernorm.weight",), Split.REPLICATED
            ),
            WeightRule(f"{ml}.pre_mlp_layernorm.weight", (f"{hl}.pre_feedforward_layernorm.weight",), Split.REPLICATED),
            WeightRule(
                f"{ml}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), Split.GATE_UP
            ),
            WeightRule(f"{ml}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), Split.ROW),
            WeightRule(
                f"{ml}.mlp.linear_fc2.post_norm.weight", (f"{hl}.post_feedforward_layernorm.weight",), Split.REPLICATED
            ),
            WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
        ]
        if not arch.tie_word_embeddings:
            rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB))
        return rules


FAMILY = Gemma3Family(
    name="gemma3",
    local_spec_only=True,
    model_types=("gemma3_text",),
    read_config=read_config,
    check_config=check_config,
    # Sliding and global layers alternate (window 5 < the tests' 16 tokens); local RoPE base 10k, global 1M;
    # query_pre_attn_scalar 256 (not the head dim 32): a wrong softmax scale shows.
    tiny_config=dict(
        sliding_window=5,
        sliding_window_pattern=2,
        query_pre_attn_scalar=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),  # fmt: skip
    test_shapes={"gemma3_sandwich": dict(tied=True, kv_heads=2, vocab_size=1001, rope="linear")},
    memory_configs={
        "gemma-3-1b-it": dict(
            model_type="gemma3_text",
            hidden_size=1152,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=6912,
            vocab_size=262144,
            max_position_embeddings=32768,
            sliding_window=512,
            query_pre_attn_scalar=256,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            tie_word_embeddings=True,
        ),
    },  # fmt: skip
)
