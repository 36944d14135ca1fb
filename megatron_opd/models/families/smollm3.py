"""SmolLM3 (Hugging Face): the Llama decoder with no rotary embedding on some layers (NoPE: ``no_rope_layers``,
every 4th layer in the published models).

Megatron-Core applies one RoPE to every layer; the NoPE layers' spec takes
:func:`~megatron_opd.models.attention.no_rope_attention`, which drops it. TransformerEngine's layers are used where
asked (the attention class is the only change).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily, SpecOptions


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        # attention_bias also puts a bias on o_proj, which Megatron's GPTModel cannot hold alone.
        raise UnsupportedArchitectureError(f"{source} attention_bias=true is not supported for smollm3 models")
    layers = cfg.get("num_hidden_layers") or 0
    flags = cfg.get("no_rope_layers")
    if flags is None:  # transformers' default: every no_rope_layer_interval-th layer has no RoPE
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise UnsupportedArchitectureError(
            f"{source} no_rope_layers must list 1 (RoPE) or 0 (NoPE) for each of {layers} layers, got {flags!r}"
        )
    nope = tuple(not f for f in flags)
    return dict(qkv_bias=False, qk_norm=False, no_rope_layers=nope if any(nope) else None)


@dataclass(frozen=True)
class SmolLM3Family(ModelFamily):
    def layer_specs(self, arch, layers: Sequence[int], options: SpecOptions) -> list:
        specs = super().layer_specs(arch, layers, options)
        if arch.no_rope_layers is None:
            return specs
        from megatron_opd.models.attention import no_rope_attention

        nope = copy.deepcopy(specs[0])
        nope.submodules.self_attention.module = no_rope_attention(nope.submodules.self_attention.module)
        return [nope if arch.no_rope_layers[layer] else spec for spec, layer in zip(specs, layers)]


FAMILY = SmolLM3Family(
    name="smollm3",
    model_types=("smollm3",),
    read_config=read_config,
    # 4 layers: layer 3 is NoPE (the default interval of 4); token ids inside the tiny vocabulary.
    tiny_config=dict(rope_theta=2000000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    test_shapes={"smollm3_nope": dict(tied=True, kv_heads=2, vocab_size=1001, rope="none")},
    memory_configs={
        "SmolLM3-3B": dict(
            model_type="smollm3",
            hidden_size=2048,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=11008,
            vocab_size=128256,
            max_position_embeddings=65536,
            rope_theta=5000000.0,
            tie_word_embeddings=True,
        ),
    },  # fmt: skip
)
