"""Read and write Hugging Face safetensors checkpoints one tensor at a time.

Teachers of 70B and more never fit in one process, so nothing here loads a whole checkpoint:
:class:`HFCheckpointReader` maps each tensor name to its shard through the index and reads a
tensor only when asked (dequantising an FP8 block-quantised one, :mod:`megatron_opd.models.fp8`);
:class:`HFCheckpointWriter` fills shards of bounded size and writes the index at the end. Errors
name the tensor and the file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_opd.dtypes import SAFETENSORS_DTYPES
from megatron_opd.model_files import CheckpointError
from megatron_opd.models.fp8 import (
    BLOCKS_SUFFIX,
    FP8_DTYPE,
    MXFP4,
    QUANTIZATION_CONFIG,
    SCALES_SUFFIX,
    BlockFP8,
    dequantize_block_fp8,
    dequantize_mxfp4,
    quantization_of,
    scale_name,
)
from megatron_opd.models.weight_rule import stacked_base, stacked_name

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_READ_BLOCK = 1 << 30


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file (byte offsets are absolute)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate a shard's header, so a truncated or corrupted shard fails with a clear message."""
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
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is corrupted: its safetensors header is not a JSON object")
    base = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path} is corrupted: header entry of tensor {name!r} is malformed ({err})") from err
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path.name} has unsupported safetensors dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * SAFETENSORS_DTYPES[dtype].itemsize or begin < 0:
            raise CheckpointError(
                f"{path} is corrupted: tensor {name!r} spans {end - begin} bytes but {dtype}{list(shape)} needs "
                f"{numel * SAFETENSORS_DTYPES[dtype].itemsize}"
            )
        entries[name] = TensorEntry(dtype, shape, base + begin, base + end)
    last = max((e.end for e in entries.values()), default=base)
    if last > size:
        raise CheckpointError(
            f"{path} is truncated: header describes {last} bytes, file has {size}; re-download the shard"
        )
    return entries


class HFCheckpointReader:
    """Lazy, tensor-by-tensor access to a (possibly sharded) safetensors checkpoint folder.

    Tensors are read with plain file reads at the offsets of the header, not through a memory map,
    so a read costs exactly the tensor's bytes of resident memory and nothing stays mapped. A tensor with a
    ``_scale_inv`` companion is dequantised as ``config.json``'s ``quantization_config`` says, to
    ``dequantize_dtype`` (the run's dtype); an unsupported ``quantization_config`` is refused here, before any read.
    """

    def __init__(self, hf_dir: str | os.PathLike, dequantize_dtype: torch.dtype = torch.float32) -> None:
        self.dir = Path(hf_dir)
        self.dequantize_dtype = dequantize_dtype
        self.config = _read_config(self.dir)
        self.quantization = quantization_of(self.config, str(self.dir / "config.json"))
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                with open(index) as f:
                    weight_map: dict[str, str] = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index} is not a valid safetensors index ({err})") from err
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map = dict.fromkeys(read_safetensors_header(self.dir / SINGLE_FILE), SINGLE_FILE)
        else:
            raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {self.dir}: not a safetensors checkpoint")
        from megatron_opd.models.wrappers import text_tensor_names

        # A multimodal wrapper (Qwen3.5) reads as its text tower; other folders keep their names.
        self._stored = text_tensor_names(self.config, list(weight_map), str(self.dir))
        self.weight_map = {name: weight_map[stored] for name, stored in self._stored.items()}
        self._headers: dict[str, dict[str, TensorEntry]] = {}

    def __contains__(self, name: str) -> bool:
        base = stacked_base(name)[0]
        return base in self.weight_map or base + BLOCKS_SUFFIX in self.weight_map

    def _mxfp4(self, name: str) -> bool:
        """Whether ``name`` is stored as an MXFP4 ``_blocks`` / ``_scales`` pair rather than as itself."""
        base = stacked_base(name)[0]
        return base not in self.weight_map and base + BLOCKS_SUFFIX in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> Path:
        name = stacked_base(name)[0]
        if name not in self.weight_map and name + BLOCKS_SUFFIX in self.weight_map:
            name += BLOCKS_SUFFIX
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        return self.dir / self.weight_map[name]

    def entry(self, name: str, expected_shape: tuple[int, ...] | None = None) -> TensorEntry:
        """Header facts of one tensor, without reading its data; checks its shape when given."""
        if self._mxfp4(name):  # its blocks' entry (the bytes read); the shape checked is the dequantised one
            base, index = stacked_base(name)
            blocks, scales = (base + suffix if index is None else stacked_name(base + suffix, index)
                              for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX))  # fmt: skip
            entry, _ = self.entry(blocks), self.entry(scales)
            shape = (*entry.shape[:-3], entry.shape[-2] * 32, entry.shape[-3]) if len(entry.shape) >= 3 else entry.shape
            if expected_shape is not None and tuple(shape) != tuple(expected_shape):
                raise CheckpointError(
                    f"tensor {name!r} (MXFP4 in {self.file_of(name).name}) dequantises to shape {tuple(shape)}, but "
                    f"config.json implies {tuple(expected_shape)}; the checkpoint and its config disagree"
                )
            return entry
        path = self.file_of(name)
        base, index = stacked_base(name)
        if path.name not in self._headers:
            if not path.is_file():
                raise CheckpointError(f"shard {path.name} holding tensor {base!r} is missing from {self.dir}")
            self._headers[path.name] = read_safetensors_header(path)
        entry = self._headers[path.name].get(self._stored.get(base, base))
        if entry is None:
            raise CheckpointError(f"tensor {base!r} is listed in the index but absent from {path.name}")
        if index is not None:  # one row of a tensor stacked over experts: a contiguous byte range of it
            if not entry.shape or index >= entry.shape[0]:
                raise CheckpointError(
                    f"tensor {base!r} in {path.name} has shape {tuple(entry.shape)}: no row {index} (one per "
                    "expert, config.json's expert count); the checkpoint and its config disagree"
                )
            row = (entry.end - entry.start) // entry.shape[0]
            entry = TensorEntry(
                entry.dtype, entry.shape[1:], entry.start + index * row, entry.start + (index + 1) * row
            )
        if expected_shape is not None and tuple(entry.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {path.name} has shape {tuple(entry.shape)}, but config.json implies "
                f"{tuple(expected_shape)}; the checkpoint and its config disagree"
            )
        return entry

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor (dequantised when the checkpoint holds its ``_scale_inv``); check its shape when
        ``expected_shape`` is given."""
        if self._mxfp4(name):
            return self._get_mxfp4(name, expected_shape)
        stored = self.get_stored(name, expected_shape)
        if scale_name(name) in self.weight_map:
            if self.quantization is None:
                raise CheckpointError(
                    f"tensor {name!r} has a {scale_name(name)!r} companion but {self.dir / 'config.json'} has no "
                    f"{QUANTIZATION_CONFIG} (its weight_block_size says how to apply it); restore the field from the "
                    "model's original config.json"
                )
            if not isinstance(self.quantization, BlockFP8):
                raise CheckpointError(
                    f"tensor {name!r} has a {scale_name(name)!r} companion (FP8 blocks) but "
                    f"{self.dir / 'config.json'} declares {QUANTIZATION_CONFIG} {self.quantization}"
                )
            scale_inv = self.get_stored(scale_name(name))
            return dequantize_block_fp8(stored, scale_inv, self.quantization.block_size, self.dequantize_dtype, name)
        if stored.dtype == FP8_DTYPE and self.quantization is not None:
            raise CheckpointError(
                f"tensor {name!r} in {self.file_of(name).name} is {FP8_DTYPE} without its {scale_name(name)!r} "
                "companion: the checkpoint is incomplete; re-download its shards"
            )
        return stored

    def _get_mxfp4(self, name: str, expected_shape: tuple[int, ...] | None) -> torch.Tensor:
        """One tensor (or one expert's row of it) from its MXFP4 ``_blocks`` / ``_scales`` pair."""
        if not isinstance(self.quantization, MXFP4):
            raise CheckpointError(
                f"tensor {name!r} is stored as {BLOCKS_SUFFIX} / {SCALES_SUFFIX} (MXFP4) but "
                f"{self.dir / 'config.json'} does not declare {QUANTIZATION_CONFIG} quant_method mxfp4; restore the "
                "field from the model's original config.json"
            )
        base, index = stacked_base(name)
        pair = [base + BLOCKS_SUFFIX, base + SCALES_SUFFIX]
        if index is not None:
            pair = [stacked_name(n, index) for n in pair]
        tensor = dequantize_mxfp4(self.get_stored(pair[0]), self.get_stored(pair[1]), self.dequantize_dtype, name)
        if expected_shape is not None and tuple(tensor.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} (MXFP4 in {self.file_of(name).name}) dequantises to shape {tuple(tensor.shape)}, "
                f"but config.json implies {tuple(expected_shape)}; the checkpoint and its config disagree"
            )
        return tensor

    def get_stored(self, name: str, expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor as stored (float8 stays float8)."""
        entry = self.entry(name, expected_shape)
        path = self.file_of(name)
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        buffer = torch.empty(entry.end - entry.start, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        read = 0
        with open(path, "rb", buffering=0) as f:
            f.seek(entry.start)
            while read < len(view):  # one read(2) returns at most ~2 GiB on Linux
                got = f.readinto(view[read : read + _READ_BLOCK])
                if not got:
                    break
                read += got
        if read != buffer.numel():
            raise CheckpointError(
                f"{path} is truncated: could not read tensor {name!r} ({read} of {buffer.numel()} bytes)"
            )
        return buffer.view(dtype).reshape(entry.shape)

    def nbytes(self, name: str) -> int:
        """Size in bytes of one tensor without reading its data."""
        entry = self.entry(name)
        return entry.end - entry.start


def _read_config(hf_dir: Path) -> dict:
    """``hf_dir/config.json`` as a dict ({} without one: a bare safetensors folder)."""
    path = hf_dir / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); copy it again from the model") from None
    return config if isinstance(config, dict) else {}


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
