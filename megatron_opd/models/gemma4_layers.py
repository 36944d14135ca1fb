"""Gemma 4's decoder parts that Megatron-Core has no form of, as subclasses its layer specs build
(``families.gemma4`` declares where each goes).

- :class:`Gemma4Layer`: Megatron's ``TransformerLayer`` with its own config copy (per-layer head width, key/value
  heads and MLP width: Gemma 4's full-attention layers have wider heads, its KV-sharing layers a double-wide MLP),
  then the per-layer input (``gelu(x W_gate) * per_layer_input``, projected back, normed, added) and the layer's
  saved scalar on the whole residual stream.
- :class:`Gemma4Attention`: Megatron's ``SelfAttention`` with a value norm without scale; a layer that produces
  keys/values another layer reuses puts them in the chunk's shared state, and a KV-sharing layer has a query-only
  projection and takes them from there. Both hold pre-RoPE keys, as Megatron's KV cache does: the sharing layer
  caches and rotates the same keys as the producing layer (same type, same RoPE), so training, scoring and the
  built-in sampler's decode are exact; the sharing layers keep their own copy of the cache (no memory saving).
- :class:`PerLayerInputs`: the per-layer input embeddings (a vocabulary-parallel table ``[V, layers * P]`` scaled
  by ``sqrt(P)``, plus a projection of the scaled token embedding, RMS-normed per layer; their sum over ``sqrt 2``),
  computed by a hook on the model's embedding into the chunk's shared state.

The shared state is one dict per model chunk, created with the chunk's layer specs; it holds tensors of the
current forward only. Shape legend: ``s`` tokens (this rank's under sequence parallelism), ``b`` batch, ``L``
layers, ``P`` per-layer input width, ``H`` hidden.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_opd.models.norms import RMSNorm

PER_LAYER_INPUTS = "per_layer_inputs"
"""The shared state's key of the per-layer inputs ``[s, b, L, P]``."""


def kv_key(layer: int) -> str:
    """The shared state's key of the keys/values layer ``layer`` (global index) produces for later layers."""
    return f"kv{layer}"


def config_for_layer(config, **fields):
    """A shallow copy of Megatron's ``TransformerConfig`` with ``fields`` set (no ``__post_init__`` re-run)."""
    out = copy.copy(config)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def scaleless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's value norm: RMSNorm over the last dimension without a weight, in float32."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _replicated(module: torch.nn.Module, config) -> torch.nn.Module:
    """Tag a module replicated over tensor-parallel ranks so its gradients are all-reduced under sequence
    parallelism (each rank then sees only its tokens), as Megatron does for its norms."""
    if config.sequence_parallel:
        for param in module.parameters():
            param.sequence_parallel = True
    return module


def _linear(config, in_features: int, out_features: int) -> torch.nn.Linear:
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=config.params_dtype)
    if config.perform_initialization:
        config.init_method(linear.weight)
    return _replicated(linear, config)


class _Rows:
    """The linear_qkv factory of a layer without all of q, k, v: Megatron asks for q, k and v rows; it builds
    ``rows`` (a KV-sharing layer's queries; a keys = values layer's queries and keys)."""

    def __init__(self, linear, rows: int) -> None:
        self.linear, self.rows = linear, rows

    def __call__(self, in_size: int, _out_size: int, **kwargs):
        return self.linear(in_size, self.rows, **kwargs)


class Gemma4Attention(SelfAttention):
    """Megatron's ``SelfAttention`` with Gemma 4's value norm, its per-layer RoPE (``rope_index`` into the stacked
    global/local embeddings, sliced to this layer's head width) and shared keys/values: ``produces`` (the state key
    this layer's keys/values go to, or None), ``reads`` (the state key a KV-sharing layer takes them from);
    ``keys_are_values``: no value projection, the values are the key projection's output (before the key norm and
    RoPE), normed without scale (``attention_k_eq_v``: its ``linear_qkv`` holds each group's queries, then key)."""

    def __init__(
        self,
        config,
        submodules,
        layer_number: int,
        *args,
        state: dict,
        rope_index: int,
        produces: str | None = None,
        reads: str | None = None,
        keys_are_values: bool = False,
        **kwargs,
    ) -> None:
        query_size = config.kv_channels * config.num_attention_heads
        if reads is not None:
            submodules = dataclasses.replace(submodules, linear_qkv=_Rows(submodules.linear_qkv, query_size))
        elif keys_are_values:
            rows = query_size + config.kv_channels * config.num_query_groups
            submodules = dataclasses.replace(submodules, linear_qkv=_Rows(submodules.linear_qkv, rows))
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if reads is not None:  # its keys arrive normed; built and dropped (Megatron-Core 0.19 refuses a spec without)
            self.k_layernorm = None
        self.state, self.rope_index, self.produces, self.reads = state, rope_index, produces, reads
        self.keys_are_values = keys_are_values

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if isinstance(rotary_pos_emb, torch.Tensor) and rotary_pos_emb.dim() == 5:
            rotary_pos_emb = rotary_pos_emb[self.rope_index][..., : self.hidden_size_per_attention_head]
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if self.reads is not None:
            mixed, _ = self.linear_qkv(hidden_states)  # [s, b, heads * d] on this rank
            query = mixed.view(*mixed.shape[:2], -1, self.hidden_size_per_attention_head)
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            key, value = self.state[self.reads]
            return query, key, value
        if self.keys_are_values:
            query, key, value = self._keys_as_values(hidden_states)
        else:
            query, key, value = super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=True
            )
        value = scaleless_rms_norm(value, self.config.layernorm_epsilon)
        if self.produces is not None:
            self.state[self.produces] = (key, value)
        return query, key, value

    def _keys_as_values(self, hidden_states):
        """``(query, key, value)`` with value = the key projection's output (before the key norm)."""
        d, groups = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        mixed, _ = self.linear_qkv(hidden_states)
        mixed = mixed.view(*mixed.shape[:2], groups, (per_group + 1) * d)
        query, key = torch.split(mixed, [per_group * d, d], dim=3)
        query = query.reshape(*query.shape[:2], -1, d)
        value = key
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


class Gemma4Layer(TransformerLayer):
    """Megatron's ``TransformerLayer`` built with this layer's own config ``fields`` (``kv_channels``,
    ``num_query_groups``, ``ffn_hidden_size``), then Gemma 4's per-layer input (``per_layer_input_size`` P > 0)
    and its saved scalar (``layer_scalar``, a buffer as in transformers)."""

    def __init__(
        self, config, submodules, *args, fields: dict, per_layer_input_size: int, state: dict, **kwargs
    ) -> None:
        config = config_for_layer(config, **fields)
        super().__init__(config, submodules, *args, **kwargs)
        self.state, self.per_layer_input_size = state, per_layer_input_size
        hidden = config.hidden_size
        if per_layer_input_size:
            self.per_layer_input_gate = _linear(config, hidden, per_layer_input_size)
            self.per_layer_projection = _linear(config, per_layer_input_size, hidden)
            norm = RMSNorm(config, hidden, eps=config.layernorm_epsilon)
            self.post_per_layer_input_norm = norm
        self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

    def forward(self, *args, **kwargs):
        output, context = super().forward(*args, **kwargs)
        if self.per_layer_input_size:
            inputs_sbP = self.state[PER_LAYER_INPUTS][:, :, self.layer_number - 1]
            gated = gelu_tanh(self.per_layer_input_gate(output)) * inputs_sbP
            output = output + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return output * self.layer_scalar, context


class PerLayerInputs(MegatronModule):
    """Gemma 4's per-layer input embeddings of a chunk's ``num_layers`` layers (all of them: no pipeline split)."""

    def __init__(self, config, padded_vocab_size: int, num_layers: int, size: int, state: dict) -> None:
        from megatron.core.tensor_parallel import VocabParallelEmbedding

        super().__init__(config=config)
        self.num_layers, self.size, self.state = num_layers, size, state
        self.embed = VocabParallelEmbedding(
            padded_vocab_size, num_layers * size, init_method=config.init_method, config=config
        )
        self.projection = _linear(config, config.hidden_size, num_layers * size)
        self.norm = RMSNorm(config, size, eps=config.layernorm_epsilon)

    def forward(self, input_ids_bs: torch.Tensor, embeddings_sbH: torch.Tensor) -> torch.Tensor:
        """``[s, b, L, P]`` from the token ids and the (scaled) token embeddings of this rank's tokens."""
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        tokens = self.embed(input_ids_bs)  # [b, s, L * P], all-reduced over tensor-parallel ranks
        tokens = tokens * torch.tensor(math.sqrt(self.size), dtype=tokens.dtype)  # rounded to the dtype, as HF
        tokens = tokens.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            tokens = scatter_to_sequence_parallel_region(tokens)
        projected = self.projection(embeddings_sbH) * self.config.hidden_size**-0.5
        projected = self.norm(projected.reshape(*projected.shape[:2], self.num_layers, self.size))
        return (projected + tokens.reshape(*tokens.shape[:2], self.num_layers, self.size)) * 2.0**-0.5

    def install(self, embedding) -> None:
        """Compute the per-layer inputs after every forward of ``embedding`` (Megatron's ``LanguageModelEmbedding``,
        called with ``input_ids=``), into the shared state."""

        def hook(_module, args, kwargs, output):
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.state[PER_LAYER_INPUTS] = self(input_ids, output)

        embedding.per_layer_inputs = self
        embedding.register_forward_hook(hook, with_kwargs=True)


class Gemma4Router(TopKRouter):
    """Megatron's top-k softmax router on Gemma 4's router input: the residual stream RMS-normed without weight,
    times ``scale`` and ``1 / sqrt(hidden)``; the chosen experts' (renormalised) probabilities times
    ``per_expert_scale``."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
        if config.sequence_parallel:  # each rank routes its own tokens
            self.scale.sequence_parallel = self.per_expert_scale.sequence_parallel = True

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        scaled = scaleless_rms_norm(input, self.config.layernorm_epsilon) * self.scale
        return super().gating(scaled * self.config.hidden_size**-0.5)

    def forward(self, input: torch.Tensor, padding_mask=None):
        probs, routing_map = super().forward(input, padding_mask)
        return probs * self.per_expert_scale.to(probs.dtype), routing_map


class Gemma4Experts(MoELayer):
    """Megatron's ``MoELayer`` fed the residual stream: the router reads it (``Gemma4Router``), the experts its
    own RMSNorm of it (``pre_norm``, HF ``pre_feedforward_layernorm_2``; per token, so before the dispatch)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.pre_norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def preprocess(self, hidden_states, probs, routing_map):
        return super().preprocess(self.pre_norm(hidden_states), probs, routing_map)


class Gemma4FeedForward(MegatronModule):
    """Gemma 4's MoE block as the layer's MLP (its pre-MLP norm is the identity): the dense MLP on
    ``pre_norm(x)``, normed (``post_norm_1``), plus the routed experts on ``x`` (:class:`Gemma4Experts`), normed
    (``post_norm_2``); the sum normed again (``post_norm``: HF ``post_feedforward_layernorm``)."""

    def __init__(self, config, dense, experts, pg_collection=None, **_) -> None:
        from megatron.core.transformer.spec_utils import build_module

        super().__init__(config=config)
        norm = functools.partial(RMSNorm, config, config.hidden_size, eps=config.layernorm_epsilon)
        self.pre_norm, self.post_norm_1, self.post_norm_2, self.post_norm = norm(), norm(), norm(), norm()
        if isinstance(dense, functools.partial):  # Megatron-Core 0.19's specs: builders called as the layer calls them
            self.dense = dense(config=config, pg_collection=pg_collection, is_mtp_layer=False)
            self.experts = experts(config=config, pg_collection=pg_collection)
        else:  # 0.16's ModuleSpecs
            tp = dict(tp_group=pg_collection.tp) if pg_collection is not None else {}
            self.dense = build_module(dense, config=config, **tp)
            self.experts = build_module(experts, config=config, pg_collection=pg_collection)

    def set_layer_number(self, layer_number: int) -> None:
        self.experts.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        dense, _ = self.dense(self.pre_norm(hidden_states))
        routed, _ = self.experts(hidden_states)
        return self.post_norm(self.post_norm_1(dense) + self.post_norm_2(routed)), None
