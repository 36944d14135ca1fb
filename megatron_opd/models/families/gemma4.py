"""Gemma 4 (text; ``gemma4_text`` and ``gemma4_unified_text``, the same layers without per-layer inputs; the text
towers of the ``gemma4`` and ``gemma4_unified`` wrappers, ``models.wrappers``): Gemma 3's sandwich-normed layers
with plain-weight RMSNorms, plus

- head width and key/value heads per layer type (``global_head_dim``, ``num_global_key_value_heads`` or
  ``per_layer_config``): each layer is built with its own config copy (``models.gemma4_layers.Gemma4Layer``);
- sliding layers with plain RoPE, full layers with *proportional* RoPE (``models.rope``: frequencies over the
  whole head, zero past ``partial_rotary_factor``), stacked for the layers to pick (``per_layer_rope_attention``);
- attention scale 1.0 (QK-norm instead), a value norm without scale;
- the last ``num_kv_shared_layers`` layers reuse the keys/values of the last earlier layer of their type (no
  k/v projections; ``use_double_wide_mlp``: twice as wide an MLP);
- per-layer input embeddings (``hidden_size_per_layer_input``) added after each layer's MLP, and a saved scalar
  per layer on the residual stream;
- final-logit soft-capping (Gemma 2's hook).

The MoE variant (``enable_moe_block``: routed experts beside the dense MLP; ``attention_k_eq_v``) runs through
Megatron's ``MoELayer``. Refused by name: bidirectional attention over text, and pipeline or context parallelism
where per-layer inputs or shared keys/values would have to cross ranks
(:meth:`Gemma4Family.check_layout`). The local spec runs everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import Gemma4Architecture, ModelArchitecture
from megatron_opd.models.families.base import SpecOptions, read_sliding_window
from megatron_opd.models.families.gemma2 import Gemma2Family, _cap
from megatron_opd.models.weight_rule import Split, WeightRule

LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"config.json hidden_activation={act!r}: gemma4 supports gelu_pytorch_tanh")
    refused = {"attention_bias": "attention biases are not supported for gemma4 models"}
    for name, why in refused.items():
        if cfg.get(name):
            raise UnsupportedArchitectureError(f"config.json {name}={cfg[name]!r}: {why}")
    # "vision" (gemma4_unified_text's default) lets image tokens see each other; text alone stays causal.
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):
        raise UnsupportedArchitectureError(
            f"config.json use_bidirectional_attention={cfg['use_bidirectional_attention']!r}: only causal text "
            "attention is supported (null or 'vision')"
        )


def _int(cfg: dict[str, Any], name: str, default: int, source: str) -> int:
    value = cfg.get(name)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnsupportedArchitectureError(f"{source} field {name!r} must be a non-negative integer, got {value!r}")
    return value


def _per_type(cfg: dict[str, Any], layer_types: list[str], source: str) -> tuple[int, int, int]:
    """``(sliding head dim, global head dim, global key/value heads)``: from ``per_layer_config`` (what transformers
    5.19 writes) or ``global_head_dim`` / ``num_global_key_value_heads`` (published checkpoints)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        return head_dim, int(cfg.get("global_head_dim") or 512), int(global_kv or kv_heads)
    sizes = {t: set() for t in LAYER_TYPES}
    for i, layer_type in enumerate(layer_types):
        fields = per_layer.get(str(i)) or per_layer.get(i) or {}
        unknown = set(fields) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedArchitectureError(f"{source} per_layer_config[{i}] sets {sorted(unknown)}: not supported")
        sizes[layer_type].add((fields.get("head_dim", head_dim), fields.get("num_key_value_heads", kv_heads)))
    if len(sizes["sliding_attention"]) > 1 or len(sizes["full_attention"]) > 1:
        raise UnsupportedArchitectureError(
            f"{source} per_layer_config gives layers of one type different head sizes: {sizes}; each type must have one"
        )
    if sizes["sliding_attention"] and sizes["sliding_attention"] != {(head_dim, kv_heads)}:
        raise UnsupportedArchitectureError(f"{source} per_layer_config overrides sliding layers: not supported")
    global_dim, global_kv = next(iter(sizes["full_attention"]), (head_dim, kv_heads))
    return head_dim, int(global_dim), int(global_kv)


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    from megatron_opd.models import rope as rope_lib

    layers = int(cfg.get("num_hidden_layers") or 0)
    layer_types = list(cfg.get("layer_types") or [])
    if not layer_types:  # transformers' default: five sliding layers, then a full one; the last is full
        layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
        layer_types[-1:] = ["full_attention"] * bool(layers)
    if set(layer_types) - set(LAYER_TYPES) or len(layer_types) != layers:
        raise UnsupportedArchitectureError(
            f"{source} layer_types must list sliding_attention/full_attention for each of {layers} layers"
        )
    _, global_dim, global_kv = _per_type(cfg, layer_types, source)
    params = cfg.get("rope_parameters") or {}
    sliding = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10000.0}
    full = params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                             "rope_theta": 1000000.0}  # fmt: skip
    rope, local = (rope_lib.rope_from_hf({"rope_parameters": p}) for p in (full, sliding))
    if rope_lib.attention_factor(rope) != 1.0 or rope_lib.attention_factor(local) != 1.0:
        raise UnsupportedArchitectureError(f"{source}: RoPE with an attention factor is not supported for gemma4")

    shared = _int(cfg, "num_kv_shared_layers", 0, source)
    if shared >= max(layers, 1):
        raise UnsupportedArchitectureError(f"{source} num_kv_shared_layers={shared} must be below {layers} layers")
    first_shared = layers - shared
    sources: list[int | None] = []
    for i, layer_type in enumerate(layer_types):
        if i < first_shared or not shared:
            sources.append(None)
            continue
        earlier = layer_types[:first_shared]
        if layer_type not in earlier:
            raise UnsupportedArchitectureError(
                f"{source}: KV-sharing layer {i} ({layer_type}) has no earlier {layer_type} layer to share with"
            )
        sources.append(first_shared - 1 - earlier[::-1].index(layer_type))
    ffn = int(cfg.get("intermediate_size") or 0)
    wide = bool(cfg.get("use_double_wide_mlp"))
    # transformers' default for gemma4_text (a field gemma4_unified_text does not have)
    default = 256 if cfg.get("model_type") == "gemma4_text" else 0
    per_layer_input = _int(cfg, "hidden_size_per_layer_input", default, source)
    if per_layer_input and cfg.get("vocab_size_per_layer_input", 262144) != cfg.get("vocab_size"):
        raise UnsupportedArchitectureError(
            f"{source} vocab_size_per_layer_input={cfg.get('vocab_size_per_layer_input')} differs from vocab_size="
            f"{cfg.get('vocab_size')}: per-layer input embeddings over another vocabulary are not supported"
        )
    moe = None
    if cfg.get("enable_moe_block"):  # routed experts beside the dense MLP in every layer
        from megatron_opd.models.families.moe import read_moe

        moe = read_moe(cfg, source, expert_ffn_key="moe_intermediate_size", shared=False, experts_key="num_experts",
                       top_k_key="top_k_experts", layers=tuple(range(layers)))  # fmt: skip
        moe = replace(moe, norm_topk_prob=True)  # Gemma's router: a softmax over the top-k logits, always
    window = read_sliding_window(cfg, source)
    return dict(
        rope=rope,
        moe=moe,
        qkv_bias=False,
        qk_norm=True,
        sliding_window=window,
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types) if window else None,
        softmax_scale=1.0,
        final_logit_softcapping=_cap(cfg, "final_logit_softcapping", source),
        gemma4=Gemma4Architecture(
            full_layers=tuple(i for i, t in enumerate(layer_types) if t == "full_attention"),
            global_head_dim=global_dim,
            global_kv_heads=global_kv,
            sliding_rope=local,
            kv_sources=tuple(sources),
            ffn_widths=tuple(ffn * (2 if wide and src is not None else 1) for src in sources),
            per_layer_input_size=per_layer_input,
            keys_are_values=bool(cfg.get("attention_k_eq_v")),
        ),
    )


@dataclass(frozen=True)
class Gemma4Family(Gemma2Family):
    @staticmethod
    def _crossing(arch: ModelArchitecture) -> list[str]:
        """What passes between layers outside the residual stream (per-layer inputs, shared keys/values)."""
        g, crossing = arch.gemma4, []
        if g.per_layer_input_size:
            crossing.append(f"per-layer input embeddings (hidden_size_per_layer_input={g.per_layer_input_size})")
        if any(s is not None for s in g.kv_sources):
            shared = sum(s is not None for s in g.kv_sources)
            crossing.append(f"layers reusing earlier layers' keys/values (num_kv_shared_layers={shared})")
        return crossing

    def check_layout(self, arch: ModelArchitecture, parallel) -> None:
        g = arch.gemma4
        tp = parallel.tensor_model_parallel_size
        if g.global_kv_heads % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide the full-attention layers' {g.global_kv_heads} "
                f"key/value heads (config.json num_global_key_value_heads) of this gemma4 model; choose a TP size "
                "that divides it"
            )
        crossing = self._crossing(arch)
        for name in ("pipeline_model_parallel_size", "context_parallel_size"):
            size = getattr(parallel, name)
            if size > 1 and crossing:
                raise ValueError(
                    f"parallel.{name}={size}: this gemma4 model has {' and '.join(crossing)}, which are not passed "
                    f"between {name.split('_')[0]}-parallel ranks; set parallel.{name}=1"
                )

    def check_build(self, arch: ModelArchitecture, build) -> None:
        crossing = self._crossing(arch)
        if build.recompute == "full" and crossing:
            raise ValueError(
                f"build.recompute_granularity=full: this gemma4 model has {' and '.join(crossing)}, tensors that "
                "cross layers outside Megatron's recomputed inputs (their gradients would be lost); set "
                "build.recompute_granularity=selective or null"
            )

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        # Layers differ in shape (head widths, query-only projections, MLP widths): checkpoints key them per layer,
        # not stacked.
        fields = {**super().transformer_config_fields(arch), "hetereogenous_dist_checkpoint": True}
        if arch.moe is not None:  # the MoE families' softmax router: top-k of the logits, softmax over those k
            from megatron_opd.models.families.moe import moe_config_fields

            fields.update(moe_config_fields(arch))
        return fields

    def local_norm(self, options: SpecOptions):
        from megatron_opd.models.families.base import ModelFamily

        return ModelFamily.local_norm(self, SpecOptions(te=False, attention=options.attention, norm=options.norm))

    def layer_specs(self, arch: ModelArchitecture, layers: Sequence[int], options: SpecOptions) -> list:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_opd.models import gemma4_layers
        from megatron_opd.models.families.olmo2 import sandwich_spec

        g = arch.gemma4
        norm = self.local_norm(options)
        state: dict = {}  # one per chunk: this forward's per-layer inputs and shared keys/values
        producers = {s for s in g.kv_sources if s is not None}
        specs = []
        for layer in layers:
            spec = sandwich_spec(self, options, pre_norms=True, qk_norm=(norm, norm), post_norm=norm)
            if arch.moe is not None:
                self._moe_block(spec, arch, options)
            full = layer in g.full_layers
            source = g.kv_sources[layer]
            attention = spec.submodules.self_attention
            spec.submodules.self_attention = ModuleSpec(
                module=gemma4_layers.Gemma4Attention,
                submodules=attention.submodules,
                params={
                    **(attention.params or {}),
                    "state": state,
                    "rope_index": 0 if full else 1,
                    "produces": gemma4_layers.kv_key(layer) if layer in producers else None,
                    "reads": gemma4_layers.kv_key(source) if source is not None else None,
                    "keys_are_values": full and g.keys_are_values,
                },
            )
            fields = dict(
                kv_channels=g.head_dim(layer, arch.head_dim),
                num_query_groups=g.kv_heads(layer, arch.num_key_value_heads),
                ffn_hidden_size=g.ffn_widths[layer],
            )
            specs.append(
                ModuleSpec(
                    module=gemma4_layers.Gemma4Layer,
                    submodules=spec.submodules,
                    params=dict(fields=fields, per_layer_input_size=g.per_layer_input_size, state=state),
                )
            )
        return specs

    @staticmethod
    def _moe_block(spec, arch: ModelArchitecture, options: SpecOptions) -> None:
        """Make ``spec``'s MLP Gemma 4's MoE block: its pre-MLP norm the identity, its MLP the dense MLP beside
        Megatron's routed experts (``gemma4_layers.Gemma4FeedForward``)."""
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_opd.models import gemma4_layers
        from megatron_opd.models.families.base import mlp_submodules, use_grouped_experts

        dense = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp
        routed = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=arch.moe.num_experts, normalization="RMSNorm")
        if options.moe_grouped_gemm:
            use_grouped_experts(routed)
        mlp_submodules(routed).router = gemma4_layers.Gemma4Router
        experts = routed.submodules.mlp  # Megatron's MoELayer: a ModuleSpec in 0.16, a functools.partial in 0.19
        if isinstance(experts, functools.partial):
            experts = functools.partial(gemma4_layers.Gemma4Experts, *experts.args, **experts.keywords)
        else:
            experts.module = gemma4_layers.Gemma4Experts
        spec.submodules.pre_mlp_layernorm = IdentityOp
        spec.submodules.mlp = ModuleSpec(
            module=gemma4_layers.Gemma4FeedForward, params={"dense": dense, "experts": experts}
        )

    def build_chunk(self, arch, config, block_spec, **gpt_kwargs):
        from megatron_opd.models import gemma4_layers, rope

        model = super().build_chunk(arch, config, block_spec, **gpt_kwargs)  # scaled embedding, capped logits
        g = arch.gemma4
        rope.install(model, arch.rope, g.global_head_dim, local=g.sliding_rope, local_head_dim=arch.head_dim)
        if g.per_layer_input_size and gpt_kwargs.get("pre_process"):
            state = block_spec.layer_specs[0].params["state"]
            inputs = gemma4_layers.PerLayerInputs(
                config, gpt_kwargs["vocab_size"], arch.num_layers, g.per_layer_input_size, state
            )
            inputs.install(model.embedding)  # after the embedding's scale hook: it sees the scaled embeddings
        return model

    @staticmethod
    def _moe_rules(arch: ModelArchitecture, on: dict) -> list[WeightRule]:
        """The MoE block's weights (``_moe_block``): dense MLP, router, experts stored stacked ``[experts, ...]``
        (one row per expert, ``gate_up_proj`` rows gate then up), and the block's four norms."""
        from megatron_opd.models.weight_rule import ExpertSplit, stacked_name

        h, f, e, moe = arch.hidden_size, arch.ffn_hidden_size, arch.moe.num_experts, arch.moe
        hl, mm = "model.layers.{layer}", "decoder.layers.{layer}.mlp"
        expert = f"{mm}.experts.experts.local_experts.{{expert}}"
        per_expert = dict(experts=ExpertSplit.PER_EXPERT, **on)

        def norm(megatron: str, hf: str) -> WeightRule:
            return WeightRule(f"{mm}.{megatron}.weight", (f"{hl}.{hf}.weight",), Split.REPLICATED, **on)

        return [
            norm("pre_norm", "pre_feedforward_layernorm"),
            WeightRule(f"{mm}.dense.linear_fc1.weight", (f"{hl}.mlp.gate_proj.weight", f"{hl}.mlp.up_proj.weight"),
                       Split.GATE_UP, hf_shape=((f, h), (f, h)), **on),
            WeightRule(f"{mm}.dense.linear_fc2.weight", (f"{hl}.mlp.down_proj.weight",), Split.ROW,
                       hf_shape=((h, f),), **on),
            norm("post_norm_1", "post_feedforward_layernorm_1"),
            WeightRule(f"{mm}.experts.router.weight", (f"{hl}.router.proj.weight",), Split.REPLICATED,
                       hf_shape=((e, h),), **on),
            WeightRule(f"{mm}.experts.router.scale", (f"{hl}.router.scale",), Split.REPLICATED, hf_shape=((h,),),
                       **on),
            WeightRule(f"{mm}.experts.router.per_expert_scale", (f"{hl}.router.per_expert_scale",), Split.REPLICATED,
                       hf_shape=((e,),), **on),
            norm("experts.pre_norm", "pre_feedforward_layernorm_2"),
            WeightRule(f"{expert}.linear_fc1.weight", (stacked_name(f"{hl}.experts.gate_up_proj", "{expert}"),),
                       Split.GATE_UP, hf_shape=((2 * moe.expert_ffn_hidden_size, h),), **per_expert),
            WeightRule(f"{expert}.linear_fc2.weight", (stacked_name(f"{hl}.experts.down_proj", "{expert}"),),
                       Split.ROW, hf_shape=((h, moe.expert_ffn_hidden_size),), **per_expert),
            norm("post_norm_2", "post_feedforward_layernorm_2"),
            norm("post_norm", "post_feedforward_layernorm"),
        ]  # fmt: skip

    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        g = arch.gemma4
        h, nq, p, n = arch.hidden_size, arch.num_attention_heads, g.per_layer_input_size, arch.num_layers
        hl, ml = "model.layers.{layer}", "decoder.layers.{layer}"
        attn, mlp, sa = f"{hl}.self_attn", f"{hl}.mlp", f"{ml}.self_attention"
        rules = [WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB)]
        if p:
            rules += [
                WeightRule("embedding.per_layer_inputs.embed.weight", ("model.embed_tokens_per_layer.weight",),
                           Split.VOCAB, hf_shape=((arch.vocab_size, n * p),)),
                WeightRule("embedding.per_layer_inputs.projection.weight", ("model.per_layer_model_projection.weight",),
                           Split.REPLICATED, hf_shape=((n * p, h),)),
                WeightRule("embedding.per_layer_inputs.norm.weight", ("model.per_layer_projection_norm.weight",),
                           Split.REPLICATED, hf_shape=((p,),)),
            ]  # fmt: skip
        # Layers differ in head width, key/value heads, own or shared keys/values and MLP width: one group of rules
        # per combination, each naming its layers.
        kinds: dict[tuple, list[int]] = {}
        for layer in range(n):
            kind = (g.head_dim(layer, arch.head_dim), g.kv_heads(layer, arch.num_key_value_heads),
                    g.kv_sources[layer] is not None, g.ffn_widths[layer])  # fmt: skip
            kinds.setdefault(kind, []).append(layer)
        for (d, nkv, shares, f), group in kinds.items():
            on = dict(layers=tuple(group))
            keys_are_values = g.keys_are_values and d == g.global_head_dim and group[0] in g.full_layers
            if keys_are_values:
                qkv = WeightRule(
                    f"{sa}.linear_qkv.weight",
                    (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight"),
                    Split.GROUPED,  # each key/value group's queries, then its key (which is also its value)
                    group_rows=((nq // nkv * d,), (d,)),
                    hf_shape=((nq * d, h), (nkv * d, h)),
                    **on,
                )
            elif shares:
                qkv = WeightRule(f"{sa}.linear_qkv.weight", (f"{attn}.q_proj.weight",), Split.COLUMN,
                                 hf_shape=((nq * d, h),), **on)  # fmt: skip
            else:
                qkv = WeightRule(
                    f"{sa}.linear_qkv.weight",
                    (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
                    Split.GROUPED,  # Megatron's rows per key/value group: its queries, its key, its value
                    group_rows=((nq // nkv * d,), (d,), (d,)),
                    hf_shape=((nq * d, h), (nkv * d, h), (nkv * d, h)),
                    **on,
                )
            rules += [
                WeightRule(f"{ml}.input_layernorm.weight", (f"{hl}.input_layernorm.weight",), Split.REPLICATED, **on),
                qkv,
                WeightRule(f"{sa}.q_layernorm.weight", (f"{attn}.q_norm.weight",), Split.REPLICATED,
                           hf_shape=((d,),), **on),
                WeightRule(f"{sa}.linear_proj.weight", (f"{attn}.o_proj.weight",), Split.ROW, hf_shape=((h, nq * d),),
                           **on),
                WeightRule(f"{sa}.linear_proj.post_norm.weight", (f"{hl}.post_attention_layernorm.weight",),
                           Split.REPLICATED, **on),
                WeightRule(f"{ml}.pre_mlp_layernorm.weight", (f"{hl}.pre_feedforward_layernorm.weight",),
                           Split.REPLICATED, **on),
                WeightRule(f"{ml}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                           Split.GATE_UP, hf_shape=((f, h), (f, h)), **on),
                WeightRule(f"{ml}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), Split.ROW,
                           hf_shape=((h, f),), **on),
                WeightRule(f"{ml}.mlp.linear_fc2.post_norm.weight", (f"{hl}.post_feedforward_layernorm.weight",),
                           Split.REPLICATED, **on),
                WeightRule(f"{ml}.layer_scalar", (f"{hl}.layer_scalar",), Split.REPLICATED, buffer=True,
                           hf_shape=((1,),), **on),
            ]  # fmt: skip
            if arch.moe is not None:
                rules = [r for r in rules if not (r.layers == on["layers"] and (".mlp." in r.megatron
                         or r.megatron.endswith("pre_mlp_layernorm.weight")))]  # fmt: skip
                rules += self._moe_rules(arch, on)
            if not shares:
                rules.append(WeightRule(f"{sa}.k_layernorm.weight", (f"{attn}.k_norm.weight",), Split.REPLICATED,
                                        hf_shape=((d,),), **on))  # fmt: skip
            if p:
                rules += [
                    WeightRule(f"{ml}.per_layer_input_gate.weight", (f"{hl}.per_layer_input_gate.weight",),
                               Split.REPLICATED, hf_shape=((p, h),), **on),
                    WeightRule(f"{ml}.per_layer_projection.weight", (f"{hl}.per_layer_projection.weight",),
                               Split.REPLICATED, hf_shape=((h, p),), **on),
                    WeightRule(f"{ml}.post_per_layer_input_norm.weight", (f"{hl}.post_per_layer_input_norm.weight",),
                               Split.REPLICATED, **on),
                ]  # fmt: skip
        rules.append(WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED))
        if not arch.tie_word_embeddings:
            rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB))
        return rules


FAMILY = Gemma4Family(
    name="gemma4",
    local_spec_only=True,
    model_types=("gemma4_text", "gemma4_unified_text"),
    wrapper_types=("gemma4", "gemma4_unified"),
    read_config=read_config,
    check_config=check_config,
    # Five layers: sliding, full, sliding, then two sharing the last sliding and full layers' keys/values with
    # double-wide MLPs; full layers' heads twice as wide (64) as the sliding ones' (32); a window of 5 < the tests'
    # 16 tokens; per-layer inputs 16 wide; a final-logit cap that bites on random weights.
    tiny_config=dict(
        num_hidden_layers=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        global_head_dim=64,
        sliding_window=5,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=1000,  # the common tiny vocabulary; a shape with another sets both
        final_logit_softcapping=1.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),  # fmt: skip
    test_shapes={
        "gemma4_shared_kv": dict(
            tied=True,
            kv_heads=2,
            vocab_size=1001,
            rope="proportional",
            overrides=(("vocab_size_per_layer_input", 1001),),
        ),
        # The 26B-A4B's shape: experts beside the dense MLP in every layer, keys = values on the full layers, no
        # per-layer inputs or shared keys/values.
        "gemma4_moe": dict(
            tied=False,
            kv_heads=2,
            vocab_size=1001,
            rope="proportional",
            mlp="moe+dense-beside+keys-as-values",
            overrides=(
                ("enable_moe_block", True),
                ("num_experts", 4),
                ("top_k_experts", 2),
                ("moe_intermediate_size", 32),
                ("attention_k_eq_v", True),
                ("num_global_key_value_heads", 2),
                ("num_kv_shared_layers", 0),
                ("hidden_size_per_layer_input", 0),
                ("use_double_wide_mlp", False),
            ),
        ),
    },  # fmt: skip
)
