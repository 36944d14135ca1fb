"""OLMo 3 (AI2): OLMo-2's layers (norms after attention and MLP, QK-norm over all heads) with sliding-window
attention on three layers of four (``layer_types``), each layer type with its own RoPE (``rope_parameters``: the
full-attention layers' scaling, e.g. YaRN, the sliding ones' plain RoPE).

The window is Megatron's ``window_size`` on the layers ``window_attn_skip_freq`` picks, the two RoPEs come from the
two-base rotary module (``models.rope``) through :func:`~megatron_opd.models.attention.per_layer_rope_attention`,
as in Gemma 3. The local spec runs everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import SpecOptions, read_sliding_window
from megatron_opd.models.families.olmo2 import Olmo2Family


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    from megatron_opd.models import rope as rope_lib

    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError(f"{source} attention_bias=true is not supported for olmo3 models")
    layers = cfg.get("num_hidden_layers") or 0
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' default: every 4th layer is global
        layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    if set(layer_types) - {"sliding_attention", "full_attention"} or len(layer_types) != layers:
        raise UnsupportedArchitectureError(
            f"{source} layer_types must list sliding_attention/full_attention for each of {layers} layers"
        )
    window = read_sliding_window(cfg, source)
    params = cfg.get("rope_parameters") or {}
    local = None
    if isinstance(params.get("sliding_attention"), dict):
        local = rope_lib.rope_from_hf({"rope_parameters": params["sliding_attention"]})
        if local == rope_lib.rope_from_hf(cfg):
            local = None  # one RoPE for both layer types
        elif rope_lib.attention_factor(local) != 1.0:
            raise UnsupportedArchitectureError(f"{source}: the sliding layers' RoPE must not scale cos/sin")
    sliding = tuple(t == "sliding_attention" for t in layer_types) if window else None
    if local is not None and "sliding_attention" not in layer_types:
        local = None  # no sliding layer to take it
    if local is not None and sliding is None:
        # The per-layer RoPE follows Megatron's window layers; without a window there are none to pick it.
        raise UnsupportedArchitectureError(
            f"{source}: sliding_window=null with rope_parameters that differ per layer type is not supported"
        )
    return dict(qkv_bias=False, qk_norm=True, sliding_window=window, sliding_layers=sliding, local_rope=local)


@dataclass(frozen=True)
class Olmo3Family(Olmo2Family):
    def layer_specs(self, arch, layers: Sequence[int], options: SpecOptions) -> list:
        specs = super().layer_specs(arch, layers, options)
        if arch.local_rope is not None:
            from megatron.core.transformer.attention import SelfAttention

            from megatron_opd.models.attention import per_layer_rope_attention

            specs[0].submodules.self_attention.module = per_layer_rope_attention(SelfAttention)
        return specs

    def build_chunk(self, arch, config, block_spec, **gpt_kwargs):
        from megatron_opd.models import rope

        model = super().build_chunk(arch, config, block_spec, **gpt_kwargs)
        if arch.local_rope is not None:
            rope.install(model, arch.rope, arch.head_dim, local=arch.local_rope)
        return model


FAMILY = Olmo3Family(
    name="olmo3",
    local_spec_only=True,
    model_types=("olmo3",),
    read_config=read_config,
    # A window of 5 keys on layers 0-2 (shorter than the tests' sequences), layer 3 global; the shape's linear
    # scaling goes to the global layer's RoPE only (rope_parameters per layer type); hidden 128 = 4 heads x 32 (vLLM
    # derives the head dim from it). Token ids inside the vocabulary.
    tiny_config=dict(sliding_window=5, rope_theta=500000.0, hidden_size=128, pad_token_id=1, eos_token_id=2),
    test_shapes={"olmo3_window_two_ropes": dict(tied=False, kv_heads=2, vocab_size=1001, rope="linear")},
    memory_configs={
        "Olmo-3-7B": dict(
            model_type="olmo3",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            vocab_size=100278,
            max_position_embeddings=65536,
            sliding_window=4096,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
    },  # fmt: skip
)
