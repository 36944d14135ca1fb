"""Mixture-of-Experts routers Megatron-Core lacks, each a ``TopKRouter`` subclass chosen by a family's layer spec.

**Softmax probabilities with a per-expert correction bias** (:func:`softmax_bias_router`). ERNIE 4.5 MoE picks
each token's top-k experts on ``softmax(logits) + e_score_correction_bias`` and weights them by the unbiased
probabilities, renormalised. Megatron-Core's expert bias exists only on its sigmoid path
(``TransformerConfig`` refuses ``moe_router_enable_expert_bias`` with softmax scores), so this router replaces
``TopKRouter.routing`` for that case and keeps everything around it (z-loss, auxiliary losses, the dispatcher's
inputs) Megatron's. The bias is a float32 buffer in the checkpoint's ``[1, experts]`` shape, loaded, checkpointed and
exported like a weight and never trained (no bias update: ERNIE's balancing ran at pre-training only).

**Groups ranked by their best score** (:func:`group_max_router`, DeepSeek-V2's ``group_limited_greedy``).
DeepSeek-V2 keeps, per token, the ``topk_group`` of ``n_group`` expert groups whose single best softmax score is
highest, then the top-k experts within them. Megatron-Core's group-limited top-k ranks a group by the sum of its top
``topk / group_topk`` scores: the same choice only when ``num_experts_per_tok == topk_group`` (the published
DeepSeek-V2's top-6 of 3 groups differs). This router swaps only that selection: Megatron's ``TopKRouter.routing``
runs as it is (softmax scores in fp32, the scaling factor, z-loss and auxiliary losses, token dropping), and its one
top-k call (``compute_topk``, through the routing-replay hook) takes :func:`group_max_topk` instead of Megatron's
group-limited top-k.
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


def group_max_topk(scores, topk: int, num_groups=None, group_topk=None):
    """``(values, indices)`` ``[N, topk]`` of each row of ``scores`` ``[N, experts]``: the best ``topk`` experts
    within the ``group_topk`` of ``num_groups`` groups with the highest single score (all experts without groups)."""
    import torch

    if not group_topk:
        return torch.topk(scores, k=topk, dim=-1)
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, experts // num_groups).max(dim=-1).values
    groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
    kept = kept.repeat_interleave(experts // num_groups, dim=1)
    return torch.topk(scores.masked_fill(~kept, float("-inf")), k=topk, dim=-1)


class _GroupMaxSelection:
    """What Megatron's top-k routing calls in the place of ``TopKRouter.router_replay`` for one ``routing`` call:
    the router's own replay hook (``models/route_replay.py``, or Megatron's ``RouterReplay``) with
    :func:`group_max_topk` as its default choice, or that choice alone without a hook."""

    def __init__(self, replay) -> None:
        self.replay = replay

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.replay is None:
            return group_max_topk(scores, topk, num_groups, group_topk)
        return self.replay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk=group_max_topk)


@functools.cache
def group_max_router():
    """:class:`GroupMaxRouter`, defined on first use (importing Megatron-Core costs seconds)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class GroupMaxRouter(TopKRouter):
        """``TopKRouter`` whose group-limited top-k ranks a group by its best score (the layer's
        ``moe_router_num_groups`` and ``moe_router_group_topk``)."""

        def routing(self, logits, padding_mask=None):
            # Megatron's routing reads ``self.router_replay`` once, for its top-k: hand it the group-max selection
            # for this call; the hook itself (what route_replay installs and finds) stays the attribute's value.
            replay = self.router_replay
            self.router_replay = _GroupMaxSelection(replay)
            try:
                return super().routing(logits, padding_mask)
            finally:
                self.router_replay = replay

    return GroupMaxRouter
