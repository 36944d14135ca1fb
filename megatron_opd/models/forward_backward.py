"""Run model chunks over micro-batches with Megatron-Core's pipeline schedules.

A thin layer over ``get_forward_backward_func`` so the trainer, the teacher and the tests share one
way of feeding micro-batches through any TP/PP/VP layout. The loss function sees the last stage's
vocab-sharded logits and its micro-batch; what it returns as data is collected on the last stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_opd.distributed.lockstep import agree_count, lockstep_group
from megatron_opd.models import route_replay
from megatron_opd.models.context_parallel import SPLIT_MARKER

MicroBatch = dict[str, torch.Tensor]
# loss_fn(logits_BSV, micro_batch) -> (scalar loss, data to collect)
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, Any]]


def forward_backward(
    chunks: list,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
) -> list[Any]:
    """Forward (and backward unless ``forward_only``) every micro-batch through ``chunks``.

    Each micro-batch holds ``tokens`` ``[b, s]`` and optionally ``position_ids``; a packed one (THD) is ``[1, t]``
    with ``cu_seqlens`` and ``max_seqlen`` (``TrainBatch.packed_micro_batches``). With pipeline
    parallelism all must have the same shape (stages exchange activations of one shape); without it,
    ``s`` may differ between micro-batches, so each is padded only to its own longest sequence. Returns the data ``loss_fn`` returned, one entry per micro-batch, on the last
    pipeline stage (an empty list elsewhere). Gradients accumulate into ``param.grad`` (or DDP's
    ``main_grad``); the loss of each micro-batch is divided by the number of micro-batches.

    Where MoE layers exchange tokens with other data-parallel ranks (``distributed.lockstep``), every rank runs as
    many micro-batches as the busiest: the others repeat their first micro-batch with a zero loss and discard it
    (its backward still joins the exchanges), and scale their real losses so the division stays by their own count.
    Megatron's router losses (``build.moe_aux_loss_coeff``, ``moe_z_loss_coeff``) are scaled alike: none for a
    dummy, and a real micro-batch's compensated as its loss is (:func:`router_losses_scaled`); a dummy's tokens are
    not counted in the expert loads that drive the expert-bias update either (:func:`expert_loads_kept`).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    group = lockstep_group(chunks)
    if not micro_batches:
        if group is None:
            raise ValueError("micro_batches is empty")
        # Nothing of its own: only the dummies that keep the MoE layers' token exchange in step.
        tp = parallel_state.get_tensor_model_parallel_world_size()
        micro_batches = [{"tokens": torch.zeros((1, 8 * tp), dtype=torch.int64), _DUMMY_KEY: True}]
    batch_size, seq_len = micro_batches[0]["tokens"].shape
    one_stage = parallel_state.get_pipeline_model_parallel_world_size() == 1
    for i, mb in enumerate(micro_batches):
        if one_stage:
            continue
        if tuple(mb["tokens"].shape) != (batch_size, seq_len):
            raise ValueError(
                f"micro_batches[{i}]['tokens'] has shape {tuple(mb['tokens'].shape)}, expected {(batch_size, seq_len)}"
            )

    # Checked on every rank before any communication, so that all of them refuse together.
    if parallel_state.get_context_parallel_world_size() > 1 and any(SPLIT_MARKER not in mb for mb in micro_batches):
        raise ValueError(
            "context parallelism: the micro-batch is not split over context-parallel ranks "
            "(trainer.loss_batch.split_for_context_parallel); each rank would attend with the whole sequence"
        )

    real = sum(not mb.get(_DUMMY_KEY) for mb in micro_batches)
    total = agree_count(len(micro_batches), group) if group is not None else real
    if len(chunks) > 1:  # Megatron's interleaved schedule needs at least PP micro-batches: the others run as dummies
        total = max(total, parallel_state.get_pipeline_model_parallel_world_size())
    micro_batches = [*micro_batches, *[{**micro_batches[0], _DUMMY_KEY: True}] * (total - len(micro_batches))]
    # The schedule divides each loss by `total`; a real one is scaled back to a division by `real`.
    compensate = total / real if real and total != real and not forward_only else None

    def forward_step(data_iterator, model):
        device = next(model.parameters()).device
        # Tensors go to the device; plain values (the index of the teacher whose objective applies) stay as they are.
        batch = {
            k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in next(data_iterator).items()
        }
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        dummy = bool(batch.get(_DUMMY_KEY))
        route_replay.feed(model, batch.get("routes"), count=not dummy)  # rollout.routing_replay: the sampler's experts
        with router_losses_scaled(model.config, 0.0 if dummy else compensate or 1.0), expert_loads_kept(model, dummy):
            output = model(tokens, position_ids, None, **packed_seq_params(batch))

        def reduce(output_tensor: torch.Tensor):
            if batch.get(_DUMMY_KEY):  # a lockstep dummy: zero gradients through the same exchanges
                return output_tensor.sum() * 0.0, _DUMMY
            loss, data = loss_fn(output_tensor, batch)
            return (loss if compensate is None else loss * compensate), data

        return output, reduce

    # With virtual pipelining every chunk pulls micro-batches from its own iterator.
    iterators: Any = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    schedule = get_forward_backward_func()
    route_replay.reset(chunks)
    try:
        outputs = schedule(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            # Megatron's schedules take the whole sequence's length and divide it by the CP size themselves.
            seq_length=seq_len * parallel_state.get_context_parallel_world_size(),
            micro_batch_size=batch_size,
            forward_only=forward_only,
        )
    finally:
        route_replay.reset(chunks)  # a later forward (the built-in sampler's) routes on its own
    return [o for o in outputs if o is not _DUMMY]


@contextlib.contextmanager
def router_losses_scaled(config, factor: float):
    """Megatron's MoE router losses, in the forward inside, scaled by ``factor``. Megatron reads the coefficients
    from the shared config at each router forward and scales each micro-batch's loss gradient by one over the
    schedule's micro-batch count, so a lockstep dummy gets 0 (and its routing is not counted:
    :func:`in_lockstep_dummy`) and a real micro-batch of a rank with dummies ``total / real``, as its loss does. A
    layer recomputed in the backward (``build.recompute_granularity=full``) forms its losses outside this scope, which
    the trainer refuses at expert parallelism."""
    global _IN_DUMMY
    aux, z = getattr(config, "moe_aux_loss_coeff", 0.0), getattr(config, "moe_z_loss_coeff", None)
    if factor == 1.0:
        yield
        return
    _IN_DUMMY = factor == 0.0
    if isinstance(aux, (int, float)):
        config.moe_aux_loss_coeff = aux * factor
    config.moe_z_loss_coeff = z * factor if z and factor else None  # 0 would divide by zero in Megatron's tracker
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff, _IN_DUMMY = aux, z, False


@contextlib.contextmanager
def expert_loads_kept(model, keep: bool = True):
    """With ``keep``, the routers' per-expert token counts of ``model`` as they were before the forward inside.
    Megatron's routers add every training forward's routed tokens to ``local_tokens_per_expert``, which the
    auxiliary-loss-free expert-bias update (``build.moe_router_bias_update_rate``) all-reduces after the step; a
    lockstep dummy's tokens do not exist, so a rank with fewer micro-batches would add load no other layout sees.
    A layer recomputed in the backward (``build.recompute_granularity=full``) counts there, outside this scope,
    which the trainer refuses at expert parallelism."""
    counts = (
        [c for m in model.modules() if (c := getattr(m, "local_tokens_per_expert", None)) is not None] if keep else []
    )
    saved = [c.clone() for c in counts]
    try:
        yield
    finally:
        for count, before in zip(counts, saved):
            count.copy_(before)


def in_lockstep_dummy() -> bool:
    """Whether the forward running now is a lockstep dummy's (its routing is not the data's: metrics skip it)."""
    return _IN_DUMMY


_IN_DUMMY = False
_DUMMY_KEY = "lockstep_dummy"
_DUMMY = object()
"""What a lockstep dummy micro-batch's loss returns as data (dropped from the results)."""


def packed_seq_params(batch: MicroBatch) -> dict:
    """``{"packed_seq_params": ...}`` for a packed micro-batch (Megatron's THD contract), else ``{}``."""
    if "cu_seqlens" not in batch:
        return {}
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, longest = batch["cu_seqlens"].to(torch.int32), int(batch["max_seqlen"])
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return {"packed_seq_params": params}
