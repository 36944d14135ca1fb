"""Granite (IBM Granite 3.x dense): the Llama decoder with four scalar multipliers: the embedding output times
``embedding_multiplier``, each attention and MLP output times ``residual_multiplier`` before the residual add, the
attention softmax scale ``attention_multiplier`` (not ``1 / sqrt(head_dim)``), and the logits divided by
``logits_scaling``.

The residual multiplier scales the output projections' outputs (:func:`scaled_output`), the embedding one is a
forward hook on the embedding, and the logits' divisor divides the final norm's output (a hook), so the fused
output-layer loss and the teachers' hidden states, which multiply that output by the output weight themselves, get
the scaled logits too. TransformerEngine's layers are used where asked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_opd.model_files import ConfigFileError, UnsupportedArchitectureError
from megatron_opd.models.families.base import ModelFamily, SpecOptions, mlp_submodules


def _positive(cfg: dict[str, Any], name: str, source: str) -> float:
    value = cfg.get(name, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigFileError(f"{source} field {name!r} must be a positive number, got {value!r}; fix the file")
    return float(value)


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        # attention_bias also puts a bias on o_proj, which Megatron's GPTModel cannot hold alone.
        raise UnsupportedArchitectureError(f"{source} attention_bias=true is not supported for granite models")
    return dict(
        qkv_bias=False,
        qk_norm=False,
        embedding_multiplier=_positive(cfg, "embedding_multiplier", source),
        residual_multiplier=_positive(cfg, "residual_multiplier", source),
        softmax_scale=_positive(cfg, "attention_multiplier", source),
        logits_scaling=_positive(cfg, "logits_scaling", source),
    )


@functools.cache
def scaled_output(module: type, scale: float) -> type:
    """``module`` (a row-parallel output projection returning ``(out, bias)``) with its output times ``scale``:
    Granite's residual multiplier on attention and MLP outputs."""

    class Scaled(module):
        def forward(self, *args: Any, **kwargs: Any):
            out, bias = super().forward(*args, **kwargs)
            return out * scale, None if bias is None else bias * scale

    Scaled.__name__ = Scaled.__qualname__ = f"Scaled{module.__name__}"
    return Scaled


@dataclass(frozen=True)
class GraniteFamily(ModelFamily):
    def layer_specs(self, arch, layers: Sequence[int], options: SpecOptions) -> list:
        spec = self.decoder_layer_spec(arch, options)
        if arch.residual_multiplier != 1.0:
            attention, mlp = spec.submodules.self_attention.submodules, mlp_submodules(spec)
            attention.linear_proj = scaled_output(attention.linear_proj, arch.residual_multiplier)
            mlp.linear_fc2 = scaled_output(mlp.linear_fc2, arch.residual_multiplier)
        return [spec] * len(layers)

    def build_chunk(self, arch, config, block_spec, **gpt_kwargs):
        model = super().build_chunk(arch, config, block_spec, **gpt_kwargs)
        if gpt_kwargs.get("pre_process") and arch.embedding_multiplier != 1.0:
            m = arch.embedding_multiplier
            model.embedding.register_forward_hook(lambda _m, _a, out: out * m)
        final_norm = getattr(model.decoder, "final_layernorm", None)  # the last pipeline stage's
        if final_norm is not None and arch.logits_scaling != 1.0:
            s = arch.logits_scaling  # (h / s) @ W^T: the logits / s (bitwise for a power of two)
            final_norm.register_forward_hook(lambda _m, _a, out: out / s)
        return model


FAMILY = GraniteFamily(
    name="granite",
    model_types=("granite",),
    read_config=read_config,
    # Granite 3.0's multipliers (its 2B model's): each one wrong or missing moves the logits far past 1e-5.
    tiny_config=dict(
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),  # fmt: skip
    test_shapes={"granite_multipliers": dict(tied=True, kv_heads=4, vocab_size=1001, rope="none")},
    memory_configs={
        "granite-3.3-8b-instruct": dict(
            model_type="granite",
            hidden_size=4096,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=12800,
            vocab_size=49159,
            max_position_embeddings=131072,
            rope_theta=10000000.0,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=16.0,
            tie_word_embeddings=True,
        ),
    },  # fmt: skip
)
