"""A Mixture-of-Experts router Megatron-Core lacks: softmax probabilities with a per-expert correction bias.

ERNIE 4.5 MoE picks each token's top-k experts on ``softmax(logits) + e_score_correction_bias`` and weights them by
the unbiased probabilities, renormalised. Megatron-Core's expert bias exists only on its sigmoid path
(``TransformerConfig`` refuses ``moe_router_enable_expert_bias`` with softmax scores), so this router replaces
``TopKRouter.routing`` for that case and keeps everything around it (z-loss, auxiliary losses, the dispatcher's
inputs) Megatron's. The bias is a float32 buffer in the checkpoint's ``[1, experts]`` shape, loaded, checkpointed and
exported like a weight and never trained (no bias update: ERNIE's balancing ran at pre-training only).
"""

from __future__ import annotations

import functools


def _topk(scores, topk: int, num_groups=None, group_topk=None):
    """The experts a row's scores pick (Megatron's ``compute_topk`` without groups; the routing-replay hook's default)."""
    import torch

    return torch.topk(scores, k=topk, dim=-1)


@functools.cache
def softmax_bias_router():
    """:class:`SoftmaxBiasRouter`, defined on first use (importing Megatron-Core costs seconds)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
    from megatron.core.transformer.moe.router import TopKRouter

    class SoftmaxBiasRouter(TopKRouter):
        """``TopKRouter`` whose top-k is chosen on softmax probabilities plus ``expert_bias`` (``[1, E]``, fp32)."""

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            device = self.weight.device
            del self.expert_bias  # Megatron's plain attribute (None without its sigmoid bias)
            self.register_buffer("expert_bias", torch.zeros(1, config.num_moe_experts, device=device))

        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            seq_length, bsz = logits.shape[:2]
            logits = logits.view(-1, self.config.num_moe_experts)
            if padding_mask is not None:
                padding_mask = padding_mask.reshape(-1)
            logits = self.apply_z_loss(logits, padding_mask=padding_mask)
            scores = torch.softmax(logits.float(), dim=-1)
            biased = scores + self.expert_bias.float()
            replay = getattr(self, "router_replay", None)  # rollout.routing_replay (models/route_replay.py)
            if replay is not None:
                _, top = replay.get_replay_topk(biased, self.topk, default_compute_topk=_topk)
            else:
                _, top = _topk(biased, self.topk)
            chosen = scores.gather(1, top)
            # ERNIE clamps the sum at moe_norm_min (1e-12); top-k of a softmax sums to at least k / E.
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            probs = torch.zeros_like(scores).scatter(1, top, chosen).type_as(logits)
            routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
            if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
                aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                    logits, self.topk, "softmax", fused=self.config.moe_router_fusion, padding_mask=padding_mask
                )
                masked = padding_mask is not None
                probs = self._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
                probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, with_padding_mask=masked)
                probs = self._apply_global_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
            return probs, routing_map

    return SoftmaxBiasRouter
