"""A Hugging Face ``config.json`` read into a :class:`~megatron_opd.models.architecture.ModelArchitecture`.

Parsed from the plain JSON dict (not ``transformers`` classes) so the checkpoint converter and
the teacher server read configs the same way, and so both the transformers 4.x keys
(``rope_theta``/``rope_scaling``) and the 5.x key (``rope_parameters``) are understood.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_opd.model_files import ConfigFileError, UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families import BY_MODEL_TYPE, DEFERRED, FAMILIES
from megatron_opd.models.rope import rope_from_hf

SUPPORTED_MODEL_TYPES = {model_type: family.name for model_type, family in BY_MODEL_TYPE.items()}
"""model_type -> family name, from the registry in :mod:`megatron_opd.models.families`."""


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
    from megatron_opd.models.wrappers import text_config

    cfg = text_config(cfg)  # a multimodal wrapper (Qwen3.5) is read as its text tower
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
