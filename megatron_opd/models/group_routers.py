"""A group-limited router Megatron-Core lacks: groups ranked by their best score (DeepSeek-V2's
``group_limited_greedy``).

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
