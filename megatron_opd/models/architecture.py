"""The architecture facts megatron-opd needs about a model, as frozen dataclasses (read from a Hugging Face
``config.json`` by :mod:`megatron_opd.models.hf_config`; each family's layers and weights by
:mod:`megatron_opd.models.families`). Imports nothing of the package: every other part may read it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


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
    score_function: str = "softmax"
    """``softmax`` or ``sigmoid`` (MiniMax-M2): the router's scores, whose top-k (renormalised) weight the experts."""
    expert_bias: bool = False
    """The top-k is picked on the scores plus a per-expert correction bias (HF ``e_score_correction_bias``; MiniMax-M2
    on sigmoid scores, ERNIE 4.5 on softmax probabilities); the weights stay the unbiased scores."""
    config_keys: tuple[str, str, str] = ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
    """The checkpoint's own ``config.json`` keys for the expert count, the expert width and the shared expert's width
    (Mixtral's ``num_local_experts``, ERNIE's ``moe_num_experts``), so errors name what the user can find."""
    linear_biases: bool = False
    """A bias on the router and on every expert's projections (gpt-oss)."""


@dataclass(frozen=True)
class MLAArchitecture:
    """Multi-latent attention and its rotary embedding (``ModelArchitecture.mla``; None for other attention)."""

    q_lora_rank: int | None
    """Width of the query's low-rank bottleneck (``q_a_proj`` -> norm -> ``q_b_proj``); None: one ``q_proj``."""
    kv_lora_rank: int
    """Width of the key/value latent (``kv_a_proj_with_mqa`` -> norm -> ``kv_b_proj``)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head query/key width with rotary embedding (the rotary key is shared by all heads)."""
    v_head_dim: int
    """Per-head value width."""
    yarn_factor: float = 1.0
    """YaRN scaling factor (``rope_scaling.factor``); 1.0: plain RoPE."""
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    """YaRN's ``mscale`` (cos/sin scale ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``)."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN's ``mscale_all_dim`` (the softmax scale is multiplied by ``mscale(factor, mscale_all_dim)`` squared)."""


@dataclass(frozen=True)
class DeepSeekRouting:
    """DeepSeek's router on top of ``ModelArchitecture.moe`` (``ModelArchitecture.routing``)."""

    n_group: int = 1
    """Expert groups (group-limited routing); 1: none."""
    topk_group: int = 1
    """Groups each token may use, picked by the sum of each group's top-2 biased scores."""
    routed_scaling_factor: float = 1.0
    """The routed experts' combined output is scaled by this."""
    score_function: str = "sigmoid"
    """``sigmoid`` (DeepSeek-V3, GLM-4.5: a group ranked by its top-2 scores) or ``softmax`` over every expert
    (DeepSeek-V2: a group ranked by its best score)."""
    expert_bias: bool = True
    """``e_score_correction_bias`` is added to the scores to pick the top-k (not to weight them)."""


@dataclass(frozen=True)
class LinearAttentionArchitecture:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5; ``ModelArchitecture.linear_attention``): a linear-attention
    mixer with a recurrent state and a short causal convolution (``models.gated_delta_net``)."""

    num_key_heads: int
    """Query/key heads of the mixer (HF ``linear_num_key_heads``)."""
    num_value_heads: int
    """Value heads (HF ``linear_num_value_heads``); a multiple of the key heads, which each serve a group of them."""
    key_head_dim: int
    """HF ``linear_key_head_dim``."""
    value_head_dim: int
    """HF ``linear_value_head_dim``."""
    conv_kernel: int
    """Width of the causal depthwise convolution over queries, keys and values (HF ``linear_conv_kernel_dim``)."""
    layers: tuple[int, ...]
    """Global indices of the Gated DeltaNet layers (HF ``layer_types`` = ``linear_attention``); the others are gated
    full attention."""


@dataclass(frozen=True)
class Gemma4Architecture:
    """Gemma 4's per-layer mechanisms (``ModelArchitecture.gemma4``; ``families.gemma4``)."""

    full_layers: tuple[int, ...]
    """Global indices of the full-attention layers (HF ``layer_types``); the others slide."""
    global_head_dim: int
    """Head width of the full-attention layers (HF ``global_head_dim`` / ``per_layer_config``); the sliding layers
    have ``ModelArchitecture.head_dim``."""
    global_kv_heads: int
    """Key/value heads of the full-attention layers (HF ``num_global_key_value_heads``, else ``num_key_value_heads``)."""
    sliding_rope: RopeConfig
    """RoPE of the sliding layers (``ModelArchitecture.rope`` is the full layers', proportional)."""
    kv_sources: tuple[int | None, ...]
    """Per layer: the earlier layer whose keys and values it attends to (HF ``num_kv_shared_layers``: the last
    layers have no key/value projections of their own), or None: its own."""
    ffn_widths: tuple[int, ...]
    """Per layer: the dense MLP's width (``use_double_wide_mlp``: twice ``intermediate_size`` in the KV-sharing
    layers)."""
    per_layer_input_size: int = 0
    """Width of each layer's per-layer input embedding (HF ``hidden_size_per_layer_input``); 0: none."""
    keys_are_values: bool = False
    """The full-attention layers have no value projection: values are the key projection's output (HF
    ``attention_k_eq_v``)."""

    def kv_heads(self, layer: int, sliding_kv_heads: int) -> int:
        return self.global_kv_heads if layer in self.full_layers else sliding_kv_heads

    def head_dim(self, layer: int, sliding_head_dim: int) -> int:
        return self.global_head_dim if layer in self.full_layers else sliding_head_dim


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
    linear_attention: LinearAttentionArchitecture | None = None
    """Gated DeltaNet layers between the attention layers (Qwen3-Next, Qwen3.5); None: attention everywhere."""
    attention_output_gate: bool = False
    """Attention output scaled by ``sigmoid`` of a per-head gate from the query projection (Qwen3-Next, Qwen3.5)."""
    swiglu: tuple[float, float] | None = None
    """gpt-oss's experts: ``(swiglu_limit, swiglu_alpha)`` of ``(clamp(up, ±limit) + 1) · g · σ(alpha · g)`` with
    ``g = min(gate, limit)``; None: plain SwiGLU."""
    torch_dtype: str = "float32"
    """dtype the checkpoint was saved in (``config.json`` ``torch_dtype``/``dtype``)."""
    no_rope_layers: tuple[bool, ...] | None = None
    """Which layers attend without rotary embedding (SmolLM3's NoPE layers, HF ``no_rope_layers`` == 0); None: none."""
    embedding_multiplier: float = 1.0
    """The embedding output is multiplied by this (Granite's ``embedding_multiplier``)."""
    residual_multiplier: float = 1.0
    """Attention and MLP outputs are multiplied by this before the residual add (Granite's ``residual_multiplier``)."""
    logits_scaling: float = 1.0
    """The logits are divided by this (Granite's ``logits_scaling``)."""
    attn_logit_softcapping: float | None = None
    """Attention scores become ``c * tanh(scores / c)`` before the softmax (Gemma 2); None: not capped."""
    final_logit_softcapping: float | None = None
    """The logits become ``c * tanh(logits / c)`` (Gemma 2); None: not capped."""
    gemma4: Gemma4Architecture | None = None
    """Gemma 4's per-layer head sizes, shared keys/values and per-layer input embeddings; None: other families."""

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
        if self.linear_attention is not None:
            checks += (("linear_num_key_heads", self.linear_attention.num_key_heads),)
        for name, value in checks:
            if value % tp:
                raise ValueError(
                    f"tensor_model_parallel_size={tp} does not divide {name}={value} of this {self.family} model; "
                    f"choose a TP size that divides {value}"
                )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
