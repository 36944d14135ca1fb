"""The student's weights as vLLM sees them: Hugging Face-named full tensors rebuilt from TP/PP shards.

:class:`MegatronWeightSource` is a vLLM ``WeightSource`` (``metadata()`` + iteration in the same order) over this
rank's model chunks. Names and layouts come from :mod:`megatron_opd.models.name_mapping`, the mapping the model
loader and the checkpoint converter use: QKV and gate/up are split back into ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj``, the vocabulary padding is dropped.

Every trainer rank iterates the source in lockstep (each tensor is a collective among the ranks that hold it):

- only data-parallel replica 0 takes part, and of it context-parallel rank 0 (every CP rank holds the same weights);
  other ranks yield ``(name, None)`` without communicating;
- the pipeline stage that holds a tensor gathers its tensor-parallel shards onto its first TP rank
  (``dist.gather``, not an all-gather), which rebuilds the full tensor and splits it into Hugging Face tensors;
- a stage other than the first sends them to global rank 0 (the sender) point to point;
- a routed expert's tensors (Mixture-of-Experts students at expert parallelism) come from the expert-parallel rank
  that holds that expert (of expert-data-parallel replica 0): its expert-tensor-parallel shards are gathered onto
  its first expert-TP rank, which sends them to the sender unless it is the sender.

So the sender holds one tensor at a time (plus the transfer engine's bucket) and every other rank yields ``None``.
A LoRA student's adapted weights go merged: each TP rank adds its shard of ``(alpha/r) B A`` to its weight shard
before the gather, so vLLM serves ``W + (alpha/r) B A``. Its frozen base never changes, so once the engine holds one
complete sync the rollout sets :attr:`MegatronWeightSource.changed_only` and later syncs send only the tensors that
can change (:attr:`MegatronWeightSource.changing`): every tensor of a Megatron module that holds an adapter, a
trainable parameter or a buffer (a router's expert bias moves without the optimizer). Whole modules, because vLLM
loads a layer only once all of its tensors have arrived: a QKV bias or a router weight left out would leave its
fused layer (``qkv_proj``, ``gate``) half-loaded. A module not sent keeps its weights in vLLM.
Tensor order: embedding, layer 0 ... L-1 (in each, the mapping's rule order), final norm, output layer.

``MEGATRON_OPD_SYNC_SKIP=NAME[,NAME]`` (tests only, never set otherwise) leaves those Hugging Face tensors out of
every sync, as a sync that misses a tensor would: the checks that must catch a wrong sampler are tested with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.lora import LoRAAdapter
from megatron_opd.models.name_mapping import (
    ExpertSplit,
    WeightRule,
    expand_rules,
    global_expert_names,
    global_layer_name,
    hf_shapes,
    megatron_to_hf,
    named_tensors,
    unshard,
)
from megatron_opd.models.weight_rule import stacked_base

try:  # vLLM's classes when it is installed, so vLLM's own trainer engines (NCCL on GPU) accept the source
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
except ImportError:  # pragma: no cover - the source is also usable (and tested) without vLLM
    from abc import ABC as WeightSource  # type: ignore[assignment]
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ParamMeta:  # type: ignore[no-redef]
        name: str
        dtype: torch.dtype
        shape: tuple[int, ...]


SKIP_ENV = "MEGATRON_OPD_SYNC_SKIP"


def _skipped() -> frozenset[str]:
    return frozenset(n for n in os.environ.get(SKIP_ENV, "").split(",") if n)


def sync_name(name: str) -> str:
    """The name vLLM loads a tensor by: a row of a Hugging Face tensor stacked over experts (``...experts.
    gate_up_proj[3]``: gpt-oss, Gemma 4) goes as one expert's module weight, ``...experts.3.gate_up_proj.weight``, a
    row of a stacked bias as ``...experts.3.gate_up_proj_bias``; every other name as it is.

    vLLM's generic fused-MoE loader (Gemma 4's) matches a per-expert name by ``experts.3.gate_up_proj.`` with the
    trailing dot: ``experts.3.gate_up_proj`` alone matches nothing and leaves the experts as they were, silently
    (the tiny Gemma 4 MoE 0.28 nats off after a sync). gpt-oss's own loader maps ``.gate_up_proj.weight`` and
    ``.gate_up_proj`` alike (to its ``w13_weight``)."""
    base, index = stacked_base(name)
    if index is None:
        return name
    parent, _, leaf = base.rpartition(".")
    return f"{parent}.{index}.{leaf}" + ("" if leaf.endswith("_bias") else ".weight")


def sync_names(rule: WeightRule, layer: int | None) -> tuple[str, ...]:
    return tuple(sync_name(n) for n in rule.hf_names(layer))


def hf_metadata(arch: ModelArchitecture, dtype: torch.dtype, rules=None) -> list[ParamMeta]:
    """Every Hugging Face tensor of ``arch`` (of ``rules``, ``(rule, layer)`` pairs of :func:`expand_rules`, when
    given) in stream order (named as vLLM loads it: :func:`sync_name`), with its full shape, as ``dtype``."""
    return [
        ParamMeta(name, dtype, tuple(shape))
        for rule, layer in (expand_rules(arch) if rules is None else rules)
        for name, shape in zip(sync_names(rule, layer), hf_shapes(rule, arch))
    ]


def check_against(expected: list[ParamMeta], actual: list[ParamMeta], what: str) -> None:
    """Raise naming the first tensor whose name or shape differs between two tensor lists."""
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e.name != a.name or tuple(e.shape) != tuple(a.shape):
            raise ValueError(
                f"{what}: tensor {i} is {a.name!r} {tuple(a.shape)} but the student sends {e.name!r} "
                f"{tuple(e.shape)}; the rollout model and the student do not match"
            )
    if len(expected) != len(actual):
        longer, extra = (expected, "the student sends") if len(expected) > len(actual) else (actual, f"{what} has")
        name = longer[min(len(expected), len(actual))].name
        raise ValueError(
            f"{what}: {len(actual)} tensors, the student sends {len(expected)}; {extra} {name!r} beyond the other"
        )


class MegatronWeightSource(WeightSource):  # noqa: B024 - abstract only in the fallback base
    """This rank's view of the student as a stream of full Hugging Face tensors (see the module docstring)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        arch: ModelArchitecture,
        *,
        tp_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup,
        dp_rank: int,
        dtype: torch.dtype | None = None,
        etp_group: dist.ProcessGroup | None = None,
        expert_dp_rank: int = 0,
        cp_rank: int = 0,
    ) -> None:
        """``tp_group`` / ``pp_group``: Megatron's tensor- and pipeline-parallel groups of this rank; ``dtype``:
        wire dtype (default: the parameters'); ``etp_group`` / ``expert_dp_rank``: its expert-tensor-parallel group
        (default ``tp_group``) and expert-data-parallel rank, for a Mixture-of-Experts student; ``cp_rank``: its
        context-parallel rank (each CP rank of replica 0 would otherwise be a sender)."""
        from megatron_opd.models.loading import chunk_layer_range

        self.arch = arch
        self.tp_group, self.pp_group = tp_group, pp_group
        self.etp_group = etp_group if etp_group is not None else tp_group
        self.tp_rank, self.tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        self.etp_rank, self.etp_size = dist.get_rank(self.etp_group), dist.get_world_size(self.etp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.active = dp_rank == 0 and cp_rank == 0
        self.expert_active = expert_dp_rank == 0
        params: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, torch.nn.Module] = {}  # weight name -> its LoRA adapter (models.lora)
        for chunk in chunks:
            offset = chunk_layer_range(chunk).start
            experts = global_expert_names(chunk)  # this rank's experts by global index
            for local, param in named_tensors(chunk).items():  # buffers too: a rule may name one
                params[global_layer_name(experts.get(local, local), offset)] = param
            for local, module in chunk.named_modules():
                if isinstance(getattr(module, "lora", None), LoRAAdapter):
                    self.adapters[global_layer_name(f"{local}.weight", offset)] = module.lora
        self.changed_only = False
        """Send only :attr:`changing` (set by the rollout while the engine holds a complete sync; LoRA students)."""
        self.dtype = dtype or next(chunks[0].parameters()).dtype
        self.te = any(name.endswith("layer_norm_weight") for name in params)
        self.rules = list(expand_rules(arch))
        expert_rules = {
            r.megatron_name(layer, te=self.te) for r, layer in self.rules if r.experts is ExpertSplit.PER_EXPERT
        }
        self.params = {}
        for rule, layer in self.rules:
            name = rule.megatron_name(layer, te=self.te)
            if name in params:
                self.params[name] = params[name]
        # Which pipeline stage holds each tensor (one exchange of names within the pipeline group).
        held = [None] * dist.get_world_size(pp_group)
        dense = sorted(n for n in self.params if n not in expert_rules)
        dist.all_gather_object(held, dense, group=pp_group)
        self.owner = {name: stage for stage in range(len(held)) for name in held[stage]}
        # Which global rank sends each routed expert's tensors: the first expert-TP rank of replica 0 holding it.
        self.expert_owner: dict[str, int] = {}
        if expert_rules:  # the same on every rank: the architecture says
            mine = sorted(expert_rules & set(self.params)) if self.expert_active and self.etp_rank == 0 else []
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            self.expert_owner = {name: rank for rank, names in enumerate(every) for name in names}
        missing = [r.megatron_name(layer, te=self.te) for r, layer in self.rules]
        missing = [n for n in missing if n not in self.owner and n not in self.expert_owner]
        if missing:
            raise ValueError(f"no pipeline stage holds the student parameters {missing[:5]}")
        self._metadata = hf_metadata(arch, self.dtype)
        # What can change, agreed by every rank (one exchange of module names): see the module docstring.
        moving = sorted(
            _module(name)
            for name, tensor in self.params.items()
            if name in self.adapters or not isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad
        )
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (bool(self.adapters), moving))
        self.frozen_base = any(adapted for adapted, _ in every)
        """The student has adapters and a frozen base: after one complete sync, :attr:`changing` is enough."""
        modules = {m for _, names in every for m in names}
        moving_rules = [(r, layer) for r, layer in self.rules if _module(r.megatron_name(layer, te=self.te)) in modules]
        self.changing = frozenset(r.megatron_name(layer, te=self.te) for r, layer in moving_rules)
        """Megatron names of the tensors a partial sync sends (every tensor of a module that can change)."""
        self._changing_metadata = hf_metadata(arch, self.dtype, moving_rules)

    @property
    def is_sender(self) -> bool:
        """Global rank 0: the rank that holds every full tensor in turn."""
        return self.active and self.pp_rank == 0 and self.tp_rank == 0

    def metadata(self) -> list[ParamMeta]:
        skip = _skipped()
        return [m for m in (self._changing_metadata if self.changed_only else self._metadata) if m.name not in skip]

    def _full(self, rule: WeightRule, name: str) -> torch.Tensor | None:
        """The full Megatron tensor on the first rank of its tensor-parallel group (the expert-TP one for a routed
        expert's), a gather over that group, else None."""
        local = self.params[name].detach()
        if name in self.adapters:  # a LoRA student: this rank's shard of the merged weight
            local = (local.float() + self.adapters[name].delta()).to(local.dtype)
        group, rank, size = (
            (self.etp_group, self.etp_rank, self.etp_size) if name in self.expert_owner
            else (self.tp_group, self.tp_rank, self.tp_size)
        )  # fmt: skip
        if size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        dist.gather(local.contiguous(), parts, group_dst=0, group=group)
        return unshard(rule, parts) if parts is not None else None

    def _expert_tensors(self, rule: WeightRule, layer: int | None, name: str) -> Iterator[torch.Tensor | None]:
        """A routed expert's Hugging Face tensors: gathered by the replica-0 ranks holding it, sent by its owner."""
        owner, hf_names = self.expert_owner[name], rule.hf_names(layer)
        if self.expert_active and name in self.params:
            full = self._full(rule, name)
            if full is None:  # another expert-TP rank of the owner's group
                yield from (None for _ in hf_names)
                return
            for tensor in megatron_to_hf(rule, full, self.arch):
                tensor = tensor.to(self.dtype).contiguous()
                if owner != 0:  # the sender is global rank 0
                    dist.send(tensor, dst=0)
                    tensor = None
                yield tensor
        elif self.is_sender:
            for shape in hf_shapes(rule, self.arch):
                tensor = torch.empty(shape, dtype=self.dtype)
                dist.recv(tensor, src=owner)
                yield tensor
        else:
            yield from (None for _ in hf_names)

    def _stage_tensors(self, rule: WeightRule, layer: int | None, name: str) -> Iterator[torch.Tensor | None]:
        owner = self.owner[name]
        hf_names = rule.hf_names(layer)
        if self.pp_rank == owner:
            full = self._full(rule, name)
            if full is None:
                yield from (None for _ in hf_names)
                return
            for tensor in megatron_to_hf(rule, full, self.arch):
                tensor = tensor.to(self.dtype).contiguous()
                if owner != 0:  # a later stage's first TP rank hands the tensor to the sender
                    dist.send(tensor, group_dst=0, group=self.pp_group)
                    tensor = None
                yield tensor
        elif self.is_sender:
            for shape in hf_shapes(rule, self.arch):
                tensor = torch.empty(shape, dtype=self.dtype)
                dist.recv(tensor, group_src=owner, group=self.pp_group)
                yield tensor
        else:
            yield from (None for _ in hf_names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        skip = _skipped()
        for name, tensor in self._stream():
            if name not in skip:
                yield name, tensor

    def _stream(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for rule, layer in self.rules:
            name = rule.megatron_name(layer, te=self.te)
            if self.changed_only and name not in self.changing:
                continue  # the same on every rank: no collective is skipped by one rank alone
            hf_names = sync_names(rule, layer)
            if name in self.expert_owner:
                with torch.no_grad():
                    yield from zip(hf_names, self._expert_tensors(rule, layer, name))
                continue
            if not self.active or (self.tp_rank != 0 and self.pp_rank != self.owner[name]):
                yield from ((n, None) for n in hf_names)
                continue
            with torch.no_grad():
                yield from zip(hf_names, self._stage_tensors(rule, layer, name))


def _module(megatron_name: str) -> str:
    """The Megatron module that holds a tensor (``...self_attention.linear_qkv`` of ``....linear_qkv.bias``)."""
    return megatron_name.rpartition(".")[0]


def megatron_weight_source(chunks: list[torch.nn.Module], arch: ModelArchitecture, dtype: torch.dtype | None = None):
    """:class:`MegatronWeightSource` over Megatron-Core's groups of this rank (set-up code only)."""
    from megatron.core import parallel_state as ps

    return MegatronWeightSource(
        chunks,
        arch,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(),
        dtype=dtype,
        etp_group=ps.get_expert_tensor_parallel_group() if arch.moe is not None else None,
        expert_dp_rank=ps.get_expert_data_parallel_rank() if arch.moe is not None else 0,
        cp_rank=ps.get_context_parallel_rank(),
    )
