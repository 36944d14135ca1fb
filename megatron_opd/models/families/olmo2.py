"""OLMo-2: norms after attention and after the MLP instead of before, and QK-norm over all heads together.

Megatron-Core has neither: the layer spec drops the input norms (``IdentityOp``), wraps both output projections
with a post-norm (:func:`~megatron_opd.models.norms.post_normed`) and norms queries and keys with
:class:`~megatron_opd.models.norms.AllHeadsRMSNorm` (reduced across tensor-parallel ranks). The local spec runs
everywhere (TransformerEngine's fused input norms do not apply).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily, SpecOptions, mlp_submodules
from megatron_opd.models.weight_rule import Split, WeightRule


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("config.json attention_bias=true is not supported for olmo2 models")
    return dict(qkv_bias=False, qk_norm=True)


def sandwich_spec(family: ModelFamily, options: SpecOptions, pre_norms: bool, qk_norm, post_norm=None):
    """A local layer spec with post-norms (``post_norm``, default RMSNorm) on both output projections;
    ``pre_norms`` keeps the input norms (Gemma 3) or drops them (OLMo-2); ``qk_norm``: the (query, key) norm
    module specs, or None."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_opd.models.norms import post_normed

    norm = family.local_norm(options)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm is not None, normalization="RMSNorm")
    spec.submodules.input_layernorm = norm if pre_norms else IdentityOp
    spec.submodules.pre_mlp_layernorm = norm if pre_norms else IdentityOp
    attention = spec.submodules.self_attention.submodules
    post = (post_norm,) if post_norm is not None else ()
    attention.linear_proj = post_normed(RowParallelLinear, *post)
    mlp_submodules(spec).linear_fc2 = post_normed(RowParallelLinear, *post)
    if qk_norm is not None:
        attention.q_layernorm, attention.k_layernorm = qk_norm
    if options.attention == "sdpa":
        from megatron_opd.models.attention import SDPAttention

        attention.core_attention = SDPAttention
    return spec


@dataclass(frozen=True)
class Olmo2Family(ModelFamily):
    def layer_specs(self, arch, layers: Sequence[int], options: SpecOptions) -> list:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_opd.models.norms import AllHeadsRMSNorm

        qk = tuple(ModuleSpec(module=AllHeadsRMSNorm, params={"heads": h}) for h in ("query", "key"))
        return [sandwich_spec(self, options, pre_norms=False, qk_norm=qk)] * len(layers)

    def final_norm(self, options: SpecOptions):
        return self.local_norm(options)

    def weight_rules(self, arch) -> list[WeightRule]:
        attn, mlp, ml = "model.layers.{layer}.self_attn", "model.layers.{layer}.mlp", "decoder.layers.{layer}"
        sa = f"{ml}.self_attention"
        rules = [
            WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
            WeightRule(
                f"{sa}.linear_qkv.weight",
                (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
                Split.QKV,
            ),
            # All heads' norm weights: each TP rank holds its own heads' slice.
            WeightRule(f"{sa}.q_layernorm.weight", (f"{attn}.q_norm.weight",), Split.COLUMN),
            WeightRule(f"{sa}.k_layernorm.weight", (f"{attn}.k_norm.weight",), Split.COLUMN),
            WeightRule(f"{sa}.linear_proj.weight", (f"{attn}.o_proj.weight",), Split.ROW),
            WeightRule(
                f"{sa}.linear_proj.post_norm.weight",
                ("model.layers.{layer}.post_attention_layernorm.weight",),
                Split.REPLICATED,
            ),
            WeightRule(
                f"{ml}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), Split.GATE_UP
            ),
            WeightRule(f"{ml}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), Split.ROW),
            WeightRule(
                f"{ml}.mlp.linear_fc2.post_norm.weight",
                ("model.layers.{layer}.post_feedforward_layernorm.weight",),
                Split.REPLICATED,
            ),
            WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
        ]
        if not arch.tie_word_embeddings:
            rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB))
        return rules


FAMILY = Olmo2Family(
    name="olmo2",
    local_spec_only=True,
    model_types=("olmo2",),
    read_config=read_config,
    # OLMo-2 derives the head dim from hidden / heads in vLLM: 128 / 4 = the common 32.
    tiny_config=dict(hidden_size=128, rope_theta=500000.0),
    test_shapes={"olmo2_post_norms": dict(tied=True, kv_heads=2, vocab_size=1001, rope="none")},
    memory_configs={
        "OLMo-2-1124-7B": dict(
            model_type="olmo2",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            vocab_size=100352,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
    },  # fmt: skip
)
