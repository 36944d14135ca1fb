"""Rotary position embeddings as Hugging Face defines them, on Megatron-Core's ``RotaryEmbedding``.

Megatron-Core computes plain RoPE frequencies (and Llama 3.1's with fixed constants); checkpoints bring
``rope_type`` ``linear``, ``llama3``, ``yarn`` and ``longrope``, a ``partial_rotary_factor`` (only the first
fraction of each head is rotated) and an ``attention_factor`` that multiplies cos and sin. This module computes the
inverse frequencies and the attention factor with transformers' formulas (``modeling_rope_utils``), so the numbers
are the checkpoint's, and :class:`HFRotaryEmbedding` carries them into Megatron's attention. :func:`rope_from_hf`
reads the rotary fields of a ``config.json`` (also for the families with their own rotary embedding).

``longrope`` switches from its short to its long factors once a sequence passes
``original_max_position_embeddings``; transformers decides per sequence and vLLM per batch, so the trainer and
the sampler could disagree past it: only the short factors are supported, and a longer sequence is refused.
``dynamic`` rescales with the sequence length at run time and is refused.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import RopeConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
"""Hugging Face ``rope_type`` values megatron-opd builds (``dynamic`` is refused: it changes with the length)."""


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """Dimensions of each head that are rotated (transformers: ``int(head_dim * partial_rotary_factor)``); all of
    them for ``proportional`` (Gemma 4), whose frequencies past the factor's share are zero."""
    if rope.type == "proportional":
        return head_dim
    return int(head_dim * rope.partial_rotary_factor)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (``beta_fast/slow``)."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (fp32) of ``rope`` for heads of ``head_dim``, as transformers'."""
    dim = rotary_dim(rope, head_dim)
    if rope.type == "proportional":  # exponents over the whole head; the unrotated rest has frequency 0
        angles = int(rope.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / rope.factor
    if rope.type == "yarn":
        return _yarn(rope, dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.type == "longrope":
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta**exponents)
    plain = 1.0 / (rope.theta**exponents)
    return _llama3(plain, rope) if rope.type == "llama3" else plain


def attention_factor(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by (1 but for ``yarn`` and ``longrope``)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        return mscale(rope.factor)
    if rope.type == "longrope" and rope.factor > 1.0:
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def set_attention_factor(config, factor: float) -> None:
    """Make Megatron's attention multiply cos and sin (the rotary part of queries and keys) by ``factor``.

    Megatron applies YaRN's concentration factor ``mscale(s, m) / mscale(s, m_all)``, ``mscale(s, m) = 0.1 m ln s
    + 1``, whenever the config has ``yarn_rotary_scaling_factor``; with ``s = e`` and ``m_all = 0`` that is
    ``1 + 0.1 m``, so ``m = 10 (factor - 1)`` gives any factor (transformers' explicit ``attention_factor`` and
    longrope's have no YaRN parameters). A config that declares these fields itself (MLA) keeps its own."""
    if factor == 1.0 or "yarn_rotary_scaling_factor" in type(config).__dataclass_fields__:
        return
    config.yarn_rotary_scaling_factor = math.e
    config.yarn_mscale = 10.0 * (factor - 1.0)
    config.yarn_mscale_all_dim = 0.0


def check_sequence_length(rope: RopeConfig, length: int, field: str) -> None:
    """Refuse a ``longrope`` model at a length past its short factors (``field`` names the setting to lower)."""
    limit = rope.original_max_position_embeddings
    if rope.type == "longrope" and length > limit:
        raise ValueError(
            f"{field}={length} exceeds this longrope model's original_max_position_embeddings={limit}: past it "
            "transformers and vLLM pick the long factors per sequence and per batch, so the trainer and the sampler "
            f"would disagree; set {field} <= {limit}"
        )


@functools.cache
def rotary_embedding_class():
    """:class:`HFRotaryEmbedding`, defined on first use (importing Megatron-Core costs seconds)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class HFRotaryEmbedding(RotaryEmbedding):
        """Megatron's ``RotaryEmbedding`` with transformers' frequencies for ``rope``; refuses a ``longrope``
        sequence past its short factors."""

        def __init__(self, rope: RopeConfig, head_dim: int, use_cpu_initialization: bool, cp_group=None) -> None:
            super().__init__(
                kv_channels=head_dim,
                rotary_percent=rotary_dim(rope, head_dim) / head_dim,
                seq_len_interpolation_factor=rope.factor if rope.type == "linear" else None,
                rotary_base=rope.theta,
                use_cpu_initialization=use_cpu_initialization,
                cp_group=cp_group,
            )
            with torch.device(self.inv_freq.device):  # Megatron's device, not a surrounding default (meta)
                self.inv_freq = inv_freq(rope, head_dim)
            self.rope = rope

        def forward(self, max_seq_len: int, *args, **kwargs):
            check_sequence_length(self.rope, max_seq_len, "sequence length")
            return super().forward(max_seq_len, *args, **kwargs)

    class PerLayerRotaryEmbedding(HFRotaryEmbedding):
        """Two RoPEs, global (``rope``) and local (``local``, sliding-window layers), stacked ``[2, s, 1, 1, d]``
        for :func:`~megatron_opd.models.attention.per_layer_rope_attention` to pick from (Gemma 3). Where the local
        layers' heads are narrower (``local_head_dim``, Gemma 4), the narrower one is zero-padded to the wider; each
        layer takes its own head width's first dimensions."""

        def __init__(
            self, rope: RopeConfig, local: RopeConfig, head_dim: int, *args, local_head_dim: int | None = None, **kwargs
        ) -> None:
            super().__init__(rope, head_dim, *args, **kwargs)
            self.local = HFRotaryEmbedding(local, local_head_dim or head_dim, *args, **kwargs)

        def forward(self, max_seq_len: int, *args, **kwargs):
            both = [super().forward(max_seq_len, *args, **kwargs), self.local(max_seq_len, *args, **kwargs)]
            width = max(x.shape[-1] for x in both)
            return torch.stack([torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in both])

    HFRotaryEmbedding.PerLayer = PerLayerRotaryEmbedding
    return HFRotaryEmbedding


def install(
    model, rope: RopeConfig, head_dim: int, local: RopeConfig | None = None, local_head_dim: int | None = None
) -> None:
    """Replace a ``GPTModel``'s rotary module by :class:`HFRotaryEmbedding` for ``rope``; with ``local``, by the
    per-layer module that also carries the sliding-window layers' RoPE (``local_head_dim``: their head width, where
    it differs)."""
    cpu = model.config.use_cpu_initialization
    cp_group = getattr(model.rotary_pos_emb, "cp_group", None)
    if local is None:
        model.rotary_pos_emb = rotary_embedding_class()(rope, head_dim, cpu, cp_group=cp_group)
    else:
        model.rotary_pos_emb = rotary_embedding_class().PerLayer(
            rope, local, head_dim, cpu, cp_group=cp_group, local_head_dim=local_head_dim
        )


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """The rotary embedding of a Hugging Face ``config.json`` dict (``rope_scaling``, 5.x ``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):  # 5.x per layer type (Gemma 3): the global layers' RoPE
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling") or {}
    merged = {**params, **scaling}  # an explicit 4.x rope_scaling wins over 5.x defaults
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        hint = " (it rescales with the sequence length at run time)" if rope_type == "dynamic" else ""
        raise UnsupportedArchitectureError(
            f"rope scaling type {rope_type!r} (config.json rope_scaling/rope_parameters) is not supported{hint}; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    original = merged.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None:
        # llama3 has always defaulted to 8192 here; YaRN and LongRoPE without it scale from the model's context.
        original = 8192 if rope_type in ("default", "linear", "llama3") else cfg.get("max_position_embeddings")
    factor = merged.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and original:
        factor = cfg.get("max_position_embeddings", original) / original
    short_factor = merged.get("short_factor")
    if rope_type == "longrope" and not short_factor:
        raise UnsupportedArchitectureError("config.json rope_scaling.short_factor is missing for rope_type longrope")
    optional = {k: merged.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")}
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        partial_rotary_factor=float(merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0),
        attention_factor=None if optional["attention_factor"] is None else float(optional["attention_factor"]),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=None if optional["mscale"] is None else float(optional["mscale"]),
        mscale_all_dim=None if optional["mscale_all_dim"] is None else float(optional["mscale_all_dim"]),
        truncate=bool(merged.get("truncate", True)),
        short_factor=tuple(float(x) for x in short_factor) if short_factor else None,
    )
