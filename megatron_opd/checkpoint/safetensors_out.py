"""Safetensors shards whose layout is fixed before any tensor exists, so tensors are written as they come.

``HFCheckpointWriter`` buffers a whole shard (5 GB by default) before writing it. When the list of
tensors (names, dtypes, shapes) is known up front, as it is when exporting a Megatron checkpoint,
every shard's header and every tensor's byte offset can be computed first. Each file is then
created at its final size with its header, and each tensor is written to its offset the moment it
is produced, by whichever rank produced it: memory holds one tensor, and ranks never wait on each
other's shards.

A tensor stacked over experts (gpt-oss's ``mlp.experts.gate_up_proj`` ``[experts, ...]``) is planned as one tensor
from its rows (``name[i]``, ``models.weight_rule.stacked_name``), and each row is written to its slice as it comes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_opd.dtypes import TensorMeta, safetensors_code
from megatron_opd.models.hf_io import INDEX_FILE, SINGLE_FILE
from megatron_opd.models.weight_rule import stacked_base

_WRITE_BLOCK = 1 << 30  # one write(2) moves at most ~2 GiB on Linux


@dataclass
class ShardFile:
    """One safetensors file: its header bytes and where each of its tensors goes."""

    name: str
    tensors: list[TensorMeta] = field(default_factory=list)
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)
    """Absolute byte offset of each tensor's data in the file."""
    size: int = 0

    def seal(self) -> None:
        """Compute the header and the offsets once every tensor has been assigned."""
        entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
        position = 0
        for t in self.tensors:
            entries[t.name] = {
                "dtype": safetensors_code(t.dtype),
                "shape": list(t.shape),
                "data_offsets": [position, position + t.nbytes],
            }
            position += t.nbytes
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, as the safetensors library writes it
        self.header = len(header).to_bytes(8, "little") + header
        start = len(self.header)
        for t in self.tensors:
            self.offsets[t.name] = start
            start += t.nbytes
        self.size = start


@dataclass
class ShardPlan:
    """Which file and offset every tensor of the export goes to."""

    files: list[ShardFile]
    file_of: dict[str, ShardFile]
    planned: dict[str, TensorMeta]
    rows: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Row name (``name[i]``) -> the stacked tensor and index it is written into."""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for f in self.files for t in f.tensors)

    def create_files(self, out_dir: Path) -> None:
        """Write every header and size every file (its data is filled in by :meth:`write`)."""
        for shard in self.files:
            with open(out_dir / shard.name, "wb") as f:
                f.write(shard.header)
                f.truncate(shard.size)

    def write(self, out_dir: Path, name: str, tensor: torch.Tensor) -> int:
        """Write ``tensor`` to its planned place; returns the bytes written."""
        shard = self.file_of[name]
        planned = self.planned[name]
        if tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
            raise ValueError(
                f"{name}: planned {planned.dtype}{list(planned.shape)}, got {tensor.dtype}{list(tensor.shape)}"
            )
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        base, index = self.rows.get(name, (name, 0))
        fd = os.open(out_dir / shard.name, os.O_WRONLY)
        try:
            offset, done = shard.offsets[base] + index * planned.nbytes, 0
            while done < len(data):
                done += os.pwrite(fd, data[done : done + _WRITE_BLOCK], offset + done)
        finally:
            os.close(fd)
        return len(data)

    def write_index(self, out_dir: Path) -> None:
        """``model.safetensors.index.json`` when there is more than one file."""
        if len(self.files) == 1:
            return
        weight_map = {t.name: f.name for f in self.files for t in f.tensors}
        with open(out_dir / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)


def stack_rows(tensors: list[TensorMeta]) -> tuple[list[TensorMeta], dict[str, tuple[str, int]]]:
    """``tensors`` with the rows of each stacked tensor (``name[0]`` ... ``name[n-1]``, any order) replaced by one
    ``[n, ...]`` tensor where its first row was, and the row -> (tensor, index) map."""
    by_base: dict[str, list[TensorMeta]] = {}
    out: list[TensorMeta | str] = []
    rows: dict[str, tuple[str, int]] = {}
    for t in tensors:
        base, index = stacked_base(t.name)
        if index is None:
            out.append(t)
            continue
        if base not in by_base:
            by_base[base] = []
            out.append(base)
        by_base[base].append(t)
        rows[t.name] = (base, index)
    stacked = {}
    for base, metas in by_base.items():
        indices = sorted(rows[m.name][1] for m in metas)
        if indices != list(range(len(metas))) or len({(m.dtype, m.shape) for m in metas}) != 1:
            raise ValueError(f"{base}: rows {indices} of one dtype and shape are needed to stack it, got {metas}")
        stacked[base] = TensorMeta(base, metas[0].dtype, (len(metas), *metas[0].shape))
    return [stacked[t] if isinstance(t, str) else t for t in out], rows


def plan_shards(tensors: list[TensorMeta], max_shard_bytes: int) -> ShardPlan:
    """Fill files in order, starting a new one when the next tensor would pass ``max_shard_bytes``; the rows of a
    stacked tensor make one tensor (:func:`stack_rows`)."""
    rows_of = {t.name: t for t in tensors}
    tensors, rows = stack_rows(tensors)
    groups: list[list[TensorMeta]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    count = len(groups)
    files = []
    for i, group in enumerate(groups):
        name = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        shard = ShardFile(name, group)
        shard.seal()
        files.append(shard)
    file_of = {t.name: f for f in files for t in f.tensors}
    file_of.update({row: file_of[base] for row, (base, _) in rows.items()})
    planned = {t.name: t for t in tensors} | {row: rows_of[row] for row in rows}
    return ShardPlan(files, file_of, planned, rows)
