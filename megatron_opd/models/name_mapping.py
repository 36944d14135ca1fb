"""The one place that knows how Hugging Face weights become Megatron-Core weights and back.

A :class:`~megatron_opd.models.weight_rule.WeightRule` ties one Megatron parameter to the Hugging Face tensors it is made of, how
they are fused (QKV interleaved by key/value group, gate and up stacked), and how the fused tensor
is split across tensor-parallel ranks. The model loader, the checkpoint converter and the vLLM
weight sync all go through these rules, so there is one definition of every layout.

Conventions: "full" means the unsharded Megatron tensor (TP=1, vocabulary padded); layer indices in
rule names are *global* (``{layer}`` is filled with the index across all pipeline stages).

Legend for shapes: H hidden, F ffn hidden, D head dim, Nq query heads, Nkv key/value heads,
V vocabulary, Vp padded vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families import family_named
from megatron_opd.models.weight_rule import ExpertSplit, Split, WeightRule


def weight_rules(arch: ModelArchitecture) -> list[WeightRule]:
    """All rules for ``arch``, as its family declares them: embedding, per-layer rules (with ``{layer}``),
    final norm, output layer."""
    return family_named(arch.family).weight_rules(arch)


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters, then its buffers, by name: the tensors a weight rule may name."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
    for name, buffer in module.named_buffers():
        tensors.setdefault(name, buffer)
    return tensors


def expand_rules(
    arch: ModelArchitecture, layers: Sequence[int] | None = None
) -> Iterator[tuple[WeightRule, int | None]]:
    """(rule, global layer) for every parameter, in checkpoint order; ``layers`` limits the per-layer ones."""
    rules = weight_rules(arch)
    layer_ids = range(arch.num_layers) if layers is None else layers
    for rule in rules:
        if not rule.per_layer and rule.megatron.startswith("embedding"):
            yield rule, None
    for layer in layer_ids:
        for rule in rules:
            if rule.per_layer and (rule.layers is None or layer in rule.layers):
                for one in per_expert_rules(rule, arch):
                    yield one, layer
    for rule in rules:
        if not rule.per_layer and not rule.megatron.startswith("embedding"):
            yield rule, None


def per_expert_rules(rule: WeightRule, arch: ModelArchitecture) -> list[WeightRule]:
    """``rule`` itself, or for a per-expert rule one copy per expert with ``{expert}`` filled (global index)."""
    if rule.experts is ExpertSplit.NONE:
        return [rule]

    def fill(name: str | None, expert: int) -> str | None:
        return name.replace("{expert}", str(expert)) if name else name

    return [
        replace(rule, megatron=fill(rule.megatron, e), hf=tuple(fill(n, e) for n in rule.hf),
                te_megatron=fill(rule.te_megatron, e))
        for e in range(arch.moe.num_experts)
    ]  # fmt: skip


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """Local name -> global-expert name of every tensor of ``module`` inside a Megatron expert group
    (``...mlp.experts.local_experts.{i}.`` becomes ``...mlp.experts.local_experts.{global index}.``), from each MoE
    layer's own ``local_expert_indices``: at expert parallelism a rank holds experts ``r*E/EP ...``, numbered from
    0. Names outside experts are not in the map."""
    out = {}
    for prefix, sub in module.named_modules():
        indices = getattr(sub, "local_expert_indices", None)
        local_experts = getattr(getattr(sub, "experts", None), "local_experts", None)
        if indices is None or local_experts is None:
            continue
        for local, global_index in enumerate(indices):
            old = f"{prefix}.experts.local_experts.{local}."
            new = f"{prefix}.experts.local_experts.{global_index}."
            for name in named_tensors(local_experts[local]):
                out[old + name] = new + name
    return out


def hf_shapes(rule: WeightRule, arch: ModelArchitecture) -> tuple[tuple[int, ...], ...]:
    """Expected shape of each Hugging Face tensor of ``rule`` (for clear shape errors)."""
    if rule.hf_shape is not None:
        return rule.hf_shape
    h, d, nq, nkv, f, v = (
        arch.hidden_size,
        arch.head_dim,
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.ffn_hidden_size,
        arch.vocab_size,
    )
    name = rule.megatron
    if arch.moe is not None and ".mlp." in name:  # the MoE layers' widths
        if name.endswith("router.weight"):
            return ((arch.moe.num_experts, h),)
        if name.endswith("router.bias"):
            return ((arch.moe.num_experts,),)
        if name.endswith("gate_weight"):
            return ((1, h),)
        if ".shared_experts." in name:
            f = arch.moe.shared_expert_ffn_hidden_size
        elif ".experts." in name:
            f = arch.moe.expert_ffn_hidden_size
    if rule.split is Split.VOCAB:
        return ((v, h),)
    if rule.split is Split.QKV:
        q_rows = nq * d * (2 if arch.attention_output_gate else 1)
        shapes = tuple((rows,) if name.endswith("bias") else (rows, h) for rows in (q_rows, nkv * d, nkv * d))
        return shapes if len(rule.hf) == 3 else ((sum(s[0] for s in shapes), *shapes[0][1:]),)
    if rule.split is Split.GATE_UP_INTERLEAVED:
        if name.endswith("bias"):
            return ((2 * f,),)
        return ((h, 2 * f),) if rule.hf_transposed else ((2 * f, h),)
    if rule.split is Split.GATE_UP:
        return ((f, h), (f, h)) if len(rule.hf) == 2 else ((2 * f, h),)
    if name.endswith("linear_proj.weight"):
        return ((h, nq * d),)
    if name.endswith("linear_fc2.weight"):
        return ((f, h),) if rule.hf_transposed else ((h, f),)
    if name.endswith("softmax_offset"):
        return ((nq,),)
    if "q_layernorm" in name or "k_layernorm" in name:
        if rule.split is Split.COLUMN:  # one norm over all heads (OLMo-2), split with them
            return ((nq * d,),) if "q_layernorm" in name else ((nkv * d,),)
        return ((d,),)
    return ((h,),)


def hf_to_megatron(
    rule: WeightRule, tensors: Sequence[torch.Tensor], arch: ModelArchitecture, padded_vocab_size: int
) -> torch.Tensor:
    """Fuse the Hugging Face tensors of ``rule`` into the full Megatron tensor."""
    if rule.hf_transposed:
        tensors = [t.T if t.dim() == 2 else t for t in tensors]
    if rule.split is Split.GATE_UP_INTERLEAVED:  # rows gate 0, up 0, gate 1, ... -> [gate; up]
        (tensor,) = tensors
        return torch.cat([tensor[0::2], tensor[1::2]], dim=0)
    if rule.split is Split.QKV:
        nkv, d = arch.num_key_value_heads, arch.head_dim
        if len(tensors) == 1:  # one fused Hugging Face tensor (Phi-3's qkv_proj): all q rows, then k, then v
            q, k, v = torch.split(tensors[0], [arch.num_attention_heads * d, nkv * d, nkv * d], dim=0)
        else:
            q, k, v = tensors
        per_group = arch.num_attention_heads // nkv
        tail = q.shape[1:]  # (H,) for weights, () for biases
        if arch.attention_output_gate:  # q_proj holds each head's query then its gate: Megatron's group is q, g, k, v
            q, gate = q.reshape(nkv, per_group, 2, d, *tail).unbind(2)
            q = torch.cat([q.reshape(nkv, per_group * d, *tail), gate.reshape(nkv, per_group * d, *tail)], dim=1)
        else:
            q = q.reshape(nkv, per_group * d, *tail)
        k = k.reshape(nkv, d, *tail)
        v = v.reshape(nkv, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
    if rule.split is Split.GROUPED:
        grouped = []
        for tensor, parts in zip(tensors, rule.group_rows):
            groups = tensor.shape[0] // sum(parts)
            for part in torch.split(tensor, [groups * rows for rows in parts], dim=0):
                grouped.append(part.reshape(groups, -1, *tensor.shape[1:]))
        return torch.cat(grouped, dim=1).reshape(-1, *tensors[0].shape[1:])
    if rule.split is Split.GATE_UP:
        return torch.cat(list(tensors), dim=0)
    (tensor,) = tensors
    if rule.split is Split.VOCAB and padded_vocab_size > tensor.shape[0]:
        pad = tensor.new_zeros(padded_vocab_size - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, pad], dim=0)
    return tensor


def megatron_to_hf(rule: WeightRule, full: torch.Tensor, arch: ModelArchitecture) -> tuple[torch.Tensor, ...]:
    """Split a full Megatron tensor back into the Hugging Face tensors of ``rule`` (inverse of hf_to_megatron)."""
    if rule.hf_transposed:
        return tuple(t.T.contiguous() if t.dim() == 2 else t for t in _megatron_to_hf(rule, full, arch))
    return _megatron_to_hf(rule, full, arch)


def _megatron_to_hf(rule: WeightRule, full: torch.Tensor, arch: ModelArchitecture) -> tuple[torch.Tensor, ...]:
    if rule.split is Split.GATE_UP_INTERLEAVED:
        gate, up = torch.chunk(full, 2, dim=0)
        return (torch.stack([gate, up], dim=1).reshape(full.shape),)
    if rule.split is Split.QKV:
        nkv, d = arch.num_key_value_heads, arch.head_dim
        per_group = arch.num_attention_heads // nkv
        tail = full.shape[1:]
        gated = arch.attention_output_gate
        grouped = full.reshape(nkv, ((2 if gated else 1) * per_group + 2) * d, *tail)
        if gated:
            q, gate, k, v = torch.split(grouped, [per_group * d, per_group * d, d, d], dim=1)
            q = torch.stack([q.reshape(nkv, per_group, d, *tail), gate.reshape(nkv, per_group, d, *tail)], dim=2)
        else:
            q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
        q, k, v = (x.reshape(-1, *tail) for x in (q, k, v))
        return (q, k, v) if len(rule.hf) == 3 else (torch.cat([q, k, v]),)
    if rule.split is Split.GATE_UP:
        # Megatron's fc1 is [gate; up]: a fused Hugging Face gate_up_proj (Phi-3) is the same tensor.
        return torch.chunk(full, 2, dim=0) if len(rule.hf) == 2 else (full,)
    if rule.split is Split.VOCAB:
        return (full[: arch.vocab_size],)
    if rule.split is Split.GROUPED:
        tail = full.shape[1:]
        per_group = [sum(parts) for parts in rule.group_rows]
        groups = full.shape[0] // sum(per_group)
        pieces = torch.split(full.reshape(groups, -1, *tail), [r for parts in rule.group_rows for r in parts], dim=1)
        out, i = [], 0
        for parts in rule.group_rows:
            out.append(torch.cat([p.reshape(-1, *tail) for p in pieces[i : i + len(parts)]]))
            i += len(parts)
        return tuple(out)
    return (full,)


def shard(rule: WeightRule, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of a full Megatron tensor."""
    if rule.split is Split.REPLICATED or tp_size == 1:
        return full
    if rule.split is Split.ROW:
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    if rule.split in (Split.GATE_UP, Split.GATE_UP_INTERLEAVED):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]])
    # COLUMN, VOCAB, QKV (whole key/value groups per rank, since TP divides Nkv) and GROUPED split dim 0 evenly.
    return torch.chunk(full, tp_size, dim=0)[tp_rank]


def unshard(rule: WeightRule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reassemble the full Megatron tensor from every tensor-parallel rank's slice (inverse of shard)."""
    if rule.split is Split.REPLICATED or len(shards) == 1:
        return shards[0]
    if rule.split is Split.ROW:
        return torch.cat(list(shards), dim=1)
    if rule.split in (Split.GATE_UP, Split.GATE_UP_INTERLEAVED):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0)


def _shift_layer(name: str, delta: int) -> str:
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    index, rest = name[len(prefix) :].split(".", 1)
    return f"{prefix}{int(index) + delta}.{rest}"


def local_layer_name(name: str, layer_offset: int) -> str:
    """Rewrite a global ``decoder.layers.N.`` name to a chunk-local one (Megatron numbers layers per chunk)."""
    return _shift_layer(name, -layer_offset)


def global_layer_name(name: str, layer_offset: int) -> str:
    """Rewrite a chunk-local ``decoder.layers.N.`` name to the global one (inverse of local_layer_name)."""
    return _shift_layer(name, layer_offset)


def rules_by_megatron_name(arch: ModelArchitecture, te: bool = False) -> dict[str, WeightRule]:
    """Global Megatron parameter name -> its rule, for every parameter of ``arch``."""
    return {rule.megatron_name(layer, te=te): rule for rule, layer in expand_rules(arch)}
