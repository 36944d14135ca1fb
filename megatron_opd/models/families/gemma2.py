"""Gemma 2: Gemma 3's layers without QK-norm (sandwich norms with ``1 + w`` weights, embeddings scaled by
sqrt(hidden), GeGLU with tanh GELU, ``query_pre_attn_scalar``, sliding-window layers alternating with global ones,
one RoPE), plus soft-capped attention logits and soft-capped final logits (``c * tanh(x / c)``).

Megatron-Core has no softcap: the attention cap goes to :class:`~megatron_opd.models.attention.SDPAttention`
through the layer spec (``build.attention=sdpa`` only: Megatron's local attention is refused by name), the final cap
is a forward hook on the output layer, elementwise on each tensor-parallel rank's vocabulary shard. Hidden states
times the output weight are then not the logits: the trainer's fused output-layer loss falls back to the logits
(``loss.fused_output=on`` is refused), the in-process teacher scores logit shards, and a teacher server refuses
``teacher.transfer=hidden`` (``models.output.HiddenStateOutput.exact``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_opd.model_files import ConfigFileError, UnsupportedArchitectureError
from megatron_opd.models.families.base import SpecOptions, read_sliding_window
from megatron_opd.models.families.gemma3 import Gemma3Family
from megatron_opd.models.weight_rule import WeightRule


def check_config(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"config.json hidden_activation={act!r}: gemma2 supports gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("config.json use_bidirectional_attention=true is not supported")
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for gemma2 models")


def _cap(cfg: dict[str, Any], name: str, source: str) -> float | None:
    value = cfg.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigFileError(f"{source} field {name!r} must be a positive number or null, got {value!r}; fix the file")
    return float(value)


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    layers = cfg.get("num_hidden_layers") or 0
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' default: even layers slide, odd ones are global
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if set(layer_types) - {"sliding_attention", "full_attention"} or len(layer_types) != layers:
        raise UnsupportedArchitectureError(
            f"{source} layer_types must list sliding_attention/full_attention for each of {layers} layers"
        )
    window = read_sliding_window(cfg, source)
    return dict(
        qkv_bias=False,
        qk_norm=False,
        sliding_window=window,
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types) if window else None,
        softmax_scale=float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim") or 256)) ** -0.5,
        attn_logit_softcapping=_cap(cfg, "attn_logit_softcapping", source),
        final_logit_softcapping=_cap(cfg, "final_logit_softcapping", source),
    )


@dataclass(frozen=True)
class Gemma2Family(Gemma3Family):
    def layer_specs(self, arch, layers: Sequence[int], options: SpecOptions) -> list:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_opd.models.attention import SDPAttention
        from megatron_opd.models.families.olmo2 import sandwich_spec

        norm = self.local_norm(options)
        spec = sandwich_spec(self, options, pre_norms=True, qk_norm=None, post_norm=norm)
        if arch.attn_logit_softcapping is not None:
            if options.attention != "sdpa":
                raise ValueError(
                    f"build.attention={options.attention}: Megatron's local attention has no attention logit "
                    f"soft-capping, which this gemma2 model needs (config.json attn_logit_softcapping="
                    f"{arch.attn_logit_softcapping}); set build.attention=sdpa"
                )
            attention = spec.submodules.self_attention.submodules
            attention.core_attention = ModuleSpec(module=SDPAttention, params={"softcap": arch.attn_logit_softcapping})
        return [spec] * len(layers)

    def build_chunk(self, arch, config, block_spec, **gpt_kwargs):
        model = super().build_chunk(arch, config, block_spec, **gpt_kwargs)
        cap = arch.final_logit_softcapping
        output_layer = getattr(model, "output_layer", None)  # the last pipeline stage's
        if cap is not None and output_layer is not None:
            output_layer.final_logit_softcapping = cap  # read by models.output.HiddenStateOutput
            output_layer.register_forward_hook(
                lambda _m, _a, out: (torch.tanh(out[0] / cap) * cap, *out[1:])  # (logits, bias)
            )
        return model

    def weight_rules(self, arch) -> list[WeightRule]:
        qk_norms = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
        return [r for r in super().weight_rules(arch) if not r.megatron.endswith(qk_norms)]


FAMILY = Gemma2Family(
    name="gemma2",
    local_spec_only=True,
    model_types=("gemma2",),
    read_config=read_config,
    check_config=check_config,
    # Sliding and global layers alternate (window 5 < the tests' 16 tokens); caps small enough to bite on random
    # weights (the published 50 and 30 would be linear here): attention scores reach ~0.5, the logits ~1.
    tiny_config=dict(
        sliding_window=5,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=1.0,
        hidden_size=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),  # fmt: skip
    test_shapes={"gemma2_softcap": dict(tied=True, kv_heads=2, vocab_size=1001, rope="none")},
    memory_configs={
        "gemma-2-2b-it": dict(
            model_type="gemma2",
            hidden_size=2304,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            intermediate_size=9216,
            vocab_size=256000,
            max_position_embeddings=8192,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    },  # fmt: skip
)
