"""LoRA adapters on Megatron-Core's tensor-parallel linear layers (``student.lora.*``).

Each targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` keeps its (frozen) weight and gains a child module
``lora`` holding ``A [r, in]`` and ``B [out, r]``; a forward hook adds ``(alpha / r) B A x`` to the layer's output.
The base layer's parameter names stay as they are, so loading, checkpoints and the weight sync see the same model.

Each TP rank holds its shard, so that the adapters equal one unsharded LoRA:

- column-parallel (``W`` split over output rows): ``A`` full and replicated, ``B`` split like ``W``'s rows; the
  rank-``r`` activation ``A x`` is the same on every rank, so its gradient is all-reduced over TP (as the layer's
  input gradient is).
- row-parallel (``W`` split over input columns): ``A`` split like ``W``'s columns, ``B`` full and replicated;
  ``A x`` is a partial sum, all-reduced over TP (reduce-scattered along the sequence under sequence parallelism)
  before ``B``, as the layer reduces its output.

Under sequence parallelism the replicated factor sees only its rank's tokens, so it is marked ``sequence_parallel``
and Megatron's ``finalize_model_grads`` all-reduces its gradient over TP, as for the norms. ``A`` starts as PEFT's
(Kaiming-uniform, drawn for the full matrix from a seed of the layer's global name, then sliced: the same at every TP
and PP size), ``B`` at zero: a new adapter leaves the model's output unchanged, bit for bit.

Other layouts need nothing of their own: under pipeline (and virtual pipeline) parallelism each chunk adapts its own
layers; context parallelism and packed sequences only change which tokens a rank's adapter sees, and DDP reduces the
adapters' gradients over the data- and context-parallel ranks as for any dense parameter; recomputed layers re-run the
adapter's hook (the frozen embedding's output is marked as needing a gradient, or full recompute would skip them). At
expert parallelism the routed experts stay frozen (``EXPERTS``): the adapters on attention and a shared expert are
dense parameters. The output layer takes no adapter, so the fused output loss forms no gradient for its frozen weight.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

__all__ = [
    "LORA_TARGETS",
    "LoRAAdapter",
    "LoRAConfig",
    "adapter_elements",
    "add_lora",
    "adapter_parameters",
    "check_lora_targets",
    "full_adapters",
    "merge_lora",
    "target_layers",
]

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron-Core's names of the linear layers that can take adapters: attention's fused query/key/value and its output
projection, the MLP's (fused gate/up) input and its output (a Mixture-of-Experts layer's shared expert included; its
routed experts are not adapted: see ``EXPERTS``)."""

EXPERTS = "experts"
"""The name that would adapt a Mixture-of-Experts layer's routed experts (per-expert adapters), refused for now: their
gradients would live in the expert-parallel buffers and their adapters would need the expert sharding in checkpoints
and exports. Routed experts stay frozen; the attention and a shared expert take adapters at any EP size."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the student (``student.lora.*``): the base weights frozen, only the adapters trained."""

    rank: int = 0
    """Rank ``r`` of each adapter (e.g. 8 to 128); 0: no adapters, the whole student trains."""
    alpha: float = 16.0
    """Scale of the adapter's output: ``W x + (alpha / rank) B A x``."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0: none; distillation compares log-probs, so 0 is usual)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Layers that get adapters, by Megatron-Core name: linear_qkv, linear_proj, linear_fc1, linear_fc2 (routed
    experts, ``experts``, are refused: they stay frozen)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"student.lora.rank must be an integer >= 0 (0: no adapters), got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ValueError(f"student.lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"student.lora.dropout must be a number in [0, 1), got {self.dropout!r}")
        if EXPERTS in self.target_modules:
            raise ValueError(
                "student.lora.target_modules: 'experts' (adapters on the routed experts) is not supported yet; the "
                f"routed experts stay frozen. Name only {list(LORA_TARGETS)} (linear_fc1/linear_fc2 adapt a "
                "Mixture-of-Experts layer's shared expert)"
            )
        unknown = [name for name in self.target_modules if name not in LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"student.lora.target_modules: unknown layer name(s) {unknown}; choose among {list(LORA_TARGETS)}"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"student.lora.target_modules lists a layer twice: {self.target_modules}")
        if self.enabled and not self.target_modules:
            raise ValueError(
                f"student.lora.rank={self.rank} but student.lora.target_modules is empty; name at least one of "
                f"{list(LORA_TARGETS)}, or set student.lora.rank=0 (no adapters)"
            )

    @property
    def enabled(self) -> bool:
        """Whether the student gets adapters."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on the adapter's output."""
        return self.alpha / self.rank


class LoRAAdapter(torch.nn.Module):
    """The two factors of one layer's adapter, this TP rank's shards, and the forward of ``(alpha/r) B A x``."""

    def __init__(self, layer, kind: str, config: LoRAConfig, name: str, seed: int = 0) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.kind, self.group = kind, layer.tp_group
        self.sequence_parallel = bool(layer.sequence_parallel)
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout > 0 else torch.nn.Identity()
        tp, rank, r = self.group.size(), self.group.rank(), config.rank
        out_local, in_local = layer.weight.shape
        full_in = in_local * tp if kind == "row" else in_local
        full_A = kaiming_uniform_A(r, full_in, _layer_seed(name, seed))
        dtype, device = layer.weight.dtype, layer.weight.device
        if kind == "column":  # A [r, in] replicated; B [out/tp, r] split like W's rows
            A, B = full_A, torch.zeros(out_local, r)
        else:  # A [r, in/tp] split like W's columns; B [out, r] replicated
            A, B = full_A[:, rank * in_local : (rank + 1) * in_local], torch.zeros(out_local, r)
        self.A = torch.nn.Parameter(A.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(B.to(device=device, dtype=dtype))
        # alpha/r, saved with the adapter (the converter's merged export reads it) and the one the forward uses
        self.register_buffer("scale_factor", torch.tensor(config.scale, dtype=torch.float32, device=device))
        sharded, replicated = (self.B, self.A) if kind == "column" else (self.A, self.B)
        set_tensor_model_parallel_attributes(sharded, True, 0 if kind == "column" else 1, 1)
        if self.sequence_parallel:  # its gradient covers this rank's tokens only: summed over TP by Megatron
            replicated.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        x = self.dropout(x)
        if self.kind == "column":
            h = torch.nn.functional.linear(x, self.A)  # [s(/tp), b, r]
            if self.sequence_parallel:  # all-gather along the sequence; backward: reduce-scatter (sums over TP)
                h = mappings.gather_from_sequence_parallel_region(h, group=self.group)
            else:  # identity; backward: all-reduce (every rank's B shard contributes to dh)
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.group)
        else:
            h = torch.nn.functional.linear(x, self.A)  # partial sums over this rank's input columns
            if self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.group)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.group)
        return torch.nn.functional.linear(h, self.B) * self.scale_factor

    def delta(self) -> torch.Tensor:
        """This rank's shard of ``(alpha/r) B A``, the shape of the layer's weight shard (row-parallel: ``B`` times
        this rank's columns of ``A``)."""
        return (self.B.float() @ self.A.float()) * self.scale_factor


def target_layers(arch) -> dict[str, tuple[int, ...]]:
    """The decoder layers holding each of ``LORA_TARGETS`` (routed experts aside), from the architecture alone:
    ``linear_qkv`` in softmax-attention layers (not multi-latent attention's), ``linear_proj`` in those and in
    multi-latent attention (not in Gated DeltaNet layers: their projections are ``in_proj`` / ``out_proj``),
    ``linear_fc1`` / ``linear_fc2`` in dense MLPs and in Mixture-of-Experts layers with a shared expert."""
    linear = set(arch.linear_attention.layers) if arch.linear_attention is not None else set()
    moe = set(arch.moe.layers) if arch.moe is not None else set()
    out: dict[str, list[int]] = {name: [] for name in LORA_TARGETS}
    for layer in range(arch.num_layers):
        if layer not in linear:
            out["linear_proj"].append(layer)
            if arch.mla is None:
                out["linear_qkv"].append(layer)
        if (arch.moe.shared_expert_ffn_hidden_size if layer in moe else arch.ffn_hidden_size) > 0:
            out["linear_fc1"].append(layer)
            out["linear_fc2"].append(layer)
    return {name: tuple(layers) for name, layers in out.items()}


def check_lora_targets(arch, config: LoRAConfig, stages: list[tuple[int, ...]] | None = None) -> None:
    """Refuse, from the architecture alone (so every rank refuses alike, before any model is built), a target that no
    layer of the model has and, given ``stages`` (each pipeline stage's layers: ``ParallelConfig.
    stage_layer_indices``), a stage that would hold no adapter at all (its optimizer would have nothing to train)."""
    if not config.enabled:
        return
    where = target_layers(arch)
    missing = [name for name in config.target_modules if not where[name]]
    if missing:
        raise ValueError(
            f"student.lora.target_modules names {missing}, which this model ({arch.family}) has none of (outside "
            f"routed experts); drop them from student.lora.target_modules (the model has "
            f"{[name for name in LORA_TARGETS if where[name]]})"
        )
    adapted = {layer for name in config.target_modules for layer in where[name]}
    for stage, layers in enumerate(stages or []):
        if not adapted.intersection(layers):
            others = sorted({name for name in LORA_TARGETS for layer in layers if layer in where[name]})
            raise ValueError(
                f"student.lora.target_modules={list(config.target_modules)}: pipeline stage {stage} (layers "
                f"{list(layers)}) has none of them, so it would train nothing; add one of {others} to "
                "student.lora.target_modules, or split the layers otherwise (parallel.num_layers_in_first_pipeline_stage"
                " / num_layers_in_last_pipeline_stage)"
            )


def adapter_elements(arch, config: LoRAConfig, tp: int, layers) -> int:
    """Adapter parameters one TP rank holds for ``layers`` (indices) of ``arch``, as :func:`add_lora` builds them:
    a column-parallel layer ``r*in + r*out/tp``, a row-parallel one ``r*in/tp + r*out`` (the memory check's count
    of what has gradients and optimizer state)."""
    if not config.enabled:
        return 0
    r, h, where = config.rank, arch.hidden_size, target_layers(arch)
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    total = 0
    for layer in layers:
        moe = arch.moe is not None and layer in arch.moe.layers
        ffn = arch.moe.shared_expert_ffn_hidden_size if moe else arch.ffn_hidden_size
        sizes = {  # Megatron's fc1 fuses gate and up
            "linear_qkv": ("column", h, q + 2 * kv), "linear_proj": ("row", q, h),
            "linear_fc1": ("column", h, 2 * ffn), "linear_fc2": ("row", ffn, h),
        }  # fmt: skip
        for name in config.target_modules:
            if layer not in where[name]:
                continue
            kind, fan_in, fan_out = sizes[name]
            total += r * fan_in + r * fan_out // tp if kind == "column" else r * fan_in // tp + r * fan_out
    return total


def kaiming_uniform_A(rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """PEFT's initialisation of ``A`` (``kaiming_uniform_(a=sqrt(5))``: uniform in +-1/sqrt(fan_in)), drawn on the
    CPU from ``seed`` for the whole matrix, so that every TP size slices the same one."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _layer_seed(name: str, seed: int) -> int:
    """A seed per layer, from its parameter name (which does not depend on the TP size)."""
    return (zlib.crc32(name.encode()) + 1_000_003 * seed) % 2**63


def _hook(module, args, output):
    out, bias = output
    return out + module.lora(args[0]), bias


def _embedding_output_requires_grad(module, args, output):
    """The frozen embedding's output marked as needing a gradient: Megatron's full recompute runs each block under
    ``no_grad`` and re-runs it in backward only when its input needs a gradient, so without this the adapters of the
    first stage's blocks would get none (PEFT's ``enable_input_require_grads`` for the same reason)."""
    return output.requires_grad_(True) if not output.requires_grad else output


def _sharded_state_dict(module, kind: str, gated: bool):
    """The layer's ``sharded_state_dict`` with its adapter's sharded factor declared split as it is (the layer's
    own declares every extra tensor replicated): ``B`` along rows after a column-parallel layer (a fused gate/up
    ``linear_fc1``'s as Megatron's MLP declares the weight: two halves), ``A`` along columns before a row-parallel
    one. dist_checkpointing can then resume the adapters at another TP size."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    layer_sharded_state_dict = module.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        out = layer_sharded_state_dict(prefix, sharded_offsets, metadata)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        tensors = {f"lora.{k}": v for k, v in module.lora.state_dict(prefix="", keep_vars=True).items()}
        axis = {"lora.B": 0} if kind == "column" else {"lora.A": 1}
        adapters = make_sharded_tensors_for_checkpoint(tensors, prefix, axis, sharded_offsets)
        if gated:
            key = f"{prefix}lora.B"
            adapters[key] = apply_swiglu_sharded_factory(adapters[key], sharded_offsets, singleton)
        return out | adapters

    return sharded_state_dict


def add_lora(chunks: list, config: LoRAConfig, seed: int = 0, arch=None) -> int:
    """Freeze every parameter of ``chunks`` and give each targeted layer an adapter; returns the number adapted (a
    pipeline stage may have none of some target's layers).

    Call after the weights are loaded. Raises ``ValueError`` naming the field where a targeted layer is not one of
    Megatron-Core's own column/row-parallel layers (a TransformerEngine layer fuses the norm into ``linear_qkv``)
    or, given the model's ``arch``, where a target matches no layer of the model (:func:`check_lora_targets`, the
    same on every rank; the trainer runs it before building the model)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not config.enabled:
        return 0
    if arch is not None:
        check_lora_targets(arch, config)
    from megatron_opd.models.loading import chunk_layer_range
    from megatron_opd.models.name_mapping import global_layer_name

    found = dict.fromkeys(config.target_modules, 0)
    for chunk in chunks:
        chunk.requires_grad_(False)
        if getattr(chunk, "embedding", None) is not None:  # the first pipeline stage
            chunk.embedding.register_forward_hook(_embedding_output_requires_grad)
        offset = chunk_layer_range(chunk).start  # pipeline stage / virtual chunk: seeds by the global layer name
        for name, module in chunk.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in found or getattr(module, "is_expert", False):
                continue
            if type(module) is ColumnParallelLinear:
                kind = "column"
            elif type(module) is RowParallelLinear:
                kind = "row"
            else:
                raise ValueError(
                    f"student.lora: layer {name} is a {type(module).__name__}, not Megatron-Core's ColumnParallelLinear"
                    " or RowParallelLinear, and cannot take an adapter; set build.use_transformer_engine=false (the "
                    "local layer spec) or drop it from student.lora.target_modules"
                )
            if config.dropout > 0 and module.tp_group.size() > 1:
                raise ValueError(
                    f"student.lora.dropout={config.dropout} at tensor_model_parallel_size > 1: the adapter's dropout "
                    "masks are not yet drawn alike on every TP rank; set student.lora.dropout=0"
                )
            module.lora = LoRAAdapter(module, kind, config, global_layer_name(name, offset), seed)
            module.register_forward_hook(_hook)
            gated = leaf == "linear_fc1" and module.config.gated_linear_unit
            module.sharded_state_dict = _sharded_state_dict(module, kind, gated)
            found[leaf] += 1
    return sum(found.values())


def adapter_parameters(chunks: list) -> dict[str, torch.nn.Parameter]:
    """Every adapter factor of ``chunks`` by name (``...linear_qkv.lora.A``), chunk index first for several chunks."""
    multi = len(chunks) > 1
    return {
        (f"{i}.{name}" if multi else name): p
        for i, chunk in enumerate(chunks)
        for name, p in chunk.named_parameters()
        if ".lora." in name
    }


@torch.no_grad()
def full_adapters(chunks: list, arch, group, of=None) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapter factors unsharded, by global Megatron name (``decoder.layers.N...lora.A``): a
    collective over the tensor-parallel ``group``. A sharded factor is reassembled as its layer's weight is (a fused
    gate/up ``linear_fc1``'s ``B`` holds each rank's gate rows, then its up rows). ``of``: instead of the factors,
    a tensor shaped like each (a function of the factor, e.g. its Adam moment)."""
    from megatron_opd.distributed.gather import gather_tp_shards
    from megatron_opd.models.loading import chunk_layer_range
    from megatron_opd.models.name_mapping import global_layer_name, rules_by_megatron_name, unshard

    rules = rules_by_megatron_name(arch)
    out = {}
    for chunk in chunks:
        offset = chunk_layer_range(chunk).start
        for local_name, param in chunk.named_parameters():
            if ".lora." not in local_name:
                continue
            name = global_layer_name(local_name, offset)
            local = (param if of is None else of(param)).detach()
            if getattr(param, "tensor_model_parallel", False):
                local = unshard(rules[name.split(".lora.")[0] + ".weight"], gather_tp_shards(local, group))
            out[name] = local.clone()
    return out


@torch.no_grad()
def merge_lora(chunks: list) -> int:
    """Fold each adapter into its layer's weight shard (``W += (alpha/r) B A``) and zero ``B`` (the model's output is
    then the merged one, the adapter adding nothing); returns the number merged."""
    merged = 0
    for chunk in chunks:
        for module in chunk.modules():
            lora = getattr(module, "lora", None)
            if isinstance(lora, LoRAAdapter):
                module.weight.add_(lora.delta().to(module.weight.dtype))
                lora.B.zero_()
                merged += 1
    return merged
