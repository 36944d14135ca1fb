"""What a model family declares, and the dense decoder every family today shares.

A :class:`ModelFamily` is the one place that knows a family: the Hugging Face ``model_type`` names it reads, its
own ``config.json`` fields (with a clear error for a field it cannot honour), the Megatron-Core config class and
fields, a layer spec per layer, the hook that builds a model chunk, the weight rules between Hugging Face and
Megatron names, and the tiny test shapes and memory-model inputs. The loader, converter, weight sync, sampler,
teacher, memory estimate and test fixtures read these declarations and never branch on a family's name
(``tests/test_families.py`` checks that). The default methods build the dense Llama-style decoder (RMSNorm,
SwiGLU MLP, rotary attention with grouped queries); a family whose layers differ (Mixture-of-Experts, MLA)
overrides them. ``docs/models.md`` has the guide to adding a family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.weight_rule import Split, WeightRule


@dataclass(frozen=True)
class SpecOptions:
    """Builder choices that pick layer implementations but are not part of the checkpoint."""

    te: bool
    """TransformerEngine layers (fused norms, TE linears) instead of the local spec."""
    attention: str = "sdpa"
    """Core attention of the local spec: ``sdpa`` or ``local`` (``ModelBuildConfig.attention``)."""
    norm: str = "torch"
    """RMSNorm of the local spec: ``torch`` or ``triton`` (``ModelBuildConfig.norm``)."""
    moe_grouped_gemm: bool = False
    """MoE layers run their experts as one grouped GEMM (``ModelBuildConfig.moe_grouped_gemm``), not one by one."""
    gated_delta_net_kernel: str = "auto"
    """Gated DeltaNet layers' delta rule: ``auto``, ``torch`` or ``fla`` (``ModelBuildConfig.gated_delta_net_kernel``)."""


def mlp_submodules(layer_spec):
    """The submodules of a layer spec's MLP (dense or MoE), to swap one of them: a ``ModuleSpec`` in Megatron-Core
    0.16, a ``functools.partial`` carrying them as its ``submodules`` keyword in 0.19."""
    mlp = layer_spec.submodules.mlp
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def use_grouped_experts(layer_spec) -> None:
    """Swap ``SequentialMLP`` for :class:`~megatron_opd.models.grouped_experts.GroupedExperts` in an MoE layer spec of Megatron-Core's local layers
    (a ``ModuleSpec`` tree in 0.16, ``functools.partial`` s in 0.19)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_opd.models.grouped_experts import GroupedExperts

    moe_submodules = mlp_submodules(layer_spec)
    experts = moe_submodules.experts
    if isinstance(experts, functools.partial):
        assert experts.func is SequentialMLP, f"expected SequentialMLP experts, got {experts.func}"
        moe_submodules.experts = functools.partial(GroupedExperts, *experts.args, **experts.keywords)
    else:
        assert experts.module is SequentialMLP, f"expected SequentialMLP experts, got {experts.module}"
        experts.module = GroupedExperts


def llama3_inv_freq(arch: ModelArchitecture) -> torch.Tensor:
    """Inverse RoPE frequencies with Llama 3.1's piecewise scaling, for any factor/low/high/original length."""
    from megatron_opd.models import rope

    return rope.inv_freq(arch.rope, arch.head_dim)


def check_dense_mlp(cfg: dict[str, Any]) -> None:
    """Refuse ``config.json`` fields the dense SwiGLU decoder cannot honour (every family today)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(
            f"config.json hidden_act={cfg['hidden_act']!r}: only silu (SwiGLU) is supported"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedArchitectureError("config.json mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedArchitectureError("config.json use_sliding_window=true is not supported")


def read_sliding_window(cfg: dict[str, Any], source: str) -> int | None:
    """``config.json`` ``sliding_window`` (keys per query, itself included) or None; honoured, never ignored."""
    from megatron_opd.model_files import ConfigFileError

    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigFileError(f"{source} field 'sliding_window' must be a positive integer or null, got {window!r}")
    return window


@dataclass(frozen=True)
class ModelFamily:
    """One model family's declarations (an instance per family module, registered in ``families/__init__.py``)."""

    name: str
    """The family's name (``ModelArchitecture.family``, shape labels, docs)."""
    model_types: tuple[str, ...]
    """Hugging Face ``config.json`` ``model_type`` values this family reads; the first is the one it writes."""
    read_config: Callable[[dict[str, Any], str], dict[str, Any]]
    """``(config.json dict, source) -> `` this family's own ``ModelArchitecture`` fields (``qkv_bias``,
    ``qk_norm``); raises ``UnsupportedArchitectureError`` naming a field the family cannot honour."""
    check_config: Callable[[dict[str, Any]], None] = check_dense_mlp
    """Refuses ``config.json`` fields the family's layers cannot honour, before any field is parsed."""
    tiny_config: Mapping[str, Any] = field(default_factory=dict)
    """transformers config fields of the tiny test model over ``testing.tiny_models``' common ones."""
    test_shapes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Shape name -> ``testing.shapes.Shape`` fields (``tied``, ``kv_heads``, ``vocab_size``, ``rope``): this
    family's cells of the shape matrix."""
    memory_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Model folder name -> ``config.json`` fields (``model_type`` included) for the memory estimate of a model
    that is not on this machine (``trainer.memory.KNOWN_CONFIGS``)."""
    local_spec_only: bool = False
    """Its layers are always Megatron's local spec, TransformerEngine or not (layers TE has no fused form of): the
    core attention is then ``build.attention``'s even with ``build.use_transformer_engine=true``, which
    ``setup.check_inputs`` reads to refuse packed sequences on Megatron's local attention before any model."""
    wrapper_types: tuple[str, ...] = ()
    """Hugging Face ``model_type`` s of multimodal wrappers whose text tower (``text_config``,
    ``model.language_model.*``) is this family's model; their other weights are skipped (``models.wrappers``)."""

    vllm_refusal: str | None = None
    """Why vLLM computes another model than transformers for every checkpoint of this family (measured, with the
    version): :meth:`check_vllm_config` then refuses it for vLLM rollouts and vLLM teachers; None: no such reason."""

    # --- vLLM ------------------------------------------------------------------------------------------------
    def check_vllm_config(self, cfg: Mapping[str, Any], source: str) -> None:
        """Refuse a ``config.json`` that vLLM would read as another model than the one megatron-opd builds from it
        (vLLM and transformers default some fields differently, or vLLM computes the family wrongly:
        :attr:`vllm_refusal`); most families have none."""
        if self.vllm_refusal:
            raise ValueError(
                f"{source}: vLLM would compute another model than this {self.name} checkpoint ({self.vllm_refusal}); "
                "use the built-in sampler (rollout.backend=builtin) and an in-process or server teacher"
            )

    def vllm_config_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """``config.json`` fields vLLM reads that ``cfg`` lacks (transformers' config class does not write them;
        published checkpoints carry them), derived from ``cfg``'s own: the HF export and the vLLM engine add them."""
        return {}

    def vllm_cpu_attention_backend(self, dtype: str) -> str | None:
        """The attention kernel vLLM must use on CPU where its own choice fails for this family; None: vLLM's."""
        return None

    # --- layouts ----------------------------------------------------------------------------------------------
    def check_layout(self, arch: ModelArchitecture, parallel) -> None:
        """Refuse a parallel layout (``distributed.ParallelConfig``) this family's layers cannot run, naming the
        field, before any model is built (``builder.validate_layout``); most families have none."""

    def check_build(self, arch: ModelArchitecture, build) -> None:
        """Refuse builder choices (``builder.ModelBuildConfig``) this family's layers cannot honour, naming the
        field, before the model is built; most families have none."""

    # --- Megatron-Core config -------------------------------------------------------------------------------
    def transformer_config_class(self):
        """The Megatron-Core config class (MLA families need ``MLATransformerConfig``)."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        """The config fields that describe the architecture (parallel layout and precision are the builder's)."""
        return dict(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_key_value_heads,
            kv_channels=arch.head_dim,
            ffn_hidden_size=arch.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=arch.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_norm,
            # Hugging Face's window counts the query itself; Megatron's (left, right) counts the keys around it.
            window_size=(arch.sliding_window - 1, 0) if arch.sliding_window else None,
            window_attn_skip_freq=[int(x) for x in arch.sliding_layers] if arch.sliding_layers else None,
            softmax_scale=arch.softmax_scale,
        )

    # --- layer specs and chunks -------------------------------------------------------------------------------
    def layer_specs(self, arch: ModelArchitecture, layers: Sequence[int], options: SpecOptions) -> list:
        """One Megatron-Core ``ModuleSpec`` per layer in ``layers`` (global indices of one chunk): TransformerEngine
        layers with ``options.te``, else the local spec with megatron-opd's :class:`RMSNorm` (it supports
        sequence parallelism where Megatron's torch fallback does not) and, with ``attention="sdpa"``,
        :class:`~megatron_opd.models.attention.SDPAttention` as core attention. Dense and MoE layers may mix."""
        return [self.decoder_layer_spec(arch, options)] * len(layers)

    def decoder_layer_spec(self, arch: ModelArchitecture, options: SpecOptions, num_experts: int | None = None):
        """The spec of one decoder layer: a dense MLP, or with ``num_experts`` Megatron's ``MoELayer`` (router,
        experts, shared expert) with sequential experts, or grouped ones with ``options.moe_grouped_gemm``."""
        from megatron.core.models.gpt import gpt_layer_specs

        moe = dict(num_experts=num_experts) if num_experts else {}
        if options.te:
            grouped = dict(moe_grouped_gemm=options.moe_grouped_gemm) if num_experts else {}
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=arch.qk_norm, **moe, **grouped
            )
        norm = self.local_norm(options)
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm", **moe)
        if num_experts and options.moe_grouped_gemm:
            use_grouped_experts(spec)
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        if arch.qk_norm:
            spec.submodules.self_attention.submodules.q_layernorm = norm
            spec.submodules.self_attention.submodules.k_layernorm = norm
        if options.attention == "sdpa":
            from megatron_opd.models.attention import SDPAttention

            spec.submodules.self_attention.submodules.core_attention = SDPAttention
        return spec

    def local_norm(self, options: SpecOptions):
        """The norm class of the local spec (layer, QK and final norms)."""
        from megatron_opd.models.norms import RMSNorm, TritonRMSNorm

        return TritonRMSNorm if options.norm == "triton" else RMSNorm

    def final_norm(self, options: SpecOptions):
        """The decoder's final norm: Megatron's own choice under TransformerEngine, else :meth:`local_norm`."""
        if options.te:
            from megatron.core.transformer.transformer_block import LayerNormImpl

            return LayerNormImpl
        return self.local_norm(options)

    def build_chunk(self, arch: ModelArchitecture, config, block_spec, **gpt_kwargs):
        """One model chunk from its decoder ``block_spec``; ``gpt_kwargs`` are the builder's ``GPTModel`` arguments
        (``vp_stage``, ``pre_process``, ``post_process``, ``vocab_size``). The hook for what differs per family
        around the decoder: rotary embeddings (Llama 3's scaled frequencies), MTP or MLA models."""
        from megatron.core.models.gpt import GPTModel

        from megatron_opd.models import rope

        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            max_sequence_length=arch.max_position_embeddings,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            **gpt_kwargs,
        )
        if not getattr(config, "multi_latent_attention", False):  # MLA rotates inside its attention (its own YaRN)
            rope.install(model, arch.rope, arch.head_dim)  # transformers' frequencies for every rope_type
        return model

    # --- weights ----------------------------------------------------------------------------------------------
    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        """Every weight of ``arch``: embedding, per-layer rules (``{layer}`` for the global layer index), final
        norm, output layer; see :mod:`megatron_opd.models.name_mapping`."""
        attn = "model.layers.{layer}.self_attn"
        mlp = "model.layers.{layer}.mlp"
        ml = "decoder.layers.{layer}"
        rules = [
            WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
            WeightRule(
                f"{ml}.input_layernorm.weight",
                ("model.layers.{layer}.input_layernorm.weight",),
                Split.REPLICATED,
                te_megatron=f"{ml}.self_attention.linear_qkv.layer_norm_weight",
            ),
            WeightRule(
                f"{ml}.self_attention.linear_qkv.weight",
                (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
                Split.QKV,
            ),
        ]
        if arch.qkv_bias:
            rules.append(
                WeightRule(
                    f"{ml}.self_attention.linear_qkv.bias",
                    (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"),
                    Split.QKV,
                )
            )
        if arch.qk_norm:
            rules += [
                WeightRule(f"{ml}.self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), Split.REPLICATED),
                WeightRule(f"{ml}.self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), Split.REPLICATED),
            ]
        rules += [
            WeightRule(f"{ml}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), Split.ROW),
            WeightRule(
                f"{ml}.pre_mlp_layernorm.weight",
                ("model.layers.{layer}.post_attention_layernorm.weight",),
                Split.REPLICATED,
                te_megatron=f"{ml}.mlp.linear_fc1.layer_norm_weight",
            ),
            WeightRule(
                f"{ml}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), Split.GATE_UP
            ),
            WeightRule(f"{ml}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), Split.ROW),
            WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
        ]
        if not arch.tie_word_embeddings:
            rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB))
        return rules
