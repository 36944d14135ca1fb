"""Core attention for Megatron-Core's local layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

Without TransformerEngine, Megatron's ``DotProductAttention`` builds every ``[b, heads, s, s]`` score matrix and
keeps the probabilities for the backward: memory grows with the square of the sequence. :class:`SDPAttention` is
a drop-in ``core_attention`` module (the layer spec's submodule, same constructor and ``forward``) that hands the
work to SDPA, which picks a flash / cuDNN / memory-efficient kernel on a GPU and a flash kernel on CPU: nothing of
size ``s x s`` is kept, grouped K/V heads are not repeated (``enable_gqa``), and the numbers are Megatron's
(softmax scale, attention dropout under Megatron's RNG tracker, heads split over tensor-parallel ranks).

Three cases, from what Megatron's ``Attention`` passes:
- training, scoring and the sampler's prefill: causal over ``s`` queries and ``s`` keys (``is_causal``);
- the sampler's decode steps: one query against the cached keys; Megatron then passes ``no_mask`` (SDPA's
  ``is_causal`` is top-left aligned when the lengths differ, so it must not be used there);
- packed sequences (``PackedSeqParams``, ``qkv_format="thd"``): ``[t, heads, d]`` with ``cu_seqlens``; every
  sequence attends causally to itself only, through ``torch.nn.attention.varlen`` on a GPU where it exists, otherwise
  one SDPA call over the sequences padded to the longest (or one call per sequence, where lengths differ widely).

Sliding windows (``config.window_size = (w, 0)``, on the layers Megatron's ``window_attn_skip_freq`` picks): a
query attends to itself and the ``w`` keys before it (Hugging Face's ``sliding_window`` is ``w + 1``), through an
explicit boolean mask in each of the three cases (:func:`window_mask`, bottom-right aligned for decode), or
``varlen``'s own window on a GPU. SDPA's flash kernel takes no mask: a window runs SDPA's memory-efficient kernel
on a GPU, and a log line says so.

Soft-capped attention logits (Gemma 2's ``attn_logit_softcapping``: ``c * tanh(scores / c)`` before the mask and the
softmax; ``softcap``, passed through the layer spec's params): no SDPA kernel takes it, so every call of the three
cases (and of the context-parallel split, which goes through the same call) forms the ``[b, h, s, k]`` scores
explicitly, as transformers' eager attention does; memory then grows with the square of the sequence again, and a
log line says so.

Attention sinks (``config.softmax_type``: ``learnable``, gpt-oss's per-head ``sinks``; ``off-by-one``, a sink of 0):
every query's softmax also counts a logit ``offset[head]`` whose value is zero, ``softmax([q k / sqrt(d), offset])``
without its last column. SDPA has no such term, so :func:`with_sink` adds one key that every query sees: an extra
head dimension holds ``offset[head]`` in the queries and ``1 / scale`` in that key (0 in the others), whose value
is zero. Grouped K/V heads stay shared (the per-head part is in the query), the offset gets its gradient through
SDPA's own backward, and every case above (causal, masks, windows, decode against the KV cache, packed sequences,
context parallelism) takes the same extra key; ``varlen`` (no sink argument) is then not used, and on a GPU the
head dimension is padded to a multiple of 8 for the fused kernels.

Multi-latent attention (DeepSeek-V3: query/key heads of 192 = 128 + 64 rotary, value heads of 128) passes different
query/key and value head sizes. SDPA's flash kernels (CUDA's and CPU's alike, torch 2.13) take equal ones only, so
such a call would run the memory-efficient kernel on a GPU and the math kernel (``s x s`` scores) on CPU. Every call
of the cases above then pads the value heads with zeros (and the query/key heads, where needed) to one width, a
multiple of 8 (:func:`equal_head_widths`), and drops the padded output columns: the attention is unchanged (zero
query/key columns add nothing to the scores, zero value columns give zero outputs) and the flash kernels are
eligible. Sinks (:func:`with_sink`) already pad all three; soft-capped scores take any widths.

Shape legend: ``s`` queries, ``k`` keys, ``b`` batch, ``h`` query heads on this rank, ``g`` K/V heads on this
rank, ``d`` head dim, ``t`` packed tokens.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math

import torch
import torch.nn.functional as F

from megatron_opd.models.sliding_window import window_mask

# Without a varlen kernel, packed sequences go through SDPA as one padded batch when padding every sequence to the
# longest costs at most this many times their own attention; else one call per sequence. On CPU, 64 sequences of
# 10-20 tokens: 1.4 ms forward and backward against 7.6 ms for the per-sequence loop.
PADDED_COST_BOUND = 4

logger = logging.getLogger(__name__)
_logged_window_kernel = False
_logged_softcap = False


def _tp_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _varlen_causal_attn(window: int | None = None):
    """A causal ``varlen_attn(q, k, v, cu, max_len, scale)`` from ``torch.nn.attention.varlen`` (a GPU flash kernel
    for packed sequences), or None where this torch has none (or none with a ``window``: keys before the query).
    Its causal argument changed between releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1 if window is None else window, 0)}
    elif "is_causal" in params and window is None:
        causal = {"is_causal": True}
    else:
        return None
    gqa = {"enable_gqa": True} if "enable_gqa" in params else None

    def attend(q, k, v, cu, max_len, scale, grouped):
        if grouped and gqa is None:
            return None
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal, **(gqa if grouped else {}))

    return attend


def layer_window(config, layer_number: int) -> int | None:
    """Keys before each query that a layer attends to (None: all), from ``config.window_size`` and
    ``window_attn_skip_freq`` (Megatron's own rule for which layers slide)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    left, right = window
    if right != 0:
        raise ValueError(f"window_size={tuple(window)}: a causal decoder needs a right window of 0")
    return None if left < 0 else int(left)


def _context_parallel_split(config, pg_collection):
    """The CP group's split when the sequence is split over context-parallel ranks, else None."""
    if config.context_parallel_size == 1:
        return None
    from megatron_opd.models.context_parallel import ContextParallelSplit

    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        return ContextParallelSplit.current()
    return ContextParallelSplit(group, group.size(), group.rank())


FLASH_HEAD_MULTIPLE = 8
"""Head widths SDPA's fused GPU kernels take (a multiple of 8); the padded width of unequal heads."""
_logged_padded_heads = False


def equal_head_widths(q, k, v):
    """``(q, k, v)`` where the query/key and value head sizes differ: zero-padded in the last dimension to one width,
    the larger size rounded up to :data:`FLASH_HEAD_MULTIPLE`, for SDPA's flash kernels; the first ``v.shape[-1]``
    output columns are the attention of the unpadded heads. Equal head sizes stay as they are."""
    if q.shape[-1] == v.shape[-1]:
        return q, k, v
    width = -(-max(q.shape[-1], v.shape[-1]) // FLASH_HEAD_MULTIPLE) * FLASH_HEAD_MULTIPLE
    return tuple(x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))


def _log_padded_heads(q, k, v, mask, dropout_p: float, causal: bool, gqa: bool, value_width: int) -> None:
    """Once per process on a GPU: that unequal heads were padded, and whether torch's flash kernel takes the
    padded call (``torch.backends.cuda.can_use_flash_attention``; with ``debug`` torch warns why not)."""
    global _logged_padded_heads
    if _logged_padded_heads or not q.is_cuda:
        return
    _logged_padded_heads = True
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout_p, causal, gqa)
    eligible = torch.backends.cuda.can_use_flash_attention(params, debug=True)
    logger.info(
        "attention with query/key heads of %d and value heads of %d: padded to %d for SDPA's flash kernel (%s)",
        k.shape[-1], value_width, q.shape[-1], "eligible" if eligible else "not eligible: see torch's warning",
    )  # fmt: skip


def with_sink(q, k, v, mask, causal: bool, offset: torch.Tensor, scale: float):
    """``(q, k, v, mask, causal, skip)`` for one SDPA call whose softmax also counts ``offset`` ``[h]`` (a logit per
    query head with a zero value), then ``out[:, :, skip:, :d_v]`` is the attention with sinks.

    The sink is key 0: its last (extra) head dimension is ``1 / scale`` against ``offset[head]`` in every query, the
    real keys' extra dimension is 0. A mask gains a column that attends; a square causal call gains a leading
    query row (dropped: ``skip = 1``) so the causal diagonal still ends at the last key."""
    b, h, s, d = q.shape
    g, dv = k.shape[1], v.shape[-1]
    width = d + 1 if not q.is_cuda else -(-(d + 1) // 8) * 8  # the fused GPU kernels want multiples of 8
    width = max(width, dv)
    q = torch.cat([q, offset.to(q.dtype).view(1, h, 1, 1).expand(b, h, s, 1), q.new_zeros(b, h, s, width - d - 1)], -1)
    sink_key = k.new_zeros(b, g, 1, width)
    sink_key[..., d] = 1.0 / scale
    k = torch.cat([sink_key, F.pad(k, (0, width - d))], dim=2)
    v = torch.cat([v.new_zeros(b, g, 1, width), F.pad(v, (0, width - dv))], dim=2)
    skip = 0
    if mask is not None:
        mask = torch.cat([torch.ones_like(mask[..., :1]), mask], dim=-1)
    elif causal:
        q = torch.cat([q.new_zeros(b, h, 1, width), q], dim=2)
        skip = 1
    return q, k, v, mask, causal, skip


class SDPAttention(torch.nn.Module):
    """Megatron-Core ``core_attention`` on SDPA: causal, GQA, TP-sharded heads, dropout, packed sequences, sliding
    windows, and the sequence split over context-parallel ranks (``models.context_parallel``)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        softcap: float | None = None,
        **_,
    ) -> None:
        super().__init__()
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type={softmax_type!r} is not supported by build.attention=sdpa")
        self.config = config
        self.pg_collection = pg_collection
        tp = _tp_size(pg_collection)
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        # Multi-latent attention passes its query/key and value head sizes (they differ); others use kv_channels.
        self.head_dim = k_channels or config.kv_channels
        self.v_head_dim = v_channels or self.head_dim
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and multiplies it back in
        # the softmax: the product is this scale.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attn_mask_type = attn_mask_type
        self.window = layer_window(config, layer_number)
        self.context_parallel = _context_parallel_split(config, pg_collection)
        if softcap is not None and not softcap > 0:
            raise ValueError(f"attention logit softcap must be positive, got {softcap!r}")
        self.softcap = softcap
        # Attention sinks, per query head of this rank (Megatron's DotProductAttention names it the same way).
        self.softmax_offset = None
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(self.heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif softmax_type == "off-by-one":
            self.register_buffer("sink_zeros", torch.zeros(self.heads, dtype=config.params_dtype), persistent=False)
            self.softmax_offset = self.sink_zeros

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks split over tensor-parallel ranks with the heads (Megatron's own layout for them)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        learnable = isinstance(self.softmax_offset, torch.nn.Parameter)
        state = {"softmax_offset": self.softmax_offset} if learnable else {}
        groups = {}
        if metadata and metadata.get("dp_cp_group") is not None:  # else Megatron reads both from parallel_state
            from megatron.core import parallel_state

            tp = getattr(self.pg_collection, "tp", None) if self.pg_collection is not None else None
            groups = dict(tp_group=tp or parallel_state.get_tensor_model_parallel_group(),
                          dp_cp_group=metadata["dp_cp_group"])  # fmt: skip
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets, **groups)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``query [s, b, h, d]``, ``key``/``value`` ``[k, b, g, d]`` -> ``[s, b, h * d]`` (packed: ``[t, h, d]`` in,
        ``[t, h * d]`` out)."""
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by build.attention=sdpa")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params, dropout_p)
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
            s, k_len = q.shape[2], k.shape[2]
            if self.context_parallel is not None:
                out = self._context_parallel(q, k, v, attention_mask, mask_type, dropout_p)
                return out.permute(2, 0, 1, 3).reshape(s, out.shape[0], self.heads * self.v_head_dim)
            mask = None
            if attention_mask is not None:
                mask = ~attention_mask.bool()  # Megatron: True = masked out; SDPA: True = attends
            elif mask_type == AttnMaskType.causal and s != k_len:
                # Bottom-right aligned: query i sits at key position k_len - s + i (SDPA's is_causal would not).
                mask = torch.ones(s, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - s)
            if self._window_bites(k_len):
                window = window_mask(s, k_len, self.window, q.device)
                mask = window if mask is None else mask & window
            causal = mask is None and mask_type == AttnMaskType.causal and s > 1
            out = self._sdpa(q, k, v, mask, causal, dropout_p)  # [b, h, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, out.shape[0], self.heads * self.v_head_dim)

    def _window_bites(self, keys: int) -> bool:
        """Whether this layer's window hides any of ``keys`` keys (logs once which kernel then runs on a GPU)."""
        if self.window is None or keys <= self.window + 1:
            return False
        global _logged_window_kernel
        if not _logged_window_kernel and torch.cuda.is_available():
            _logged_window_kernel = True
            logger.info(
                "sliding-window attention (%d keys before each query) runs SDPA with an explicit mask: the "
                "memory-efficient kernel, not flash (packed sequences: varlen's window where torch has it)",
                self.window,
            )
        return True

    def _context_parallel(self, q, k, v, attention_mask, mask_type, dropout_p: float) -> torch.Tensor:
        """The sequence split over context-parallel ranks (``models.context_parallel``): causal self-attention only."""
        from megatron.core.transformer.enums import AttnMaskType

        if attention_mask is not None or mask_type != AttnMaskType.causal or q.shape[2] != k.shape[2]:
            raise ValueError("context parallelism supports causal self-attention over the whole sequence only")
        from megatron_opd.models import context_parallel

        return context_parallel.attend(
            q,
            k,
            v,
            self.context_parallel,
            lambda q, k, v, mask, causal: self._sdpa(q, k, v, mask, causal, dropout_p),
            window=self.window,
        )

    def _sdpa(self, q, k, v, mask, causal: bool, dropout_p: float) -> torch.Tensor:
        if self.softcap is not None:
            return self._softcapped(q, k, v, mask, causal, dropout_p)
        gqa = self.groups != self.heads
        skip, dv = 0, v.shape[-1]
        if self.softmax_offset is not None:
            q, k, v, mask, causal, skip = with_sink(q, k, v, mask, causal, self.softmax_offset, self.softmax_scale)
        elif q.shape[-1] != dv:  # multi-latent attention: one width for the flash kernels
            q, k, v = equal_head_widths(q, k, v)
            _log_padded_heads(q, k, v, mask, dropout_p, causal, gqa, dv)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale, enable_gqa=gqa
        )
        return out if out.shape[-1] == dv and not skip else out[:, :, skip:, :dv]

    def _softcapped(self, q, k, v, mask, causal: bool, dropout_p: float) -> torch.Tensor:
        """``_sdpa`` with the scores soft-capped, in transformers' order: scale, cap, mask, float32 softmax."""
        global _logged_softcap
        if not _logged_softcap and torch.cuda.is_available():
            _logged_softcap = True
            logger.info("soft-capped attention logits: scores formed explicitly (memory grows with s^2), not SDPA")
        if self.groups != self.heads:
            k, v = (x.repeat_interleave(self.heads // self.groups, dim=1) for x in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if causal:
            s, k_len = scores.shape[-2:]
            mask = torch.ones(s, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - s)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if dropout_p:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, v)

    def _packed(self, query, key, value, params, dropout_p: float) -> torch.Tensor:
        """Packed sequences ``[t, heads, d]``: each sequence of ``cu_seqlens`` attends causally to itself only."""
        if self.context_parallel is not None:
            raise ValueError("packed sequences with context parallelism are not supported; set train.packing=false")
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences must use qkv_format='thd', got {params.qkv_format!r}")
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if not torch.equal(cu_q, cu_k):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        exact_kernel = query.is_cuda and dropout_p == 0.0 and self.softcap is None and self.softmax_offset is None
        varlen = _varlen_causal_attn(self.window) if exact_kernel else None  # varlen takes no softcap, no sinks
        if varlen is not None:
            max_len = int(params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max()))
            q, k, v = equal_head_widths(query, key, value)  # varlen's flash kernel takes equal head sizes only
            out = varlen(q, k, v, cu_q.to(torch.int32), max_len, self.softmax_scale, self.groups != self.heads)
            if out is not None:
                return out[..., : self.v_head_dim].reshape(out.shape[0], self.heads * self.v_head_dim)
        lengths = cu_q[1:] - cu_q[:-1]
        end = int(cu_q[-1])
        if end == 0:
            return query.new_zeros(query.shape[0], self.heads * self.v_head_dim)
        longest = int(lengths.max())
        if len(lengths) * longest**2 <= PADDED_COST_BOUND * int((lengths**2).sum()):
            out = self._padded(query, key, value, cu_q[:-1], lengths, longest, dropout_p)
        else:
            out = self._per_sequence(query, key, value, cu_q.tolist(), dropout_p)
        if end < query.shape[0]:  # tokens after the last sequence (padding) attend to nothing useful
            out = torch.cat([out, out.new_zeros(query.shape[0] - end, *out.shape[1:])])
        return out.reshape(query.shape[0], self.heads * self.v_head_dim)

    def _padded(self, query, key, value, starts, lengths, longest: int, dropout_p: float) -> torch.Tensor:
        """All sequences in one SDPA call, gathered into ``[n, heads, longest, d]`` with the padding at the end of
        each row: a causal mask then keeps every real query off the padding, and padded rows are dropped."""
        positions = torch.arange(longest, device=query.device)
        tokens = (starts[:, None] + positions).clamp(max=query.shape[0] - 1)  # [n, longest]
        real = positions < lengths[:, None]
        q, k, v = (x[tokens].permute(0, 2, 1, 3) for x in (query, key, value))
        mask = window_mask(longest, longest, self.window, query.device) if self._window_bites(longest) else None
        out = self._sdpa(q, k, v, mask, mask is None and longest > 1, dropout_p)
        return out.permute(0, 2, 1, 3)[real]  # [t, heads, d]

    def _per_sequence(self, query, key, value, bounds: list[int], dropout_p: float) -> torch.Tensor:
        pieces = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi == lo:
                continue
            q, k, v = (x[lo:hi].permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))  # [1, heads, n, d]
            mask = window_mask(hi - lo, hi - lo, self.window, query.device) if self._window_bites(hi - lo) else None
            pieces.append(self._sdpa(q, k, v, mask, mask is None and hi - lo > 1, dropout_p)[0].permute(1, 0, 2))
        return torch.cat(pieces)

    def _dropout_rng(self, dropout_p: float):
        """Megatron's RNG for attention dropout: the tensor-parallel tracker's stream, unless sequence-parallel."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()


@functools.cache
def per_layer_rope_attention(attention: type) -> type:
    """``attention`` (Megatron's ``SelfAttention``) taking its RoPE per layer: given the two embeddings stacked by
    :class:`~megatron_opd.models.rope` 's per-layer rotary module (``[2, s, 1, 1, d]``: global, local), sliding-window
    layers take the local one (Gemma 3's ``rope_local_base_freq``) and the others the global one."""

    class PerLayerRope(attention):
        def __init__(self, config, *args, layer_number: int, **kwargs) -> None:
            super().__init__(config, *args, layer_number=layer_number, **kwargs)
            self.rope_index = 0 if layer_window(config, layer_number) is None else 1

        def forward(self, *args, rotary_pos_emb=None, **kwargs):
            if isinstance(rotary_pos_emb, torch.Tensor) and rotary_pos_emb.dim() == 5:
                # this layer's head width (Gemma 4's sliding and full layers differ; the narrower one is padded)
                rotary_pos_emb = rotary_pos_emb[self.rope_index][..., : self.hidden_size_per_attention_head]
            return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    PerLayerRope.__name__ = PerLayerRope.__qualname__ = f"PerLayerRope{attention.__name__}"
    return PerLayerRope


@functools.cache
def no_rope_attention(attention: type) -> type:
    """``attention`` (Megatron's ``SelfAttention``) without rotary embedding: SmolLM3's NoPE layers see no position
    but the causal order, in training, scoring and the sampler's decode alike."""

    class NoRope(attention):
        def forward(self, *args, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, **kwargs):
            return super().forward(*args, **kwargs)

    NoRope.__name__ = NoRope.__qualname__ = f"NoRope{attention.__name__}"
    return NoRope


def eager_output_gate(attention: type) -> type:
    """``attention`` (Megatron's ``SelfAttention`` with ``config.attention_output_gate``: each head's output times
    ``sigmoid`` of its gate, Qwen3-Next's gated attention) with the gate applied eagerly: Megatron's
    ``_apply_output_gate`` is a ``jit_fuser`` (``torch.compile``) function, seconds of compilation per process for
    one multiply."""

    class EagerOutputGate(attention):
        def _apply_output_gate(self, x, gate):
            return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)

    EagerOutputGate.__name__ = EagerOutputGate.__qualname__ = f"EagerOutputGate{attention.__name__}"
    return EagerOutputGate
