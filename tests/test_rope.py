"""RoPE scaling as transformers defines it: our frequencies and attention factor vs transformers' rotary modules,
at positions past the original context; longrope past its short factors and dynamic are refused."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.models import UnsupportedArchitectureError, architecture_from_hf_config
from megatron_opd.models import rope as rope_lib
from megatron_opd.models.rope import rope_from_hf

ORIGINAL = 32
LENGTH = 3 * ORIGINAL  # past the original context: where the scaling types differ
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.25 * i for i in range(24)],
                long_factor=[4.0 + i for i in range(24)], original_max_position_embeddings=ORIGINAL)  # fmt: skip

CASES = {
    # model_type, config fields, positions
    "yarn": ("qwen3", dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL))),
    "yarn_mscale": ("qwen3", dict(rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0,
                                                    beta_fast=16, original_max_position_embeddings=ORIGINAL))),
    "yarn_attention_factor_untruncated": ("qwen3", dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, attention_factor=1.3, truncate=False, original_max_position_embeddings=ORIGINAL))),
    "yarn_partial": ("qwen3", dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75))),
    "partial_default": ("phi3", dict(partial_rotary_factor=0.5, rope_scaling=None)),
    "longrope_partial": ("phi3", dict(partial_rotary_factor=0.75, rope_scaling=LONGROPE)),
    "llama3": ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL))),
    "linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
}  # fmt: skip


def _hf_config(model_type: str, fields: dict):
    from transformers import AutoConfig

    common = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=100,
                  num_hidden_layers=1, intermediate_size=64, max_position_embeddings=4 * ORIGINAL)  # fmt: skip
    if model_type == "phi3":
        common.pop("head_dim")  # Phi-3 derives it: hidden / heads = 64
        common["original_max_position_embeddings"] = ORIGINAL  # Phi-3 keeps it at the top level
    return AutoConfig.for_model(model_type, **common, **fields)


def _hf_cos_sin(config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    import importlib

    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    name = {"qwen3": "Qwen3", "phi3": "Phi3", "llama": "Llama"}[config.model_type]
    rotary = getattr(module, f"{name}RotaryEmbedding")(config)
    x = torch.zeros(1, length, 1)
    return rotary(x, torch.arange(length)[None])


def _our_cos_sin(config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    rope = rope_from_hf(config.to_dict())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = rope_lib.rotary_embedding_class()(rope, head_dim, use_cpu_initialization=True)
    freqs = rotary.get_freqs_non_repeated(length)
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_lib.attention_factor(rope)
    return emb.cos() * factor, emb.sin() * factor


@pytest.mark.parametrize("case", list(CASES))
def test_rotary_embedding_matches_transformers(case):
    model_type, fields = CASES[case]
    config = _hf_config(model_type, fields)
    # longrope's short factors hold up to the original context (longer is refused below)
    length = ORIGINAL if case.startswith("longrope") else LENGTH
    ref_cos, ref_sin = _hf_cos_sin(config, length)
    cos, sin = _our_cos_sin(config, length)
    assert cos.shape == ref_cos[0].shape, (cos.shape, ref_cos.shape)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=2e-6)
    assert not torch.allclose(cos[-1], torch.cos(torch.arange(cos.shape[1]) * 0.0)), "vacuous: no rotation"


def test_megatron_applies_the_attention_factor():
    """The factor reaches Megatron's attention through its YaRN concentration-factor hook."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    rope_lib.set_attention_factor(config, 1.2345678)
    assert abs(_yarn_get_concentration_factor_from_config(config) - 1.2345678) < 1e-12


def test_longrope_past_its_short_factors_is_refused():
    rope = rope_from_hf(_hf_config("phi3", dict(partial_rotary_factor=0.75, rope_scaling=LONGROPE)).to_dict())
    assert rope.type == "longrope" and rope.factor == 4.0 and rope.attention_factor is None
    rope_lib.check_sequence_length(rope, ORIGINAL, "train.max_seq_len")
    with pytest.raises(ValueError, match=rf"train.max_seq_len={ORIGINAL + 1} exceeds .*original_max_position_emb"):
        rope_lib.check_sequence_length(rope, ORIGINAL + 1, "train.max_seq_len")
    rotary = rope_lib.rotary_embedding_class()(rope, 64, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rotary(ORIGINAL + 1)


def test_dynamic_rope_is_refused():
    cfg = _hf_config("llama", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0))).to_dict()
    with pytest.raises(UnsupportedArchitectureError, match="'dynamic'.*rescales with the sequence length"):
        architecture_from_hf_config(cfg)


def test_trainer_refuses_longrope_past_its_short_factors(shape_dirs):
    """``train.max_seq_len`` (default: the student's context, 256) past original_max_position_embeddings (64)."""
    from types import SimpleNamespace

    from megatron_opd.trainer.setup import max_seq_len

    def cfg(length):
        return SimpleNamespace(student=SimpleNamespace(path=shape_dirs["phi3_fused_partial"]),
                               train=SimpleNamespace(max_seq_len=length))  # fmt: skip

    with pytest.raises(ValueError, match=r"train.max_seq_len=256 exceeds .*original_max_position_embeddings=64"):
        max_seq_len(cfg(None))
    assert max_seq_len(cfg(64)) == 64
