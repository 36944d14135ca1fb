"""Read and write Hugging Face safetensors checkpoints one tensor at a time.

Teachers of 70B and more never fit in one process, so nothing here loads a whole checkpoint:
:class:`HFCheckpointReader` maps each tensor name to its shard through the index and reads a
tensor only when asked; :class:`HFCheckpointWriter` fills shards of bounded size and writes the
index at the end. Errors name the tensor and the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or disagrees with its config."""


def _check_safetensors_file(path: Path) -> None:
    """Validate header and size so a truncated or corrupted shard fails with a clear message, not a crash."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8 or header_len > 100_000_000:
            raise CheckpointError(
                f"{path} is corrupted or truncated: header length {header_len} exceeds file size {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path} is corrupted: its safetensors header is not valid JSON ({err})") from err
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"{path} is truncated: header describes {8 + header_len + end} bytes, file has {size}; re-download the shard"
        )


class HFCheckpointReader:
    """Lazy, tensor-by-tensor access to a (possibly sharded) safetensors checkpoint folder."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif (self.dir / SINGLE_FILE).is_file():
            with safe_open(self.dir / SINGLE_FILE, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {self.dir}: not a safetensors checkpoint")
        self.weight_map = weight_map
        self._checked: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> Path:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        return self.dir / self.weight_map[name]

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor; check its shape when ``expected_shape`` is given."""
        path = self.file_of(name)
        if not path.is_file():
            raise CheckpointError(f"shard {path.name} holding tensor {name!r} is missing from {self.dir}")
        if path.name not in self._checked:
            _check_safetensors_file(path)
            self._checked.add(path.name)
        with safe_open(path, framework="pt") as f:
            if name not in f.keys():
                raise CheckpointError(f"tensor {name!r} is listed in the index but absent from {path.name}")
            tensor = f.get_tensor(name)
        if expected_shape is not None and tuple(tensor.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, but config.json implies "
                f"{tuple(expected_shape)}; the checkpoint and its config disagree"
            )
        return tensor

    def nbytes(self, name: str) -> int:
        """Size in bytes of one tensor without reading its data."""
        with safe_open(self.file_of(name), framework="pt") as f:
            sl = f.get_slice(name)
            numel = 1
            for d in sl.get_shape():
                numel *= d
            return numel * _dtype_size(sl.get_dtype())


def _dtype_size(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}.get(
        dtype, 4
    )


class HFCheckpointWriter:
    """Write tensors into ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` each."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self._total_bytes += size

    def add_many(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards)
        save_file(self._pending, self.dir / f"shard-{index:05d}.tmp", metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Flush, give the shards their final names and write the index."""
        self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.dir / f"shard-{i:05d}.tmp", self.dir / final)
            weight_map.update(dict.fromkeys(names, final))
        if count > 1:
            with open(self.dir / INDEX_FILE, "w") as f:
                json.dump({"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}, f, indent=2)
