"""Megatron-Core ``dist_ckpt`` -> Hugging Face safetensors, one layer at a time.

Each step asks Megatron's own ``dist_checkpointing.load`` for the full (TP=1) tensors of one layer
(a partial sharded state dict: only that layer's slice of the layer-stacked keys), splits them into
Hugging Face tensors with the shared name mapping, un-pads the vocabulary and writes them straight to
their planned place in the safetensors shards. Memory holds one layer; any TP/PP/VP the checkpoint
was saved with is read the same way. Under ``torchrun`` ranks take contiguous runs of layers and
write into the same pre-sized shards; every load is a collective, so ranks step through the same
number of rounds.

Keys are not guessed: they come from the ``sharded_state_dict()`` of a TP=1 model built on the
``meta`` device, so a checkpoint saved by training loads here exactly as it would into the model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron_opd.checkpoint.atomic import check_destination, fsync_paths, make_staging_dir
from megatron_opd.checkpoint.hf_to_mcore import (
    ConversionResult,
    check_tokenizer_files,
    copy_hf_side_files,
)
from megatron_opd.checkpoint.layout import TensorChunk, checkpoint_layout
from megatron_opd.checkpoint.mcore_io import check_dist_checkpoint, load_dist_checkpoint
from megatron_opd.checkpoint.progress import Progress
from megatron_opd.checkpoint.safetensors_out import ShardPlan, plan_shards
from megatron_opd.checkpoint.workers import conversion_workers, split_contiguous
from megatron_opd.distributed.parallel import ParallelConfig
from megatron_opd.dtypes import TensorMeta, dtype_name, parse_dtype
from megatron_opd.model_files import HF_CONFIG_DIR, CheckpointError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.fp8 import without_quantization
from megatron_opd.models.hf_config import load_architecture
from megatron_opd.models.mtp import without_mtp
from megatron_opd.models.name_mapping import Split, WeightRule, hf_shapes, megatron_to_hf
from megatron_opd.models.wrappers import exported_config

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size="5GB"


@dataclass(frozen=True)
class WeightRead:
    """Where one full Megatron weight lives in the checkpoint."""

    rule: WeightRule
    layer: int | None
    key: str
    stack_index: int | None
    """Index along the prepended layer axis of a layer-stacked key; None for an unstacked key."""
    stack_size: int
    shape: tuple[int, ...]
    """Full tensor shape as stored (the vocabulary may be padded for another TP size)."""
    dtype: torch.dtype
    lora: tuple[WeightRead, ...] = ()
    """A LoRA student's adapter of this weight (``models/lora.py``): ``A``, ``B`` and ``alpha/r``, merged into it on
    export; empty for a weight without adapter."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def sharded_tensor(self):
        """A Megatron ``ShardedTensor`` asking for exactly this weight, with a buffer to receive it.

        A layer of a stacked key is requested as a ``[1, ...]`` slice of the ``[layers, ...]`` tensor
        rather than with a prepended axis: Megatron turns prepended-axis requests into torch
        ``ShardedTensor``s, which cannot describe a partial read in a one-process group.
        """
        from megatron.core.dist_checkpointing import ShardedTensor

        if self.stack_index is None:
            return ShardedTensor.from_rank_offsets(self.key, torch.empty(self.shape, dtype=self.dtype), replica_id=0)
        data = torch.empty((1, *self.shape), dtype=self.dtype)
        return ShardedTensor.from_rank_offsets(self.key, data, (0, self.stack_index, self.stack_size), replica_id=0)

    def unwrap(self, loaded: torch.Tensor) -> torch.Tensor:
        return loaded if self.stack_index is None else loaded[0]


def _hf_config_dir(ckpt: Path, hf_config_dir: str | os.PathLike | None) -> Path:
    cfg = Path(hf_config_dir) if hf_config_dir is not None else ckpt / HF_CONFIG_DIR
    if not (cfg / "config.json").is_file():
        raise CheckpointError(
            f"no config.json in {cfg}: this checkpoint was not made by hf-to-mcore; pass --hf-config-dir with the "
            "Hugging Face folder (config.json and tokenizer files) of the model it was trained from"
        )
    return cfg


def stored_tensors(ckpt: Path) -> dict:
    """The tensors a ``dist_ckpt`` holds: key -> DCP's ``TensorStorageMetadata`` (global size, dtype)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling a damaged file raises many types
        raise CheckpointError(f"{ckpt / '.metadata'} is corrupted or truncated ({type(err).__name__}: {err})") from err
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _weight_chunks(arch: ModelArchitecture) -> list[TensorChunk]:
    """One chunk per Megatron weight of a TP=1 checkpoint (the SwiGLU weight is two chunks of one key: the first)."""
    first: dict[tuple, TensorChunk] = {}
    for chunk in checkpoint_layout(arch, ParallelConfig()).chunks:
        first.setdefault(chunk.source, chunk)
    return list(first.values())


def plan_reads(ckpt: Path, arch: ModelArchitecture, adapters: Path | None = None) -> list[list[WeightRead]]:
    """The checkpoint's weights grouped by layer (embedding first, final norm and output layer last), each with its
    LoRA adapter where the checkpoint (or the adapter-only checkpoint ``adapters``) holds one."""
    stored = stored_tensors(ckpt)
    adapter_stored = stored if adapters is None else stored_tensors(adapters)
    groups: dict[object, list[WeightRead]] = {}
    for chunk in _weight_chunks(arch):
        sh = chunk.sharded
        if sh.key not in stored:
            raise CheckpointError(
                f"{ckpt} has no tensor {sh.key!r} (Megatron weight of {', '.join(chunk.rule.hf_names(chunk.layer))}); "
                "was it saved from a model with this config.json?"
            )
        md = stored[sh.key]
        prepend = sh.prepend_axis_num
        shape = tuple(md.size[prepend:])
        expected = chunk.full_shape()
        vocab_ok = chunk.rule.split is Split.VOCAB and shape[1:] == expected[1:] and shape[0] >= arch.vocab_size
        if (shape != expected and not vocab_ok) or tuple(md.size[:prepend]) != tuple(sh.global_shape[:prepend]):
            raise CheckpointError(
                f"checkpoint tensor {sh.key!r} has shape {tuple(md.size)}, but config.json implies "
                f"{(*sh.global_shape[:prepend], *expected)}; the checkpoint and its config disagree"
            )
        read = WeightRead(
            rule=chunk.rule,
            layer=chunk.layer,
            key=sh.key,
            stack_index=sh.global_offset[0] if prepend else None,
            stack_size=md.size[0] if prepend else 1,
            shape=shape,
            dtype=md.properties.dtype,
        )
        read = _with_adapter(read, adapter_stored)
        group = chunk.layer if chunk.layer is not None else ("embedding" if sh.key.startswith("embedding") else "final")
        groups.setdefault(group, []).append(read)
    return list(groups.values())


def plan_adapter_reads(adapters: Path, arch: ModelArchitecture) -> list[WeightRead]:
    """Every adapted weight of a checkpoint holding adapters (adapter-only or not), with its adapter's reads; the
    weight itself is not read (its shape and key are the layout's)."""
    stored = stored_tensors(adapters)
    reads = []
    for chunk in _weight_chunks(arch):
        sh = chunk.sharded
        prepend = sh.prepend_axis_num
        weight = WeightRead(
            rule=chunk.rule,
            layer=chunk.layer,
            key=sh.key,
            stack_index=sh.global_offset[0] if prepend else None,
            stack_size=sh.global_shape[0] if prepend else 1,
            shape=chunk.full_shape(),
            dtype=sh.dtype,
        )
        weight = _with_adapter(weight, stored)
        if weight.lora:
            reads.append(weight)
    if not reads:
        raise CheckpointError(f"{adapters} holds no LoRA adapters (no ...lora.A tensor of this model's layers)")
    return reads


def _with_adapter(weight: WeightRead, stored: dict) -> WeightRead:
    """``weight`` with the reads of its adapter's ``A``, ``B`` and ``alpha/r`` where ``stored`` holds one."""
    if not weight.key.endswith(".weight") or f"{weight.key[: -len('weight')]}lora.A" not in stored:
        return weight
    return replace(weight, lora=tuple(_adapter_read(weight, stored, part) for part in ("A", "B", "scale_factor")))


def _adapter_read(weight: WeightRead, stored: dict, part: str) -> WeightRead:
    """Where a factor of ``weight``'s adapter lives: stacked over the layers as the weight is."""
    key = f"{weight.key[: -len('weight')]}lora.{part}"
    md = stored[key]
    prepend = 0 if weight.stack_index is None else 1
    return replace(weight, key=key, shape=tuple(md.size[prepend:]), dtype=md.properties.dtype, lora=())


def plan_hf_tensors(reads: list[list[WeightRead]], arch: ModelArchitecture, dtype: torch.dtype | None) -> list:
    """The exported Hugging Face tensors, in file order."""
    planned = []
    for group in reads:
        for read in group:
            for name, shape in zip(read.rule.hf_names(read.layer), hf_shapes(read.rule, arch)):
                planned.append(TensorMeta(name, dtype or read.dtype, tuple(shape)))
    return planned


def _export_group(
    group: list[WeightRead],
    ckpt: Path,
    arch: ModelArchitecture,
    plan: ShardPlan,
    staging: Path,
    dtype: torch.dtype | None,
    progress: Progress | None,
    adapters: Path | None = None,
) -> tuple[int, int]:
    """Load one group's weights (a collective: every rank calls it, possibly with an empty group); their adapters
    from ``adapters`` where given (an adapter-only checkpoint on the base ``ckpt``)."""
    request = {f"w{i}": read.sharded_tensor() for i, read in enumerate(group)}
    lora = {f"w{i}.{j}": part.sharded_tensor() for i, read in enumerate(group) for j, part in enumerate(read.lora)}
    if adapters is None:
        loaded = load_dist_checkpoint(request | lora, ckpt, validate_access_integrity=False)
    else:
        loaded = load_dist_checkpoint(request, ckpt, validate_access_integrity=False)
        loaded |= load_dist_checkpoint(lora, adapters, validate_access_integrity=False)
    tensors = written = 0
    for i, read in enumerate(group):
        full = read.unwrap(loaded.pop(f"w{i}"))
        if read.lora:  # a LoRA student's merged weight: W + (alpha/r) B A
            A, B, scale = (part.unwrap(loaded.pop(f"w{i}.{j}")) for j, part in enumerate(read.lora))
            full = (full.double() + scale.double() * (B.double() @ A.double())).to(full.dtype)
        for name, tensor in zip(read.rule.hf_names(read.layer), megatron_to_hf(read.rule, full, arch)):
            size = plan.write(staging, name, tensor.to(dtype) if dtype is not None else tensor)
            written += size
            tensors += 1
            if progress is not None:
                progress.advance(size, 1)
        del full
    return tensors, written


def write_exported_config(cfg_dir: Path, staging: Path, dtype: torch.dtype) -> None:
    """``config.json`` as it was, with ``torch_dtype`` (and ``dtype``) naming the exported dtype, without
    ``quantization_config`` (an FP8 source was dequantised when it was loaded or converted) and with no
    multi-token-prediction layer (``num_nextn_predict_layers`` 0: they are never exported, ``models.mtp``), a
    multimodal wrapper's (Qwen3.5) as its text model's (``models.wrappers.exported_config``), completed
    with the fields vLLM reads that transformers' config class did not write (``ModelFamily.vllm_config_fields``)."""
    from megatron_opd.models.families import BY_MODEL_TYPE

    with open(cfg_dir / "config.json") as f:
        config = without_mtp(without_quantization(exported_config(json.load(f), str(cfg_dir))))
    family = BY_MODEL_TYPE.get(config.get("model_type"))
    if family is not None:
        config.update(family.vllm_config_fields(config))
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = dtype_name(dtype)
        for key in ("torch_dtype", "dtype"):
            if key in config and config[key] != name:
                config[key] = name
        if "torch_dtype" not in config and "dtype" not in config:
            config["torch_dtype"] = name
    with open(staging / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def convert_mcore_to_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config_dir: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
    progress: Progress | None = None,
    adapters: str | os.PathLike | None = None,
) -> ConversionResult:
    """Export the ``dist_ckpt`` in ``ckpt_dir`` as a Hugging Face folder ``out_dir``.

    ``config.json`` and tokenizer files come from ``hf_config_dir`` or the checkpoint's ``hf_config/``.
    ``dtype`` defaults to the checkpoint's. Call on every rank under ``torchrun``, or in one process.
    A LoRA student's adapters are merged into their weights: those the checkpoint holds, or those of the adapter-only
    checkpoint ``adapters`` (``ckpt_dir`` is then the base; a LoRA student's training checkpoint into its base:
    ``lora_export.to_hugging_face``).
    """
    start = time.perf_counter()
    ckpt = check_dist_checkpoint(ckpt_dir)
    adapters = Path(adapters) if adapters is not None else None
    cfg_dir = _hf_config_dir(ckpt, hf_config_dir)
    arch = load_architecture(cfg_dir)
    out_dtype = parse_dtype(dtype) if dtype is not None else None
    check_destination(out_dir, force, sources=(ckpt, cfg_dir, *([adapters] if adapters else [])))
    check_tokenizer_files(cfg_dir)
    reads = plan_reads(ckpt, arch, adapters)  # before joining ranks: it uses fake process groups
    plan = plan_shards(plan_hf_tensors(reads, arch, out_dtype), max_shard_bytes)
    exported_dtype = out_dtype or reads[0][0].dtype

    with conversion_workers() as workers:
        sizes = [sum(r.nbytes for r in group) for group in reads]
        shares = [split_contiguous(reads, sizes, workers.world_size, w) for w in range(workers.world_size)]
        mine = shares[workers.rank]
        rounds = max(len(s) for s in shares)
        staging = None
        if workers.is_first:
            staging = make_staging_dir(out_dir)
            plan.create_files(staging)
        staging = workers.broadcast(staging)
        tensors = written = 0
        if progress is not None:
            names = {n for group in mine for read in group for n in read.rule.hf_names(read.layer)}
            progress.start(sum(plan.planned[n].nbytes for n in names), len(names))
        ok = False
        try:
            for r in range(rounds):
                group = mine[r] if r < len(mine) else []
                error = None
                try:
                    t, b = _export_group(group, ckpt, arch, plan, staging, out_dtype, progress, adapters)
                    tensors, written = tensors + t, written + b
                except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows
                    error = err
                # A rank that failed must not leave the others waiting in the next round's collective load.
                if not workers.all_ok(error is None):
                    raise error or RuntimeError(f"export failed on another rank in round {r}")
            touched = {plan.file_of[n].name for group in mine for read in group for n in read.rule.hf_names(read.layer)}
            fsync_paths(staging / name for name in sorted(touched))  # rank 0 flushes the rest on commit
            if workers.is_first:
                plan.write_index(staging)
                copy_hf_side_files(cfg_dir, staging)
                write_exported_config(cfg_dir, staging, exported_dtype)
            ok = True
        finally:
            workers.finish_output(ok, staging, out_dir, force)
        seconds = time.perf_counter() - start
        logger.info("rank %d exported %d tensors, %.1f MB in %.1f s", workers.rank, tensors, written / 1e6, seconds)
        return ConversionResult(Path(out_dir).resolve(), tensors, written, seconds)
