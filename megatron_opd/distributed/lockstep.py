"""Keeping the ranks that exchange tokens in MoE layers in lockstep.

Every MoE layer's token exchange is a collective over the expert-parallel group (``tp_ep``: expert-tensor x expert
ranks), which Megatron-Core carves out of the data-parallel ranks. Data-parallel ranks hold different prompts, so
any loop whose forward count follows the data (a decode loop that stops when its own rows finish, micro-batches
filled to a token budget, evaluation shares) would leave one rank waiting in an exchange the others never join.
As Megatron's own inference does, the ranks agree on a count with one all-reduce MAX per loop
(:func:`agree_count`), and a rank with less work runs dummy forwards whose output it discards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def lockstep_group(chunks: list) -> dist.ProcessGroup | None:
    """The group whose ranks must run as many forwards of ``chunks`` as each other, or None where nothing needs it:
    a model without MoE layers, or experts whose token exchange stays within this rank's tensor-parallel group
    (whose ranks already see the same inputs)."""
    from megatron.core import parallel_state as ps

    config = getattr(chunks[0], "config", None)
    if not ps.model_parallel_is_initialized() or not getattr(config, "num_moe_experts", None):
        return None
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if ep == 1 and etp <= ps.get_tensor_model_parallel_world_size():
        return None
    return ps.get_expert_tensor_and_model_parallel_group()


def agree_count(count: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest ``count`` over ``group`` (default: the world), one all-reduce MAX and a sync point; ``count``
    itself without a process group."""
    if not dist.is_initialized():
        return count
    from megatron_opd.distributed.device import collective_device

    t = torch.tensor([count], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
