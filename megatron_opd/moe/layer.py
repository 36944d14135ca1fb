"""``MoELayer`` whose forward routes on ``[tokens, k]`` indices and permutes without a host sync
(``build.moe_fused_routing``).

The same parameters, buffers, checkpoints and numbers as Megatron-Core's ``MoELayer`` with its all-gather token
dispatcher (expert parallelism 1 at any TP with sequence parallelism; EP > 1 where ``build.moe_token_dispatcher``
is ``allgather``) and with its all-to-all dispatcher at TP=1 (:mod:`~megatron_opd.moe.expert_parallel`: one host
read, the split sizes): the router's gating GEMM and the experts are Megatron's (:class:`GroupedExperts`), the routing
arithmetic is :func:`~megatron_opd.moe.routing.fused_topk_routing` (one operator forward and one backward; on CUDA
a Triton kernel each, ``kernels/moe_router_triton.py``), the permutation :mod:`~megatron_opd.moe.permutation`,
and the gather, activation and combine :mod:`~megatron_opd.moe.ops` (one operator each, a Triton kernel on CUDA; the
combine adds the shared expert, computing its sigmoid gate, where the layer has them and TP x EP is 1).
The router's forward hooks (the trainer's router metrics) get Megatron's dense ``(probs, routing_map)``. Where a
layer needs more of Megatron's router than its top-k (auxiliary or z-loss in training, routing replay, token
dropping, another router class) or another dispatcher, the layer runs Megatron's forward unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def fused_path_refusal(layer, hidden: torch.Tensor, padding_mask, intermediate_tensors) -> str | None:
    """Why ``layer`` (an ``MoELayer``) must run Megatron's own forward for this call, or None."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    c, router = layer.config, layer.router
    training = router.training and torch.is_grad_enabled()
    checks = {
        "another router class": type(router) is not TopKRouter,
        "router pre-hooks or hooks with keyword arguments": bool(
            router._forward_pre_hooks or router._forward_hooks_with_kwargs or router._forward_hooks_always_called
        ),
        "routing replay": router.router_replay is not None,
        "sinkhorn routing": router.routing_type == "sinkhorn",
        "auxiliary losses": router.routing_type != "none" and training,
        "z-loss": c.moe_z_loss_coeff is not None and training,
        "token dropping": c.moe_expert_capacity_factor is not None,
        "input jitter or forced balancing": c.moe_input_jitter_eps is not None or c.moe_router_force_load_balancing,
        "TransformerEngine fusions": c.moe_router_fusion or c.moe_permute_fusion,
        "a padding mask or partial forward": padding_mask is not None or intermediate_tensors is not None,
        "latent or overlapped shared experts": bool(c.moe_latent_size) or layer.shared_expert_overlap,
        "layer recompute": layer.moe_layer_recompute,
        "another dispatcher": type(layer.token_dispatcher)
        not in (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher),
        "the all-to-all dispatcher with tensor parallelism": type(layer.token_dispatcher) is MoEAlltoAllTokenDispatcher
        and layer.token_dispatcher.tp_size > 1,
        # models.grouped_experts.GroupedExperts (not imported: models builds this layer)
        "sequential experts": not (hasattr(layer.experts, "grouped_forward") and layer.experts._grouped_ok(hidden)),
    }
    return next((why for why, refused in checks.items() if refused), None)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """A scalar one on ``device``, made once (the expert-bias count adds it per routed slot)."""
    return torch.ones((), device=device)


def plain_shared_expert(layer) -> bool:
    """Whether ``layer``'s shared expert (if any) is Megatron's ``MLP`` with a SiLU or SwiGLU and no bias, which
    :meth:`FusedMoELayer._shared_expert` computes with :func:`~megatron_opd.moe.ops.moe_silu_glu` (one operator
    instead of two) and whose gate the combine applies."""
    from megatron_opd.moe.ops import plain_silu_glu

    c, shared = layer.config, layer.shared_experts
    if shared is None or layer.shared_experts_recompute or c.bias_activation_fusion:
        return False
    return plain_silu_glu(c) and shared.linear_fc1.bias is None and shared.linear_fc2.bias is None


@functools.cache
def fused_moe_layer(base: type) -> type:
    """``base`` (Megatron's ``MoELayer`` or a subclass) with the fused forward."""
    from megatron.core.tensor_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_opd.moe.expert_parallel import expert_parallel_experts
    from megatron_opd.moe.ops import moe_combine, moe_permute, moe_silu_glu
    from megatron_opd.moe.permutation import permutation
    from megatron_opd.moe.routing import RouterSpec, fused_topk_routing

    class FusedMoELayer(base):
        """``MoELayer`` routing on top-k indices, permuting by one sort, with no host sync (module docstring)."""

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if fused_path_refusal(self, hidden_states, padding_mask, intermediate_tensors) is not None:
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
            shared_TH, gate_w_H = self._shared_expert(hidden_states)
            router, dispatcher = self.router, self.token_dispatcher
            router._maintain_float32_expert_bias()
            logits_TE = router.gating(hidden_states).view(-1, self.config.num_moe_experts)
            probs_TK, experts_TK = fused_topk_routing(logits_TE, RouterSpec.of(self.config), router.expert_bias)
            if router.enable_expert_bias and torch.is_grad_enabled():  # Megatron's count for the bias update
                with torch.no_grad():
                    router.local_tokens_per_expert.index_put_(
                        (experts_TK.reshape(-1),), _one(logits_TE.device), accumulate=True
                    )
            if router._forward_hooks:  # e.g. the trainer's router metrics: they see Megatron's dense outputs
                self._call_router_hooks(hidden_states, probs_TK, experts_TK)
            hidden_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
            if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):  # experts on other ranks: expert_parallel
                out_TH = expert_parallel_experts(hidden_TH, probs_TK, experts_TK, self.experts.grouped_forward,
                                                 dispatcher.ep_group, self.num_local_experts, shared_TH, gate_w_H)  # fmt: skip
                return out_TH.view(hidden_states.shape), None
            group = dispatcher.tp_ep_group
            if group.size() > 1:  # as the all-gather dispatcher: every token on every TP x EP rank
                with torch.no_grad():
                    experts_TK = gather_from_sequence_parallel_region(experts_TK, group=group)
                probs_TK = gather_from_sequence_parallel_region(probs_TK, group=group)
                hidden_TH = gather_from_sequence_parallel_region(hidden_TH, group=group, use_global_buffer=True)
            first = self.local_expert_indices[0]
            perm = permutation(experts_TK, first, self.num_local_experts, self.config.num_moe_experts)
            rows_RH, probs_R, inverse_TK = moe_permute(hidden_TH, probs_TK, perm.slots_R, perm.offsets_L)
            rows_RH = self.experts.grouped_forward(rows_RH, perm.offsets_L, probs_R)
            if group.size() == 1:  # the combine adds the shared expert (and computes and applies its gate)
                gate_x_TH = hidden_TH if gate_w_H is not None else None
                out_TH = moe_combine(rows_RH, inverse_TK, perm.offsets_L, shared_TH, gate_x_TH, gate_w_H)
                return out_TH.view(hidden_states.shape), None
            out_TH = moe_combine(rows_RH, inverse_TK, perm.offsets_L)
            out_TH = reduce_scatter_to_sequence_parallel_region(out_TH.to(probs_TK.dtype), group=group)
            return self._plus_shared(out_TH.to(rows_RH.dtype), shared_TH, gate_w_H, hidden_states), None

        @staticmethod
        def _plus_shared(out_TH, shared_TH, gate_w_H, hidden_states):
            """The layer's output: ``out_TH`` plus the shared expert's output times its gate, in torch (where the
            combine cannot add them: its tokens are not this rank's)."""
            if shared_TH is not None and gate_w_H is not None:  # Megatron's SharedExpertMLP gate
                shared_TH = shared_TH * torch.sigmoid(F.linear(hidden_states, gate_w_H)).reshape(-1, 1)
            if shared_TH is not None:
                out_TH = out_TH + shared_TH
            return out_TH.view(hidden_states.shape)

        def _shared_expert(self, hidden_states) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            """``(shared_TH, gate_weight)``: the shared expert's output before its gate (Megatron's arithmetic) and
            the gate's ``[1, H]`` weight (None without a gate; both None without a shared expert)."""
            shared = self.shared_experts
            if shared is None:
                return None, None
            if not plain_shared_expert(self):
                return self.shared_experts_compute(hidden_states).reshape(-1, hidden_states.shape[-1]), None
            fc1 = shared.linear_fc1(hidden_states)[0]
            fc1 = fc1.view(-1, fc1.shape[-1])
            out = shared.linear_fc2(moe_silu_glu(fc1, None, None, bool(self.config.gated_linear_unit)))[0]
            gate_w_H = shared.gate_weight if shared.use_shared_expert_gate else None
            return out.reshape(-1, hidden_states.shape[-1]), gate_w_H

        def _call_router_hooks(self, hidden_states, probs_TK, experts_TK) -> None:
            """The router's forward hooks, given what Megatron's router returns: ``(probs [T, E], routing_map
            [T, E])`` (two more operators, only where a hook is registered)."""
            experts = self.config.num_moe_experts
            probs_TE = probs_TK.new_zeros(probs_TK.shape[0], experts).scatter(1, experts_TK, probs_TK)
            routing_map_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter(1, experts_TK, True)
            for hook in tuple(self.router._forward_hooks.values()):
                hook(self.router, (hidden_states, None), (probs_TE, routing_map_TE))

    FusedMoELayer.__name__ = FusedMoELayer.__qualname__ = f"Fused{base.__name__}"
    return FusedMoELayer


def use_fused_moe_layers(chunks: list) -> int:
    """Give every ``MoELayer`` in ``chunks`` the fused forward (its class becomes :func:`fused_moe_layer`'s
    subclass: no parameter, buffer or name changes; grouped experts' weights re-homed into one storage per
    projection, ``GroupedExperts.share_one_storage``); returns how many."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.__class__ = fused_moe_layer(type(layer))
        if hasattr(layer.experts, "share_one_storage"):  # models.grouped_experts.GroupedExperts
            layer.experts.share_one_storage()
    return len(layers)
