"""The Mixture-of-Experts student's routers: ``train.freeze_router`` and the per-step router metrics.

Megatron computes the load-balancing loss and the z-loss (``build.moe_aux_loss_coeff``, ``build.moe_z_loss_coeff``)
inside each router, adds their gradients in the router's backward and records their values per layer in its
tracker (``moe_utils.get_moe_layer_wise_logging_tracker``); this module reads that tracker and counts the tokens
routed to each expert, once per optimizer step, over every rank:

- ``moe/load_balancing_loss``, ``moe/z_loss``: the losses without their coefficients, averaged over micro-batches,
  MoE layers and data-parallel ranks (Megatron's own logging of them, with a reduction gloo runs too);
- ``moe/expert_load/layer_NN``: the busiest expert's routed tokens over the mean expert's, per MoE layer (1: even;
  ``num_experts / top_k``: every token on the same experts), and ``moe/expert_load_max`` the worst layer's.
  Counted over the tokens the step trained on, padding included (a lockstep dummy micro-batch's are not).
- ``moe/route_mismatch`` (``rollout.routing_replay``): the share of replayed (token, MoE layer) routings where the
  router's own choice differs from the sampler's (``models.route_replay``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_opd.models import route_replay
from megatron_opd.models.forward_backward import in_lockstep_dummy

LOSS_NAMES = ("load_balancing_loss", "z_loss")
"""Megatron's tracker names of the router losses (``TopKRouter``)."""


def routers(chunks: list) -> list:
    """This rank's Megatron routers (``TopKRouter`` s), in layer order."""
    from megatron.core.transformer.moe.router import Router

    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, Router)]


def freeze_routers(chunks: list) -> int:
    """``train.freeze_router``: no gradient for any router parameter, so Megatron's DDP and optimizer leave them out
    (build before wrapping). Returns the number of parameters frozen on this rank."""
    params = [p for router in routers(chunks) for p in router.parameters(recurse=False)]
    for param in params:
        param.requires_grad_(False)
    return len(params)


class RouterMetrics:
    """Counts each router's routed tokens while :meth:`recording` and reduces them, with Megatron's router losses,
    into one metrics dict that every rank gets equal (one all-reduce over the world)."""

    def __init__(self, chunks: list) -> None:
        config = chunks[0].config
        self.num_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
        self.num_experts = config.num_moe_experts
        self.moe_layers = [i for i, on in enumerate(_moe_layer_pattern(config)) if on]
        enabled = {"load_balancing_loss": (config.moe_aux_loss_coeff or 0) > 0, "z_loss": bool(config.moe_z_loss_coeff)}
        self.loss_names = [name for name in LOSS_NAMES if enabled[name]]
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.chunks = chunks
        self._recording = False
        for router in routers(chunks):
            router.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        # Once per token: a fully recomputed layer's first forward runs without grad (as Megatron adds its losses).
        if self._recording and torch.is_grad_enabled() and not in_lockstep_dummy():
            routing_map = output[1]
            self.counts[router.layer_number - 1] += routing_map.sum(0).to("cpu", torch.float64)

    @contextlib.contextmanager
    def recording(self):
        """Count the routing of the forwards inside (one optimizer step's), from zero."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        self.counts.zero_()
        route_replay.take_counts(self.chunks)  # from zero
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def reduce(self, num_microbatches: int) -> dict[str, float]:
        """The step's router metrics (a collective: every rank calls it)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        losses = torch.zeros(len(LOSS_NAMES), self.num_layers, dtype=torch.float64)
        for i, name in enumerate(LOSS_NAMES):
            if name in tracker:
                entry = tracker[name]
                # Megatron sums a loss over its reduce group (each rank's share of the same tokens), then averages
                # over data-parallel ranks: the mean over the ranks of a stage, times that group's size.
                group_size = dist.get_world_size(entry["reduce_group"]) if entry.get("reduce_group") else 1
                losses[i] = entry["values"].detach().to("cpu", torch.float64) * group_size / num_microbatches
        ranks_per_stage = dist.get_world_size() / ps.get_pipeline_model_parallel_world_size()
        replayed = route_replay.take_counts(self.chunks)  # [mismatched, replayed] (token, layer) routings
        totals = torch.cat([losses.flatten() / ranks_per_stage, self.counts.flatten(), replayed])
        dist.all_reduce(totals)  # each stage fills its own layers; every rank ends with the same values
        losses, counts = totals[: losses.numel()].view_as(losses), totals[losses.numel() : -2].view_as(self.counts)
        mismatched, replayed = totals[-2:].tolist()
        out: dict[str, float] = {}
        for i, name in enumerate(LOSS_NAMES):
            if name in self.loss_names:
                out[f"moe/{name}"] = float(losses[i, self.moe_layers].mean())
        loads = {}
        for layer in self.moe_layers:
            if counts[layer].sum() > 0:
                loads[layer] = float(counts[layer].max() / counts[layer].mean())
                out[f"moe/expert_load/layer_{layer:02d}"] = loads[layer]
        if loads:
            out["moe/expert_load_max"] = max(loads.values())
        if replayed:  # rollout.routing_replay (the ratio holds where tensor-parallel ranks route the same tokens)
            out["moe/route_mismatch"] = mismatched / replayed
        return out


def _moe_layer_pattern(config) -> list[int]:
    """Megatron's ``moe_layer_freq`` as one 0/1 flag per layer (an int ``k``: every ``k``-th layer from the first)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return list(freq)
