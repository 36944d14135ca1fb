"""Gated DeltaNet (Qwen3-Next, Qwen3.5): a linear-attention sequence mixer on Megatron-Core's layer spec, in PyTorch.

Megatron-Core 0.16's own ``GatedDeltaNet`` needs fla (flash-linear-attention) and CUDA at construction and refuses
inference and packed sequences; :class:`GatedDeltaNet` here is a drop-in ``self_attention`` submodule of a
``TransformerLayer`` that runs anywhere: a column-parallel input projection, a causal depthwise convolution over
queries, keys and values, the gated delta rule (:func:`chunk_gated_delta_rule`, the chunked form for whole sequences;
:func:`recurrent_gated_delta_rule`, one token at a time for decoding), a gated RMSNorm and a row-parallel output
projection. fla's fused Triton kernels replace the two PyTorch forms on CUDA where fla is installed
(``build.gated_delta_net_kernel``, :mod:`~megatron_opd.models.gated_delta_kernels`); fla is optional.

Tensor parallelism splits the key heads (each with its group of value heads): every rank's projection rows,
convolution channels, decay parameters and value heads are those of its key heads (``Split.GROUPED`` in the weight
rules lays the Hugging Face tensors out so), and the output projection's all-reduce joins them.

State: per layer, the convolution's window (its last ``kernel - 1`` inputs) and the recurrent state
``[b, value heads, key dim, value dim]``, kept in the sampler's inference context beside the attention layers' KV
cache (:func:`recurrent_states`). Packed sequences (``PackedSeqParams``) each start from a zero state and window.
Context parallelism would need the state passed between ranks: refused.

Shape legend: ``s`` positions, ``b`` batch, ``t`` packed tokens, ``n`` key heads on this rank, ``h`` value heads on
this rank, ``dk``/``dv`` key/value head dims, ``C`` convolution channels on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64
"""Positions per chunk of :func:`chunk_gated_delta_rule` (fla's and transformers' choice)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's L2 normalisation of queries and keys (``x / sqrt(|x|^2 + eps)``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK):
    """The gated delta rule over whole sequences, ``chunk`` positions at a time (WY form, as fla and transformers).

    ``q``/``k`` ``[b, h, s, dk]`` (L2-normed), ``v`` ``[b, h, s, dv]``, ``g`` (log decay, <= 0) and ``beta``
    ``[b, h, s]``; returns the output ``[b, h, s, dv]`` and the final state ``[b, h, dk, dv]``, in float32."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = (-s) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // chunk
    q = q * dk**-0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, -1) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(b, h, n, chunk).cumsum(-1)  # log decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [b, h, n, c, c]
    # (I + strictly lower part of beta k k^T decay)^-1, applied to beta v and to the decayed beta k.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * cum[:, :, i, -1].exp()[..., None, None] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, n * chunk, dv)[:, :, :s], state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The gated delta rule one position at a time (decoding; the reference for the chunked form): the state decays
    by ``exp(g)``, then moves toward ``v`` along ``k`` by ``beta``, and the query reads it. Same shapes as
    :func:`chunk_gated_delta_rule`."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    b, h, s, dk = k.shape
    q = q * dk**-0.5
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    out = torch.empty_like(v)
    for i in range(s):
        state = state * g[:, :, i].exp()[..., None, None]
        delta = (v[:, :, i] - (state * k[:, :, i, :, None]).sum(-2)) * beta[:, :, i, None]
        state = state + k[:, :, i, :, None] * delta[:, :, None, :]
        out[:, :, i] = (state * q[:, :, i, :, None]).sum(-2)
    return out, state


@dataclass
class GatedDeltaNetSubmodules:
    """The linear layers of :class:`GatedDeltaNet` (Megatron's column- and row-parallel linears, or TE's)."""

    in_proj: type | None = None
    out_proj: type | None = None


@dataclass
class LayerState:
    """One Gated DeltaNet layer's decoding state."""

    window: torch.Tensor
    """The convolution's last ``kernel - 1`` inputs ``[b, C, kernel - 1]``."""
    recurrent: torch.Tensor
    """``[b, h, dk, dv]`` in float32."""


def recurrent_states(inference_context) -> dict[int, LayerState]:
    """Layer number -> its :class:`LayerState`, kept on the sampler's inference context (one per ``generate``)."""
    states = getattr(inference_context, "gated_delta_states", None)
    if states is None:
        states = {}
        inference_context.gated_delta_states = states
    return states


class GatedDeltaNet(torch.nn.Module):
    """Gated DeltaNet as a Megatron-Core ``self_attention`` submodule (``forward`` returns ``(output, bias)``)."""

    def __init__(
        self,
        config,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int,
        pg_collection=None,
        kernel: str = "auto",
        **_,
    ):
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        from megatron_opd.models.gated_delta_kernels import check_kernel

        check_kernel(kernel)
        self.kernel = kernel

        if config.context_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: Gated DeltaNet layers (Qwen3-Next, Qwen3.5) "
                "do not split the sequence over context-parallel ranks; set parallel.context_parallel_size=1"
            )
        self.config = config
        self.layer_number = layer_number
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_group = tp_group
        tp = tp_group.size()
        self.tp = tp
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.n = config.linear_num_key_heads // tp
        self.ratio = config.linear_num_value_heads // config.linear_num_key_heads
        self.h = self.n * self.ratio
        self.kernel_size = config.linear_conv_kernel_dim
        self.eps = config.layernorm_epsilon
        # One key head's rows of the input projection: q, k, its values' v and z, then their beta and decay inputs.
        group = 2 * self.dk + 2 * self.ratio * self.dv + 2 * self.ratio
        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            group * config.linear_num_key_heads,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=tp_group,
        )
        channels = self.n * (2 * self.dk + self.ratio * self.dv)  # grouped per key head: q, k, v
        dtype = config.params_dtype
        self.conv_weight = torch.nn.Parameter(torch.empty(channels, 1, self.kernel_size, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.h, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.h, dtype=dtype))
        self.out_norm_weight = torch.nn.Parameter(torch.ones(self.dv, dtype=dtype))
        for param in (self.conv_weight, self.A_log, self.dt_bias):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        with torch.no_grad():
            torch.nn.init.uniform_(self.conv_weight, -(self.kernel_size**-0.5), self.kernel_size**-0.5)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        self.out_proj = build_module(
            submodules.out_proj,
            self.h * self.dv * tp,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=tp_group,
        )

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None, **_):
        """``hidden_states [s, b, H]`` (packed: ``[t, 1, H]``) -> ``(output [s, b, H], bias)``."""
        proj, _bias = self.in_proj(hidden_states)  # [s, b, n * group]
        s, b = proj.shape[:2]
        parts = proj.reshape(s, b, self.n, -1).split(
            [self.dk, self.dk, self.ratio * self.dv, self.ratio * self.dv, self.ratio, self.ratio], dim=-1
        )
        q, k, v, z, beta_in, decay_in = parts
        mixed = torch.cat([q, k, v], dim=-1).reshape(s, b, -1).permute(1, 2, 0)  # [b, C, s]
        beta = beta_in.reshape(s, b, self.h).sigmoid().permute(1, 2, 0)  # [b, h, s]
        g = -self.A_log.float().exp() * F.softplus(decay_in.reshape(s, b, self.h).float() + self.dt_bias)
        g = g.permute(1, 2, 0)
        if packed_seq_params is not None:
            core = self._packed(mixed, g, beta, packed_seq_params)
        elif inference_context is not None:
            core = self._with_state(mixed, g, beta, recurrent_states(inference_context))
        else:
            core, _ = self._mix(mixed, g, beta)
        # Gated RMSNorm over each value head: norm, weight, then silu of the head's z.
        z = z.reshape(s, b, self.h, self.dv).permute(1, 0, 2, 3)
        normed = F.rms_norm(core.float(), (self.dv,), eps=self.eps).to(hidden_states.dtype)
        out = (self._norm_weight() * normed * F.silu(z.float())).to(hidden_states.dtype)  # [b, s, h, dv]
        return self.out_proj(out.permute(1, 0, 2, 3).reshape(s, b, -1))

    def _norm_weight(self) -> torch.Tensor:
        """The gated norm's weight; every rank uses it on its own heads, so its gradient is summed over the group."""
        if self.tp == 1 or not torch.is_grad_enabled():
            return self.out_norm_weight
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(self.out_norm_weight, group=self.tp_group)

    def _conv(self, mixed, window=None):
        """The causal convolution after ``window`` (the inputs before these; zeros when None): ``mixed [b, C, s]``
        -> queries and keys ``[b, s, n, dk]`` (not yet L2-normed) and values ``[b, s, h, dv]``."""
        s = mixed.shape[-1]
        padded = F.pad(mixed, (self.kernel_size - 1, 0)) if window is None else torch.cat([window, mixed], dim=-1)
        conv = F.silu(F.conv1d(padded, self.conv_weight, groups=mixed.shape[1]))  # [b, C, s]
        b = conv.shape[0]
        q, k, v = conv.reshape(b, self.n, -1, s).split([self.dk, self.dk, self.ratio * self.dv], dim=2)
        return q.permute(0, 3, 1, 2), k.permute(0, 3, 1, 2), v.reshape(b, self.h, self.dv, s).permute(0, 3, 1, 2)

    def _rule(self, q, k, v, g, beta, state=None):
        """The delta rule from ``state`` on :meth:`_conv`'s outputs (``g``/``beta`` ``[b, h, s]``): output
        ``[b, s, h, dv]`` and the final state. One position from a state runs the recurrent form, else the chunked
        one; fla's kernels or ours (:func:`~megatron_opd.models.gated_delta_kernels.uses_fla`)."""
        from megatron_opd.models import gated_delta_kernels as fla

        decode = q.shape[1] == 1 and state is not None
        if fla.uses_fla(self.kernel, q.device):
            rule = fla.fla_recurrent if decode else fla.fla_chunk
            return rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), state)
        q, k = (l2norm(x.float()).repeat_interleave(self.ratio, dim=2).transpose(1, 2) for x in (q, k))
        rule = recurrent_gated_delta_rule if decode else chunk_gated_delta_rule
        out, final = rule(q, k, v.transpose(1, 2), g, beta, state)
        return out.transpose(1, 2), final

    def _mix(self, mixed, g, beta, window=None, state=None):
        """Convolution (after ``window``), then the delta rule from ``state``: ``mixed [b, C, s]`` -> output
        ``[b, s, h, dv]`` and the final state."""
        return self._rule(*self._conv(mixed, window), g, beta, state)

    def _with_state(self, mixed, g, beta, states: dict[int, LayerState]):
        """Prefill or decode with the sampler's state: a new context (no state yet) starts from zeros."""
        held = states.get(self.layer_number)
        window = None if held is None else held.window
        out, final = self._mix(mixed, g, beta, window, None if held is None else held.recurrent)
        inputs = F.pad(mixed, (self.kernel_size - 1, 0)) if window is None else torch.cat([window, mixed], dim=-1)
        states[self.layer_number] = LayerState(inputs[..., inputs.shape[-1] - (self.kernel_size - 1) :], final)
        return out

    def _packed(self, mixed, g, beta, params):
        """Packed sequences (``[1, C, t]``): each of ``cu_seqlens`` from a zero window and state (fla: one call
        with ``cu_seqlens``; ours: one call per sequence); positions after the last sequence give zeros."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds = [lo for lo, hi in zip(cu.tolist()[:-1], cu.tolist()[1:]) if hi > lo] + [int(cu[-1])]
        out = mixed.new_zeros(1, mixed.shape[-1], self.h, self.dv, dtype=torch.float32)
        pieces = list(zip(bounds[:-1], bounds[1:]))
        from megatron_opd.models import gated_delta_kernels as fla

        if pieces and fla.uses_fla(self.kernel, mixed.device):
            start, end = bounds[0], bounds[-1]
            q, k, v = (torch.cat(parts, dim=1) for parts in zip(*(self._conv(mixed[..., lo:hi]) for lo, hi in pieces)))
            cu_seqlens = torch.tensor([b - start for b in bounds], dtype=torch.long, device=mixed.device)
            core, _ = fla.fla_chunk(
                q, k, v, g[..., start:end].transpose(1, 2), beta[..., start:end].transpose(1, 2), None, cu_seqlens
            )
            out[:, start:end] = core
            return out
        for lo, hi in pieces:
            out[:, lo:hi] = self._mix(mixed[..., lo:hi], g[..., lo:hi], beta[..., lo:hi])[0]
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The linears shard themselves; the convolution and decay parameters split over tensor-parallel ranks
        along their first axis; the norm weight is replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

        own = {name: p for name, p in self.named_parameters(recurse=False)}
        out = make_sharded_tensors_for_checkpoint(
            own, prefix, {"conv_weight": 0, "A_log": 0, "dt_bias": 0}, sharded_offsets
        )
        for name, child in self.named_children():
            out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
        return out
