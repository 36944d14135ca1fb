"""Routing replay (``rollout.routing_replay``): the MoE student's routers record, or take, the experts of each token.

A sampler and the trainer may pick different experts for the same token (near-ties, kernels that round otherwise,
an expert bias updated between sync and rollout); the trainer's log-probabilities then belong to another policy
than the one that sampled. With replay the trainer routes each token to the experts the sampler chose, and weighs
them with its own router's scores for those experts, so the router still gets its gradient through them.

One :class:`RouteReplay` per router sits in Megatron-Core's own hook (``TopKRouter.router_replay``, whose
``get_replay_topk`` its top-k routing calls, 0.16 and later); it is set per router, not through Megatron's global
``RouterReplay`` list, so a teacher or a second model in the process keeps its own routing. Routes travel with the
micro-batch as the ``routes`` column ``[B, S, M, k]`` (``M`` MoE layers, ``k`` experts per token, ``-1``: none, the
router's own choice), so packing, the context-parallel split and the lockstep dummies carry them like the tokens;
:func:`feed` hands each router of a chunk its layer's routes before the chunk's forward. A layer recomputed in the
backward (``build.recompute_granularity=full``) takes its micro-batch's routes from a queue in schedule order
(pipeline stages run several forwards before the first backward).

Replaying also counts, per (token, MoE layer), whether the router's own choice on its layer's input differs from
the replayed one: ``moe/route_mismatch`` (``trainer.router.RouterMetrics``), at no extra forward. At the first MoE
layer that is the share a forward without replay would route otherwise; a deeper layer is judged on the sampler's
path (its input is the replayed forward's), so one token's difference is not counted again in every later layer.

Shape legend: ``B`` rows, ``S`` positions, ``M`` MoE layers, ``k`` experts per token, ``N`` tokens of one router call.
"""

from __future__ import annotations

import collections

import torch


class RouteReplay:
    """One router's replay state: ``record`` keeps the last call's own choice; routes given by :func:`feed` replace
    the router's choice where they are set."""

    def __init__(self, moe_index: int) -> None:
        self.moe_index = moe_index
        """Which of the model's MoE layers (0-based, in layer order) this router belongs to."""
        self.record = False
        self.recorded: torch.Tensor | None = None
        """``[N, k]`` the last call's own choice (``record``)."""
        self.current: torch.Tensor | None = None
        """``[N, k]`` the routes of the forward running now (None: the router's own)."""
        self.count = True
        """Whether the forward running now counts toward ``moe/route_mismatch`` (not a lockstep dummy's)."""
        self.recompute: collections.deque = collections.deque()
        """Routes of forwards whose layers the backward recomputes, oldest first."""
        self.counts: torch.Tensor | None = None
        """``[2]`` replayed (token, layer) routings whose own choice differed, and all replayed ones (forwards that
        build the graph), on the router's device (read once per step: :func:`take_counts`)."""

    def own_topk(self, scores, topk, num_groups, group_topk, default_compute_topk):
        """The router's own choice (tests override it to provoke a sampler-side mismatch)."""
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's hook: ``(values, indices)`` of the experts of each row of ``scores`` ``[N, experts]``."""
        values, own_Nk = self.own_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.record:
            self.recorded = own_Nk.detach()
        # Inside the autograd backward: a recomputed layer, whose routes are the oldest queued.
        in_backward = torch._C._current_graph_task_id() != -1
        routes_Nk, count = (self.recompute.popleft() if self.recompute else (None, False)) if in_backward else (
            self.current, self.count)  # fmt: skip
        if routes_Nk is None:
            return values, own_Nk
        if routes_Nk.shape != own_Nk.shape:
            raise ValueError(
                f"routing replay: MoE layer {self.moe_index} got routes {tuple(routes_Nk.shape)} for "
                f"{tuple(own_Nk.shape)} routed tokens (the routes do not follow the micro-batch's layout)"
            )
        routes_Nk = routes_Nk.to(own_Nk.device, own_Nk.dtype)
        set_N = (routes_Nk >= 0).all(-1)
        if count and torch.is_grad_enabled():  # once per token: the forward that builds the graph
            same_N = (routes_Nk.sort(-1).values == own_Nk.sort(-1).values).all(-1)
            counts = torch.stack([(set_N & ~same_N).sum(), set_N.sum()]).double()
            self.counts = counts if self.counts is None else self.counts + counts
        index_Nk = torch.where(set_N[:, None], routes_Nk, own_Nk)
        return scores.gather(1, index_Nk), index_Nk


def install(chunks: list) -> list[RouteReplay]:
    """A :class:`RouteReplay` in every MoE router of ``chunks`` (a student's, on this rank); returns them in layer
    order. Idempotent."""
    from megatron.core.transformer.moe.router import TopKRouter

    config = chunks[0].config
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    moe_index = {layer: i for i, layer in enumerate(j for j, on in enumerate(pattern) if on)}
    out = []
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, TopKRouter) or module.layer_number - 1 not in moe_index:
                continue  # multi-token-prediction layers route on their own
            if not isinstance(module.router_replay, RouteReplay):
                module.router_replay = RouteReplay(moe_index[module.layer_number - 1])
            out.append(module.router_replay)
    return out


def replays(chunk) -> list[RouteReplay]:
    """The :class:`RouteReplay` s of ``chunk`` (none where :func:`install` was not called)."""
    return [m.router_replay for m in chunk.modules() if isinstance(getattr(m, "router_replay", None), RouteReplay)]


def feed(chunk, routes_BSMk: torch.Tensor | None, *, count: bool = True) -> None:
    """Give each router of ``chunk`` its layer's routes of the micro-batch about to run (None: their own choice);
    ``count``: whether its routings count toward the mismatch (not a lockstep dummy's). With sequence parallelism
    each tensor-parallel rank routes its share of the positions."""
    hooks = replays(chunk)  # none on a pipeline stage without MoE layers
    config = chunk.config
    queue = config.recompute_granularity == "full" and chunk.training and torch.is_grad_enabled()
    for hook in hooks:
        routes_Nk = None
        if routes_BSMk is not None:
            routes_SBk = routes_BSMk[:, :, hook.moe_index].transpose(0, 1)
            if config.sequence_parallel and config.tensor_model_parallel_size > 1:
                from megatron.core import parallel_state as ps

                share = routes_SBk.shape[0] // config.tensor_model_parallel_size
                rank = ps.get_tensor_model_parallel_rank()
                routes_SBk = routes_SBk[rank * share : (rank + 1) * share]
            routes_Nk = routes_SBk.reshape(-1, routes_SBk.shape[-1])
        hook.current, hook.count = routes_Nk, count
        if queue:
            hook.recompute.append((routes_Nk, count))


def reset(chunks: list) -> None:
    """Forget routes left from an interrupted schedule (called before each one)."""
    for chunk in chunks:
        for hook in replays(chunk):
            hook.current = None
            hook.recompute.clear()


def take_counts(chunks: list) -> torch.Tensor:
    """``[2]`` float64: replayed routings whose own choice differed, and all replayed ones, on this rank since the
    last call (then zeroed)."""
    out = torch.zeros(2, dtype=torch.float64)
    for chunk in chunks:
        for hook in replays(chunk):
            if hook.counts is not None:
                out += hook.counts.cpu()  # a device sync, once per router and step
                hook.counts = None
    return out


def recording(chunks: list, on: bool) -> list[RouteReplay]:
    """Switch the routers' recording of their own choice (the built-in sampler's routes); returns the hooks in MoE
    layer order."""
    hooks = sorted((h for chunk in chunks for h in replays(chunk)), key=lambda h: h.moe_index)
    for hook in hooks:
        hook.record = on
        hook.recorded = None
    return hooks
