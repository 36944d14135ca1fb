"""What Megatron-Core writes into a ``dist_ckpt`` for one TP/PP/VP layout, found without allocating a weight.

The exact checkpoint keys, global shapes, chunk offsets and replica ids (layer-stacked keys, the
SwiGLU ``linear_fc1`` factory, TransformerEngine-style norm names, tied-embedding replicas,
``_extra_state`` objects) are Megatron's business, so they are not re-derived here: the model is
built on the ``meta`` device once per (tensor, pipeline) rank of the layout under a *fake* process
group of that world size, and its own ``sharded_state_dict()`` is read. Each chunk is then tied to
the :class:`~megatron_opd.models.name_mapping.WeightRule` (and global layer) whose full tensor it
slices, so the converter can produce its data lazily.

Legend: a "full" tensor is the TP=1 Megatron tensor (vocabulary padded to the layout's size); a
chunk's ``global_offset``/``local_shape`` index into it after dropping the prepended layer axis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_opd.checkpoint.workers import run_in_fresh_process
from megatron_opd.distributed.parallel import ParallelConfig
from megatron_opd.dtypes import parse_dtype
from megatron_opd.models.architecture import ModelArchitecture, RopeConfig
from megatron_opd.models.builder import (
    ModelBuildConfig,
    build_chunks,
    transformer_config,
    use_te_spec,
    validate_layout,
)
from megatron_opd.models.name_mapping import (
    WeightRule,
    expand_rules,
    global_expert_names,
    local_layer_name,
    per_expert_rules,
    weight_rules,
)


@dataclass(frozen=True)
class TensorChunk:
    """One main-replica ``ShardedTensor`` Megatron saves for the layout, and the weight it is cut from."""

    sharded: Any
    """Megatron ``ShardedTensor`` without data (key, global shape/offset, prepended axes, dtype)."""
    rule: WeightRule
    layer: int | None
    """Global layer index for per-layer rules, None for embedding / final norm / output layer."""

    @property
    def key(self) -> str:
        return self.sharded.key

    @property
    def global_offset(self) -> tuple[int, ...]:
        return tuple(self.sharded.global_offset)

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.sharded.local_shape:
            numel *= d
        return numel * torch.empty((), dtype=self.sharded.dtype).element_size()

    def full_shape(self) -> tuple[int, ...]:
        """Shape of the full tensor this chunk slices (the global shape without prepended axes)."""
        return tuple(self.sharded.global_shape[self.sharded.prepend_axis_num :])

    def slices(self) -> tuple[slice, ...]:
        """Where this chunk sits inside the full tensor."""
        sh = self.sharded
        offset = sh.global_offset[sh.prepend_axis_num :]
        return tuple(slice(o, o + n) for o, n in zip(offset, sh.local_shape))

    def with_meta_data(self):
        """The ``ShardedTensor`` holding a ``meta`` tensor: right shape and dtype, no memory."""
        sh = self.sharded
        return replace(sh, data=torch.empty(sh.local_shape, dtype=sh.dtype, device="meta"))

    @property
    def source(self) -> tuple[str, int | None]:
        """Identifies the full tensor: chunks with the same source are slices of one tensor."""
        return (self.rule.megatron, self.layer)


@dataclass
class CheckpointLayout:
    """Everything a converter needs to write a layout's ``dist_ckpt`` (no tensor data)."""

    parallel: ParallelConfig
    dtype: torch.dtype
    padded_vocab_size: int
    chunks: list[TensorChunk] = field(default_factory=list)
    """Main-replica tensor chunks of every rank, embedding first, then layer by layer."""
    objects: list[Any] = field(default_factory=list)
    """Main-replica ``ShardedObject``s (``_extra_state``), with their (small) data."""
    common_state: dict = field(default_factory=dict)
    """What Megatron would put in ``common.pt`` (the non-sharded part of rank 0's state dict)."""

    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A process group that only pretends to communicate: rank ``rank`` of ``world_size`` in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_chunks(arch: ModelArchitecture, parallel: ParallelConfig, build: ModelBuildConfig) -> list:
    """This (fake) rank's model chunks with every parameter on the ``meta`` device."""

    # RoPE frequencies are a non-persistent buffer (not in any checkpoint) and llama3 scaling cannot
    # be computed on meta tensors: build with plain RoPE.
    arch = replace(arch, rope=RopeConfig(theta=arch.rope.theta))
    config = transformer_config(arch, parallel, build)
    config.use_cpu_initialization = True  # never place parameters on an accelerator
    config.perform_initialization = False
    with torch.device("meta"):
        return build_chunks(arch, parallel, build, config)


def _flat_sharded(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat_sharded(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat_sharded(v)
    else:
        yield value


def _rank_layout(arch: ModelArchitecture, parallel: ParallelConfig, build: ModelBuildConfig, te: bool):
    """(chunks, objects, common state) of the current fake rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories, is_main_replica
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    from megatron_opd.models.loading import chunk_layer_range

    tensors: list[TensorChunk] = []
    objects: list[Any] = []
    common: dict = {}
    for model_chunk in _meta_chunks(arch, parallel, build):
        layers = chunk_layer_range(model_chunk)
        experts = global_expert_names(model_chunk)  # a rank's experts by their global index, as the rules
        by_name = {
            local_layer_name(rule.megatron_name(layer, te=te), layers.start): (rule, layer)
            for rule, layer in expand_rules(arch, layers)
        }
        state = model_chunk.sharded_state_dict()
        apply_factories(state)
        _, state = extract_nonpersistent(state)
        state, chunk_common = extract_sharded_base(state)
        common.update(chunk_common)
        for name, value in state.items():
            for sharded in _flat_sharded(value):
                if not is_main_replica(sharded.replica_id):
                    continue  # another rank saves it (TP-replicated norms, tied output layer)
                if isinstance(sharded, ShardedObject):
                    objects.append(sharded)
                    continue
                assert isinstance(sharded, ShardedTensor), type(sharded)
                name = experts.get(name, name)
                if name not in by_name:
                    raise RuntimeError(
                        f"Megatron parameter {name} (checkpoint key {sharded.key}) has no Hugging Face mapping in "
                        "megatron_opd.models.name_mapping; the model builder and the name mapping disagree"
                    )
                rule, layer = by_name[name]
                tensors.append(TensorChunk(sharded.without_data(), rule, layer))
    return tensors, objects, common


def _chunk_order(chunk: TensorChunk, rule_index: dict[str, int]) -> tuple:
    """Embedding, then layer by layer in rule order, then final norm and output layer (the HF file order)."""
    if chunk.layer is not None:
        group = 1
    else:
        group = 0 if chunk.rule.megatron.startswith("embedding") else 2
    return (group, chunk.layer or 0, rule_index[chunk.rule.megatron], chunk.global_offset)


def _enumerate(arch: ModelArchitecture, parallel: ParallelConfig, build: ModelBuildConfig) -> CheckpointLayout:
    from megatron.core import parallel_state

    from megatron_opd.distributed.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    te = use_te_spec(build)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    vp = parallel.virtual_pipeline_model_parallel_size
    world = tp * pp * max(ep * parallel.etp_size // tp, 1)  # the expert ranks come from data-parallel ones
    layout = CheckpointLayout(
        parallel=parallel,
        dtype=parse_dtype(build.dtype),
        padded_vocab_size=arch.padded_vocab_size(tp, build.make_vocab_size_divisible_by),
    )
    seen: set[tuple[str, tuple[int, ...]]] = set()
    # Megatron's default rank order is tp-cp-ep-dp-pp: with DP=CP=1, rank = pp_rank * TP + tp_rank. With expert
    # parallelism the dense layers' data-parallel replicas are main replicas on their first rank only.
    for rank in range(world):
        with fake_process_group(rank, world):
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
                create_gloo_process_groups=False,
            )
            try:
                tensors, objects, common = _rank_layout(arch, parallel, build, te)
            finally:
                parallel_state.destroy_model_parallel()
        if rank == 0:
            layout.common_state = common
        for chunk in tensors:
            ident = (chunk.key, chunk.global_offset)
            if ident in seen:
                raise RuntimeError(f"two ranks claim the main replica of {chunk.key} at offset {chunk.global_offset}")
            seen.add(ident)
            layout.chunks.append(chunk)
        layout.objects.extend(objects)
    rule_index = {one.megatron: i for i, rule in enumerate(weight_rules(arch)) for one in per_expert_rules(rule, arch)}
    layout.chunks.sort(key=lambda c: _chunk_order(c, rule_index))
    return layout


def checkpoint_layout(
    arch: ModelArchitecture, parallel: ParallelConfig, build: ModelBuildConfig | None = None
) -> CheckpointLayout:
    """The chunks, objects and common state Megatron saves for ``arch`` under ``parallel`` (DP=1).

    Only TP, PP (and its uneven stages), VP and, for Mixture-of-Experts models, EP and ETP shape a checkpoint
    (context and sequence parallelism do not). The local layer spec is always used: its checkpoint keys are the
    TransformerEngine spec's (Megatron maps the fused-norm names), and it builds on the ``meta`` device on any
    machine. Runs in this process when ``torch.distributed`` is not initialised yet (it briefly creates fake process
    groups and Megatron parallel state, and tears them down); otherwise in a spawned child so the caller's groups are
    left alone.
    """
    parallel = ParallelConfig(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        # MoE layers with TP need it to build; it does not shape a checkpoint.
        sequence_parallel=arch.moe is not None and parallel.tensor_model_parallel_size > 1,
    )
    build = replace(build or ModelBuildConfig(), use_transformer_engine=False)
    validate_layout(arch, parallel)
    if dist.is_initialized():
        return run_in_fresh_process(_enumerate, arch, parallel, build)
    return _enumerate(arch, parallel, build)
