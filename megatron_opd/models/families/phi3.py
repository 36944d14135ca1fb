"""Phi-3 and Phi-4 (text): the dense decoder with fused ``qkv_proj`` and ``gate_up_proj`` checkpoint tensors,
``partial_rotary_factor`` and LongRoPE (``models.rope``), ``sliding_window`` honoured when set."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily, read_sliding_window
from megatron_opd.models.weight_rule import WeightRule


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for phi3 models")
    return dict(qkv_bias=False, qk_norm=False, sliding_window=read_sliding_window(cfg, source))


FUSED = {
    "self_attention.linear_qkv.weight": "model.layers.{layer}.self_attn.qkv_proj.weight",
    "mlp.linear_fc1.weight": "model.layers.{layer}.mlp.gate_up_proj.weight",
}


@dataclass(frozen=True)
class Phi3Family(ModelFamily):
    def weight_rules(self, arch) -> list[WeightRule]:
        """The dense decoder's rules, with the checkpoint's fused q/k/v and gate/up tensors."""
        rules = []
        for rule in super().weight_rules(arch):
            fused = [hf for suffix, hf in FUSED.items() if rule.megatron.endswith(suffix)]
            rules.append(replace(rule, hf=(fused[0],)) if fused else rule)
        return rules


_SHORT = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0]  # rotary dims / 2 = 32 * 0.5 / 2 factors

FAMILY = Phi3Family(
    name="phi3",
    model_types=("phi3",),
    read_config=read_config,
    # Head dim = hidden / heads = 32; half of it rotated; LongRoPE within its original 64 positions (attention
    # factor 1.155 for a context of 256).
    tiny_config=dict(
        hidden_size=128,
        pad_token_id=0,  # Phi-3's default pad/eos ids (32000) are past the tiny vocabulary
        eos_token_id=2,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="longrope", short_factor=_SHORT, long_factor=[x * 4 for x in _SHORT]),
    ),
    test_shapes={"phi3_fused_partial": dict(tied=False, kv_heads=4, vocab_size=1001, rope="longrope")},
    memory_configs={
        "Phi-4-mini-instruct": dict(
            model_type="phi3",
            hidden_size=3072,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=200064,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            partial_rotary_factor=0.75,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    },  # fmt: skip
)
