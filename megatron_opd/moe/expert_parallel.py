"""Expert parallelism for the fused MoE layer: tokens sent to their experts' ranks with one host read, the split sizes.

Megatron-Core's all-to-all dispatcher permutes with ``masked_select`` (a device-to-host sync per call), copies three
count tensors to the host and reorders the received chunks on the host's lists. An all-to-all of variable sizes needs
its split sizes on the host, and nothing else does: here each rank sorts its ``T * K`` routed rows by global expert
(expert-parallel ranks own contiguous expert ids, so this is also by destination rank), exchanges the per-expert
counts on the device (an all-to-all of equal sizes), and copies the two split-size vectors to the host in one copy.
The received rows (source-major) are regrouped by local expert with a stable sort — Megatron's order: expert by
expert, source rank by source rank, tokens ascending — run through the grouped experts, and sent back the same way.

Legend: ``T`` tokens on this rank, ``K`` experts per token, ``R = T * K`` routed rows, ``E`` experts, ``L`` local
experts, ``P`` expert-parallel ranks, ``G`` rows received.
"""

from __future__ import annotations

import torch

from megatron_opd.moe.permutation import expert_ids, permutation


def expert_parallel_experts(
    hidden_TH: torch.Tensor, probs_TK: torch.Tensor, experts_TK: torch.Tensor, grouped_forward, group, num_local: int,
    shared_TH: torch.Tensor | None = None, gate_w_H: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[T, H]``: each token's expert outputs (times their probabilities, by ``grouped_forward(rows, offsets,
    probs)``) summed, with the experts spread over ``group``'s ranks, ``num_local`` on each, in rank order; plus the
    shared expert's output ``shared_TH`` (times its gate ``sigmoid(hidden . gate_w_H)`` where given), in the same
    combine."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    from megatron_opd.moe.ops import moe_combine, moe_permute

    ranks = group.size()
    experts = ranks * num_local
    order = permutation(experts_TK, 0, experts, experts)  # expert-major over every expert: by destination rank too
    slots_R, ends_E = order.slots_R, order.offsets_L
    sent_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    received_PL = torch.empty_like(sent_E)
    torch.distributed.all_to_all_single(received_PL, sent_E, group=group)  # equal splits: L counts per rank
    received_PL = received_PL.view(ranks, num_local)
    splits = torch.stack([sent_E.view(ranks, num_local).sum(1), received_PL.sum(1)]).cpu()  # the one host copy
    sent, received = splits.tolist()

    rows_RH, probs_R, inverse_TK = moe_permute(hidden_TH, probs_TK, slots_R, ends_E)  # every row is sent
    rows = all_to_all(group, rows_RH, received, sent)
    probs = all_to_all(group, probs_R, received, sent)
    local_G = torch.repeat_interleave(expert_ids(num_local, experts_TK.device).repeat(ranks), received_PL.reshape(-1),
                                      output_size=rows.shape[0])  # fmt: skip
    regroup_G = torch.sort(local_G, stable=True).indices  # by local expert, then source rank: Megatron's order
    offsets_L = torch.cumsum(received_PL.sum(0), 0).to(torch.int32)
    out = grouped_forward(rows.index_select(0, regroup_G), offsets_L, probs.index_select(0, regroup_G))
    out = torch.empty_like(out).index_copy(0, regroup_G, out)  # back to the received order
    out = all_to_all(group, out, sent, received)  # in the order sent: moe_permute's
    gate_x_TH = hidden_TH if gate_w_H is not None else None
    return moe_combine(out, inverse_TK, ends_E, shared_TH, gate_x_TH, gate_w_H)
