"""The architecture facts megatron-opd needs from a Hugging Face ``config.json``.

Parsed from the plain JSON dict (not ``transformers`` classes) so the checkpoint converter and
the teacher server read configs the same way, and so both the transformers 4.x keys
(``rope_theta``/``rope_scaling``) and the 5.x key (``rope_parameters``) are understood.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_opd.model_files import ConfigFileError, UnsupportedArchitectureError
from megatron_opd.models.families import BY_MODEL_TYPE, DEFERRED, FAMILIES, ModelFamily, family_named
from megatron_opd.models.families.deepseek_v3 import DeepSeekRouting, MLAArchitecture
from megatron_opd.models.rope import ROPE_TYPES

SUPPORTED_MODEL_TYPES = {model_type: family.name for model_type, family in BY_MODEL_TYPE.items()}
"""model_type -> family name, from the registry in :mod:`megatron_opd.models.families`."""


def check_vocab_padding(tensor_parallel_size: int, make_vocab_size_divisible_by: int) -> None:
    """Raise a ValueError naming the option unless both padding factors are positive integers (0 would divide
    by zero, a negative one would shrink the vocabulary)."""
    for name, value, usual in (
        ("make_vocab_size_divisible_by (--make-vocab-size-divisible-by)", make_vocab_size_divisible_by, "128"),
        ("tensor_parallel_size", tensor_parallel_size, "1 without tensor parallelism"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer (usually {usual}), got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters."""

    theta: float = 10000.0
    """Base of the rotary frequencies (HF ``rope_theta``)."""
    type: str = "default"
    """``default``, ``linear``, ``llama3``, ``yarn`` or ``longrope`` (HF ``rope_type``; ``models.rope``)."""
    factor: float = 1.0
    """Scaling factor for ``linear``, ``llama3`` and ``yarn``; ``longrope``: the context over the original one."""
    low_freq_factor: float = 1.0
    """``llama3`` only."""
    high_freq_factor: float = 4.0
    """``llama3`` only."""
    original_max_position_embeddings: int = 8192
    """``llama3``, ``yarn``, ``longrope``: context length the base model was trained at."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dimensions that is rotated (HF ``partial_rotary_factor``; Phi-3 and Phi-4)."""
    attention_factor: float | None = None
    """Factor on cos and sin (``yarn``, ``longrope``); None: transformers' default for the type."""
    beta_fast: float = 32.0
    """``yarn`` only: rotations where the ramp from extrapolation to interpolation starts."""
    beta_slow: float = 1.0
    """``yarn`` only: rotations where it ends."""
    mscale: float | None = None
    """``yarn`` only (DeepSeek style): numerator weight of the default attention factor."""
    mscale_all_dim: float | None = None
    """``yarn`` only: denominator weight of the default attention factor."""
    truncate: bool = True
    """``yarn`` only: round the ramp's bounds to whole dimensions (transformers' default)."""
    short_factor: tuple[float, ...] | None = None
    """``longrope`` only: per-frequency factors up to ``original_max_position_embeddings`` (the long factors
    beyond it are refused: ``models.rope``)."""


@dataclass(frozen=True)
class MoEArchitecture:
    """The Mixture-of-Experts part of an architecture (``ModelArchitecture.moe``; None for a dense model)."""

    num_experts: int
    """Routed experts per MoE layer (HF ``num_experts`` / ``num_local_experts``)."""
    top_k: int
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    expert_ffn_hidden_size: int
    """Width of each routed expert's SwiGLU gate and up projections (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """The top-k routing probabilities are renormalised to sum to 1 (softmax over the top-k logits); else they are
    the softmax over all experts' logits, taken at the top k."""
    layers: tuple[int, ...]
    """Global indices of the layers whose MLP is an MoE layer (the others are dense, ``ffn_hidden_size`` wide)."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert every token goes through (Qwen2-MoE); 0: none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(x @ gate)`` (Qwen2-MoE's ``shared_expert_gate``)."""


@dataclass(frozen=True)
class ModelArchitecture:
    """A decoder-only transformer of a registered model family (``megatron_opd.models.families``)."""

    family: str
    """The family's name (a key of ``megatron_opd.models.families.FAMILIES``)."""
    vocab_size: int
    """True (unpadded) vocabulary size."""
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Grouped-query attention: query heads share this many key/value heads."""
    head_dim: int
    ffn_hidden_size: int
    """Width of the SwiGLU gate and up projections."""
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on the query/key/value projections (Qwen2)."""
    qk_norm: bool
    """RMSNorm on each head's queries and keys (Qwen3)."""
    sliding_window: int | None = None
    """Keys each query attends to, itself included (HF ``sliding_window``; Mistral); None: all before it."""
    sliding_layers: tuple[bool, ...] | None = None
    """Which layers the window applies to (HF ``layer_types``; Gemma 3); None: every layer."""
    local_rope: RopeConfig | None = None
    """RoPE of the sliding-window layers where it differs from ``rope`` (Gemma 3's ``rope_local_base_freq``)."""
    softmax_scale: float | None = None
    """Attention softmax scale where it is not ``1 / sqrt(head_dim)`` (Gemma 3's ``query_pre_attn_scalar``)."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    moe: MoEArchitecture | None = None
    """Mixture-of-Experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral); None for a dense model."""
    mla: MLAArchitecture | None = None
    """Multi-latent attention (DeepSeek-V3) instead of grouped-query attention; None for the latter."""
    routing: DeepSeekRouting | None = None
    """DeepSeek's group-limited, scaled router on top of ``moe``; None for the MoE families' softmax router."""
    torch_dtype: str = "float32"
    """dtype the checkpoint was saved in (``config.json`` ``torch_dtype``/``dtype``)."""

    def padded_vocab_size(self, tensor_parallel_size: int, make_vocab_size_divisible_by: int = 128) -> int:
        """Vocabulary padded so every tensor-parallel rank holds an equal, aligned slice (Megatron's rule)."""
        check_vocab_padding(tensor_parallel_size, make_vocab_size_divisible_by)
        multiple = make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def validate_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise a ValueError naming the field when ``tensor_parallel_size`` cannot split this model."""
        tp = tensor_parallel_size
        checks = (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.ffn_hidden_size),
        )
        for name, value in checks:
            if value % tp:
                raise ValueError(
                    f"tensor_model_parallel_size={tp} does not divide {name}={value} of this {self.family} model; "
                    f"choose a TP size that divides {value}"
                )

    @property
    def model_family(self) -> ModelFamily:
        """The family's declarations: config fields, layer specs, weight rules."""
        return family_named(self.family)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def _positive_int(cfg: dict[str, Any], name: str, source: str, default: int | None = None) -> int:
    """``cfg[name]`` as a positive int, else a ``ConfigFileError`` naming the file and the field."""
    value = cfg.get(name)
    if not value and default is not None:  # a null or 0 optional field means "use the default"
        value = default
    if value is None:
        raise ConfigFileError(
            f"{source} has no {name!r}, which every {'/'.join(FAMILIES)} config sets; point at the model's own "
            "config.json (not a generation or adapter config) or add the field"
        )
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value != int(value) or value < 1:
        raise ConfigFileError(f"{source} field {name!r} must be a positive integer, got {value!r}; fix the file")
    return int(value)


def architecture_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArchitecture:
    """Read a Hugging Face ``config.json`` dict (``source`` names it in errors); raise
    ``UnsupportedArchitectureError`` for other families and ``ConfigFileError`` for missing or mistyped fields."""
    if not isinstance(cfg, dict):
        raise ConfigFileError(f"{source} must hold a JSON object, got {type(cfg).__name__}; fix or replace the file")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures")
        reason = f" ({DEFERRED[model_type]})" if model_type in DEFERRED else ""
        raise UnsupportedArchitectureError(
            f"{source} model_type={model_type!r} (architectures={archs}) is not supported{reason}; "
            f"supported model types: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    family = BY_MODEL_TYPE[model_type]
    family.check_config(cfg)
    heads = _positive_int(cfg, "num_attention_heads", source)
    hidden = _positive_int(cfg, "hidden_size", source)
    head_dim = _positive_int(cfg, "head_dim", source, default=hidden // heads or None)
    try:
        rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
    except (TypeError, ValueError):
        raise ConfigFileError(
            f"{source} field 'rms_norm_eps' must be a number, got {cfg['rms_norm_eps']!r}; fix the file"
        ) from None
    own_fields = family.read_config(cfg, source)
    rope = own_fields.pop("rope", None) or rope_from_hf(cfg)  # a family with its own rotary embedding reads it
    return ModelArchitecture(
        family=family.name,
        vocab_size=_positive_int(cfg, "vocab_size", source),
        hidden_size=hidden,
        num_layers=_positive_int(cfg, "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=_positive_int(cfg, "num_key_value_heads", source, default=heads),
        head_dim=head_dim,
        ffn_hidden_size=_positive_int(cfg, "intermediate_size", source),
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", source, default=4096),
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **own_fields,
        rope=rope,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
    )


def load_architecture(hf_dir: str | Path) -> ModelArchitecture:
    """Read ``hf_dir/config.json``; a ``ConfigFileError`` names the file when it is not valid JSON."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point --hf-dir/hf_dir at a Hugging Face model folder")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigFileError(
            f"{path} is not valid JSON ({err}); it is damaged or not a config.json: copy it again from the model"
        ) from None
    return architecture_from_hf_config(cfg, source=str(path))
