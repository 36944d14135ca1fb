"""``MoELayer`` whose forward routes on ``[tokens, k]`` indices and permutes without a host sync
(``build.moe_fused_routing``).

The same parameters, buffers, checkpoints and numbers as Megatron-Core's ``MoELayer`` with its all-gather token
dispatcher (expert parallelism 1 at any TP with sequence parallelism; EP > 1 where ``build.moe_token_dispatcher``
is ``allgather``): the router's gating GEMM and the experts are Megatron's (:class:`GroupedExperts`), the routing
arithmetic is :func:`~megatron_opd.moe.routing.fused_topk_routing` (one operator forward and one backward; on CUDA
a Triton kernel each, ``kernels/moe_router_triton.py``) and the permutation :mod:`~megatron_opd.moe.permutation`.
The router's forward hooks (the trainer's router metrics) get Megatron's dense ``(probs, routing_map)``. Where a
layer needs more of Megatron's router than its top-k (auxiliary or z-loss in training, routing replay, token
dropping, another router class) or another dispatcher, the layer runs Megatron's forward unchanged.
"""

from __future__ import annotations

import functools

import torch


def fused_path_refusal(layer, hidden: torch.Tensor, padding_mask, intermediate_tensors) -> str | None:
    """Why ``layer`` (an ``MoELayer``) must run Megatron's own forward for this call, or None."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

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
        "another dispatcher": type(layer.token_dispatcher) is not MoEAllGatherTokenDispatcher,
        # models.grouped_experts.GroupedExperts (not imported: models builds this layer)
        "sequential experts": not (hasattr(layer.experts, "grouped_forward") and layer.experts._grouped_ok(hidden)),
    }
    return next((why for why, refused in checks.items() if refused), None)


@functools.cache
def fused_moe_layer(base: type) -> type:
    """``base`` (Megatron's ``MoELayer`` or a subclass) with the fused forward."""
    from megatron.core.tensor_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    from megatron_opd.moe.permutation import permutation, permute, unpermute
    from megatron_opd.moe.routing import RouterSpec, fused_topk_routing

    class FusedMoELayer(base):
        """``MoELayer`` routing on top-k indices, permuting by one sort, with no host sync (module docstring)."""

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if fused_path_refusal(self, hidden_states, padding_mask, intermediate_tensors) is not None:
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
            shared = self.shared_experts_compute(hidden_states)
            router, dispatcher = self.router, self.token_dispatcher
            router._maintain_float32_expert_bias()
            logits_TE = router.gating(hidden_states).view(-1, self.config.num_moe_experts)
            probs_TK, experts_TK = fused_topk_routing(logits_TE, RouterSpec.of(self.config), router.expert_bias)
            if router.enable_expert_bias and torch.is_grad_enabled():  # Megatron's count for the bias update
                with torch.no_grad():
                    router.local_tokens_per_expert.index_put_(
                        (experts_TK.reshape(-1),), torch.ones((), device=logits_TE.device), accumulate=True
                    )
            if router._forward_hooks:  # e.g. the trainer's router metrics: they see Megatron's dense outputs
                self._call_router_hooks(hidden_states, probs_TK, experts_TK)
            hidden_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
            group = dispatcher.tp_ep_group
            if group.size() > 1:  # as the all-gather dispatcher: every token on every TP x EP rank
                with torch.no_grad():
                    experts_TK = gather_from_sequence_parallel_region(experts_TK, group=group)
                probs_TK = gather_from_sequence_parallel_region(probs_TK, group=group)
                hidden_TH = gather_from_sequence_parallel_region(hidden_TH, group=group, use_global_buffer=True)
            first = self.local_expert_indices[0]
            perm = permutation(experts_TK, first, self.num_local_experts, self.config.num_moe_experts)
            rows_RH, probs_R = permute(hidden_TH, probs_TK, perm)
            rows_RH = self.experts.grouped_forward(rows_RH, perm.offsets_L, probs_R)
            out_TH = unpermute(rows_RH, perm, hidden_TH.shape[0])
            if group.size() > 1:
                out_TH = reduce_scatter_to_sequence_parallel_region(out_TH.to(probs_TK.dtype), group=group)
                out_TH = out_TH.to(rows_RH.dtype)
            output = out_TH.view(hidden_states.shape)
            if shared is not None:
                output = output + shared
            return output, None

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
    subclass: no parameter, buffer or name changes); returns how many."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.__class__ = fused_moe_layer(type(layer))
    return len(layers)
