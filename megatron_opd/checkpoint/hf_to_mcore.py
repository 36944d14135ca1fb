"""Hugging Face safetensors -> Megatron-Core ``dist_ckpt`` (``torch_dist``), streamed one tensor at a time.

``dist_checkpointing.save`` wants every tensor of the model in memory at once. Instead, the chunks
Megatron would save for the target layout are described by :mod:`~megatron_opd.checkpoint.layout`
(``meta`` tensors: shapes, no data) and handed to PyTorch DCP with a planner whose ``resolve_data``
builds each chunk only when the writer asks for it: it reads the few Hugging Face tensors of one
Megatron weight, fuses and pads them, slices the chunk and drops the full tensor as soon as its last
chunk is written. Every weight goes to its own ``.distcp`` file, because DCP's file writer keeps a
reference to the tensors of the file it is writing. Peak memory is therefore about two full tensors
of the largest weight plus a fixed overhead, whatever the model size.

Under ``torchrun`` each rank writes a contiguous share of the weights into its own files; DCP's
coordinator merges the plans into one ``.metadata``, exactly as for a checkpoint saved in training.
The folder is completed with Megatron's ``common.pt`` and ``metadata.json``, the source
``config.json`` and tokenizer files under ``hf_config/``, and ``conversion.json``.

An FP8 block-quantised source (DeepSeek-V3/R1) is dequantised a tensor at a time to the output dtype, and its
``hf_config/config.json`` loses ``quantization_config``; multi-token-prediction layers are skipped with one log line.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_opd.checkpoint.atomic import check_destination, fsync_paths, make_staging_dir
from megatron_opd.checkpoint.layout import CheckpointLayout, TensorChunk, checkpoint_layout
from megatron_opd.checkpoint.progress import Progress
from megatron_opd.checkpoint.workers import Workers, conversion_workers, split_contiguous
from megatron_opd.distributed.parallel import ParallelConfig
from megatron_opd.dtypes import parse_dtype
from megatron_opd.model_files import HF_CONFIG_DIR, CheckpointError
from megatron_opd.models.architecture import ModelArchitecture, check_vocab_padding
from megatron_opd.models.builder import ModelBuildConfig
from megatron_opd.models.fp8 import QUANTIZATION_CONFIG, without_quantization
from megatron_opd.models.hf_config import load_architecture
from megatron_opd.models.hf_io import HFCheckpointReader
from megatron_opd.models.mtp import skipped_mtp_message
from megatron_opd.models.name_mapping import Split, expand_rules, hf_shapes, hf_to_megatron
from megatron_opd.tokenizer import TOKENIZER_JSON, needs_conversion, write_converted_tokenizer

logger = logging.getLogger(__name__)

CONVERSION_INFO = "conversion.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ConversionResult:
    """What one rank did."""

    out_dir: Path
    tensors: int
    """Chunks this rank wrote."""
    bytes: int
    """Bytes of tensor data this rank wrote."""
    seconds: float


def _hf_tensor_of(chunk: TensorChunk) -> str:
    return ", ".join(chunk.rule.hf_names(chunk.layer))


class HFChunkSource:
    """Builds chunk data from the Hugging Face checkpoint, holding a full tensor only while its chunks are pending."""

    def __init__(
        self,
        reader: HFCheckpointReader,
        arch: ModelArchitecture,
        chunks: list[TensorChunk],
        dtype: torch.dtype,
        progress: Progress | None = None,
    ) -> None:
        self.reader, self.arch, self.dtype, self.progress = reader, arch, dtype, progress
        self._by_index = {(c.key, c.global_offset): c for c in chunks}
        self._order = {c.source: i for i, c in reversed(list(enumerate(chunks)))}
        self._pending = Counter(c.source for c in chunks)
        self._cache: dict[tuple, torch.Tensor] = {}

    def chunk(self, key: str, offset: tuple[int, ...]) -> TensorChunk:
        return self._by_index[(key, tuple(offset))]

    def order(self, chunk: TensorChunk) -> int:
        """Position of the chunk's weight in checkpoint order (the order Hugging Face files store them)."""
        return self._order[chunk.source]

    def data(self, chunk: TensorChunk) -> torch.Tensor:
        """The chunk's tensor (a view of the full weight); the full weight is dropped after its last chunk."""
        full = self._cache.get(chunk.source)
        if full is None:
            full = self._cache[chunk.source] = self._full(chunk)
        out = full[chunk.slices()]
        self._pending[chunk.source] -= 1
        if self._pending[chunk.source] == 0:
            del self._cache[chunk.source]
        if self.progress is not None:
            self.progress.advance(chunk.nbytes, 1)
        return out

    def _full(self, chunk: TensorChunk) -> torch.Tensor:
        rule, layer = chunk.rule, chunk.layer
        names = rule.hf_names(layer)
        parts = [self.reader.get(n, s) for n, s in zip(names, hf_shapes(rule, self.arch))]
        padded = chunk.full_shape()[0] if rule.split is Split.VOCAB else self.arch.vocab_size
        full = hf_to_megatron(rule, parts, self.arch, padded).to(self.dtype)
        del parts
        if tuple(full.shape) != chunk.full_shape():
            raise CheckpointError(
                f"{_hf_tensor_of(chunk)} (in {self.reader.file_of(names[0]).name}) give a Megatron tensor of shape "
                f"{tuple(full.shape)} for {chunk.key}, but the model built from config.json expects {chunk.full_shape()}"
            )
        return full


def _streaming_planner(source: HFChunkSource):
    """A Megatron save planner whose tensors are produced by ``source`` at the moment they are written."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingSavePlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = source.chunk(write_item.index.fqn, write_item.index.offset)
            return source.data(chunk).reshape(write_item.tensor_data.chunk.sizes)

    return StreamingSavePlanner(flatten_state_dict=False)


def _file_per_weight_writer(path: Path, source: HFChunkSource):
    """DCP's file writer, with one file per weight (all its chunks) in checkpoint order.

    DCP keeps every tensor of the file being written alive until the file is closed, so one file per
    weight is what bounds memory; writing in checkpoint order reads the Hugging Face shards in order.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.distributed.checkpoint.planner import WriteItemType

    class FilePerWeightWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            if not hasattr(self, "_write_data"):  # private in torch's DCP writer; seen in torch 2.13
                logger.warning(
                    "torch %s has no FileSystemWriter._write_data: writing with DCP's default file layout "
                    "(correct, but peak memory grows to this rank's share of the model)",
                    torch.__version__,
                )
                return super().write_data(plan, planner)
            groups: dict[object, list] = {}
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    group: object = (-1, "objects")
                else:
                    chunk = source.chunk(item.index.fqn, item.index.offset)
                    group = (source.order(chunk), chunk.source)
                groups.setdefault(group, []).append(item)
            prefix = plan.storage_data.prefix
            files: queue.Queue = queue.Queue()
            for n, group in enumerate(sorted(groups, key=lambda g: g[0])):
                name = f"{prefix}{n}{DEFAULT_SUFFIX}"
                files.put((self.fs.concat_path(self.path, name), name, groups[group]))
            return self._write_data(planner, files)

    # thread_count=1 and no copy-ahead: DCP then resolves one tensor at a time, in our order. Files are
    # flushed once at the end (see _save) rather than one fsync per file, which stalls the pipeline.
    return FilePerWeightWriter(
        path, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0, sync_files=False
    )


def _pyt_state_dict(chunks: list[TensorChunk], objects: list) -> dict:
    """This rank's chunks and objects as the PyTorch DCP objects Megatron's torch_dist strategy saves."""
    from megatron.core.dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict

    grouped: dict[str, list] = {}
    for chunk in chunks:
        grouped.setdefault(chunk.key, []).append(chunk.with_meta_data())
    for obj in objects:
        grouped.setdefault(obj.unique_key, []).append(obj)
    return mcore_to_pyt_state_dict(grouped, is_loading=False)


def preflight(reader: HFCheckpointReader, arch: ModelArchitecture) -> int:
    """Check every tensor the conversion needs from the headers alone; return their total bytes.

    Raises ``CheckpointError`` naming the tensor and file (missing tensor or shard, truncated or
    corrupted shard, shape that disagrees with config.json) before any output is created.
    """
    total = 0
    for rule, layer in expand_rules(arch):
        for name, shape in zip(rule.hf_names(layer), hf_shapes(rule, arch)):
            entry = reader.entry(name, shape)
            total += entry.end - entry.start
    return total


def copy_hf_side_files(hf_dir: Path, dest: Path) -> list[str]:
    """Copy ``config.json``, tokenizer and generation files (everything but the weights) to ``dest``.

    A lone ``tokenizer.model`` gets a ``tokenizer.json`` beside it that reproduces sentencepiece / tiktoken, so
    transformers and vLLM tokenize the copy as the trainer does (see :mod:`megatron_opd.tokenizer`). The copied
    ``config.json`` has no ``quantization_config``: the weights beside it are dequantised.
    """
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(hf_dir.iterdir()):
        if not path.is_file() or path.name in _WEIGHT_INDEXES or path.suffix in _WEIGHT_SUFFIXES:
            continue
        shutil.copy2(path, dest / path.name)
        copied.append(path.name)
    if "config.json" in copied:
        drop_quantization_config(dest / "config.json")
    if needs_conversion(dest):
        write_converted_tokenizer(dest, dest)
        copied.append(TOKENIZER_JSON)
    return copied


def drop_quantization_config(config_path: Path) -> None:
    """Rewrite ``config_path`` without ``quantization_config`` if it has one (left byte for byte otherwise)."""
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if isinstance(config, dict) and QUANTIZATION_CONFIG in config:
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(without_quantization(config), f, indent=2)
            f.write("\n")


def check_tokenizer_files(hf_dir: Path) -> None:
    """Convert a lone ``tokenizer.model`` once before any weight is written, so a bad one fails in seconds."""
    if needs_conversion(hf_dir):
        with tempfile.TemporaryDirectory(prefix="megatron_opd_tokenizer_") as tmp:
            write_converted_tokenizer(hf_dir, tmp)


def _write_megatron_files(staging: Path, layout: CheckpointLayout) -> None:
    """``common.pt`` and ``metadata.json``, written exactly as ``dist_checkpointing.save`` writes them (0.16).

    Megatron-Core 0.17+ keeps the common state inside the torch_dist items instead and still reads ``common.pt``
    (its "legacy" format), so this folder loads with either."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    torch.save(layout.common_state, staging / COMMON_STATE_FNAME)
    save_config(CheckpointingConfig("torch_dist", 1), str(staging))


def convert_hf_to_mcore(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    parallel: ParallelConfig | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    make_vocab_size_divisible_by: int = 128,
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert the Hugging Face checkpoint in ``hf_dir`` to a ``dist_ckpt`` in ``out_dir`` for ``parallel``.

    ``dtype`` defaults to the checkpoint's ``torch_dtype``. Call it on every rank under ``torchrun``
    (each writes its share) or in one process. Raises ``UnsupportedArchitectureError``,
    ``CheckpointError`` or ``OutputExistsError`` before writing anything when the input is unusable
    or ``out_dir`` exists without ``force``; a failure later removes the partial output and leaves
    an existing ``out_dir`` untouched.
    """
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    parallel = parallel or ParallelConfig()
    arch = load_architecture(hf_dir)
    check_vocab_padding(parallel.tensor_model_parallel_size, make_vocab_size_divisible_by)
    build = ModelBuildConfig(
        dtype=parse_dtype(dtype or arch.torch_dtype), make_vocab_size_divisible_by=make_vocab_size_divisible_by
    )
    reader = HFCheckpointReader(hf_dir, dequantize_dtype=build.dtype)
    preflight(reader, arch)
    check_tokenizer_files(hf_dir)
    check_destination(out_dir, force, sources=(hf_dir,))
    layout = checkpoint_layout(arch, parallel, build)  # before joining ranks: it uses fake process groups

    with conversion_workers() as workers:
        sources = _group_by_source(layout.chunks)
        mine = split_contiguous(sources, [sum(c.nbytes for c in s) for s in sources], workers.world_size, workers.rank)
        chunks = [c for s in mine for c in s]
        objects = layout.objects if workers.is_first else []
        staging = workers.broadcast(make_staging_dir(out_dir) if workers.is_first else None)
        skipped = skipped_mtp_message(reader, arch.num_layers)
        if skipped and workers.is_first:
            logger.info(skipped)
        ok = False
        try:
            if progress is not None:
                progress.start(sum(c.nbytes for c in chunks), len(chunks))
            source = HFChunkSource(reader, arch, chunks, layout.dtype, progress)
            _save(_pyt_state_dict(chunks, objects), staging, source, workers)
            if workers.is_first:
                _write_megatron_files(staging, layout)
                copy_hf_side_files(hf_dir, staging / HF_CONFIG_DIR)
                _write_conversion_info(staging, arch, layout, hf_dir)
            ok = True
        finally:
            workers.finish_output(ok, staging, out_dir, force)
        written = sum(c.nbytes for c in chunks)
        seconds = time.perf_counter() - start
        logger.info("rank %d wrote %d tensors, %.1f MB in %.1f s", workers.rank, len(chunks), written / 1e6, seconds)
        return ConversionResult(Path(out_dir).resolve(), len(chunks), written, seconds)


def _group_by_source(chunks: list[TensorChunk]) -> list[list[TensorChunk]]:
    groups: dict[tuple, list[TensorChunk]] = {}
    for chunk in chunks:
        groups.setdefault(chunk.source, []).append(chunk)
    return list(groups.values())


def _save(state_dict: dict, staging: Path, source: HFChunkSource, workers: Workers) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(
            state_dict,
            storage_writer=_file_per_weight_writer(staging, source),
            planner=_streaming_planner(source),
            no_dist=workers.world_size == 1,
        )
    except CheckpointException as err:
        raise unwrap_dcp_failure(err, workers.rank) from None
    fsync_paths(staging.glob(f"__{workers.rank}_*"))  # this rank's files; rank 0 flushes the rest on commit


def unwrap_dcp_failure(err: BaseException, rank: int) -> BaseException:
    """DCP wraps every rank's exception in one ``CheckpointException``: give back this rank's own error
    (a ``CheckpointError`` naming the tensor, an ``OSError``...) or say which ranks failed."""
    failures = getattr(err, "failures", {})
    if rank in failures:
        return failures[rank][0]
    return RuntimeError(f"conversion failed on rank(s) {sorted(failures)}:\n{err}")


def _write_conversion_info(staging: Path, arch: ModelArchitecture, layout: CheckpointLayout, hf_dir: Path) -> None:
    parallel = layout.parallel
    info = {
        "source": str(hf_dir.resolve()),
        "family": arch.family,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "vocab_size": arch.vocab_size,
        "padded_vocab_size": layout.padded_vocab_size,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
        "architecture": arch.to_dict(),
    }
    with open(staging / CONVERSION_INFO, "w") as f:
        json.dump(info, f, indent=2)
