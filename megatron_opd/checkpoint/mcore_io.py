"""Load a ``dist_ckpt`` into this rank's model chunks, under whatever TP/PP/VP layout they were built for.

This is Megatron-Core's own resharding load (``dist_checkpointing.load`` of the chunks'
``sharded_state_dict()``); the layout the checkpoint was written with does not matter, and a
vocabulary padded for another tensor-parallel size is cut or zero-extended.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

from megatron_opd.models.hf_io import CheckpointError

_DAMAGED_HINT = "the checkpoint is incomplete or damaged (an interrupted save or copy?); save or copy it again"
# torch.save writes each stored item as a zip archive: a local-file header first, the end record in its last 22 bytes.
_ZIP_START, _ZIP_END, _ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22


def chunks_sharded_state_dict(chunks: list) -> dict:
    """The sharded state dict of all chunks, keyed like Megatron-LM (``model`` or ``model0``, ``model1``...)."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def check_dist_checkpoint(ckpt_dir: str | os.PathLike) -> Path:
    """Raise ``CheckpointError`` unless ``ckpt_dir`` is a complete torch_dist checkpoint."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder: point --ckpt at a Megatron dist_ckpt folder")
    for name in ("metadata.json", ".metadata"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a complete torch_dist checkpoint: {name} is missing")
    return path


def find_damaged_files(ckpt: Path) -> list[str]:
    """What is wrong with the data files ``ckpt/.metadata`` lists: missing, shorter than it says, or an item that
    does not start and end like the zip archive ``torch.save`` writes. Reads a few bytes per item: failure path only."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling a damaged file raises many types
        return [f"{ckpt / '.metadata'} is corrupted or truncated ({type(err).__name__}: {err})"]
    items: dict[str, list] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        if hasattr(info, "relative_path"):
            items.setdefault(info.relative_path, []).append(info)
    problems = []
    for name, infos in sorted(items.items()):
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size, end = path.stat().st_size, max(info.offset + info.length for info in infos)
        if size < end:
            problems.append(f"{path} is truncated ({size} bytes; .metadata places data up to byte {end})")
            continue
        with open(path, "rb") as f:
            for info in infos:
                if info.transform_descriptors or info.length < _ZIP_END_SIZE:
                    continue  # compressed or otherwise transformed items are not plain zip archives
                f.seek(info.offset)
                start = f.read(len(_ZIP_START))
                f.seek(info.offset + info.length - _ZIP_END_SIZE)
                if start != _ZIP_START or f.read(len(_ZIP_END)) != _ZIP_END:
                    problems.append(f"{path} is corrupted (bytes {info.offset}-{info.offset + info.length})")
                    break
    return problems


def _looks_like_damage(err: BaseException) -> bool:
    """Errors ``torch.load`` gives for a truncated or overwritten item of a ``.distcp`` file."""
    if isinstance(err, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)):
        return True
    text = str(err)
    return (isinstance(err, RuntimeError) and ("PytorchStreamReader" in text or "archive" in text)) or (
        isinstance(err, ValueError) and "seek" in text
    )


def _load_failure(ckpt: Path, err: BaseException) -> BaseException:
    """The error to raise for a failed load of ``ckpt``: a ``CheckpointError`` naming the damaged file (or the
    folder) when the checkpoint is damaged, else this rank's own error, and never DCP's ``CheckpointException``
    (a ``BaseException``, which slips past ``except Exception``)."""
    import torch.distributed as dist

    failures = getattr(err, "failures", None)  # CheckpointException: rank -> (exception, traceback)
    causes = [failure[0] for failure in failures.values()] if failures else [err]
    problems = find_damaged_files(ckpt)
    if problems:
        return CheckpointError(f"{'; '.join(problems)}: {_DAMAGED_HINT}")
    damage = next((cause for cause in causes if _looks_like_damage(cause)), None)
    if damage is not None:
        detail = (str(damage).splitlines() or [""])[0]
        return CheckpointError(
            f"{ckpt}: reading its .distcp files failed ({type(damage).__name__}: {detail}): {_DAMAGED_HINT}"
        )
    if not failures:
        return err
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank in failures:
        return failures[rank][0]
    return RuntimeError(f"loading {ckpt} failed on rank(s) {sorted(failures)}:\n{err}")


def load_dist_checkpoint(sharded_state_dict: dict, ckpt: str | os.PathLike, **kwargs) -> dict:
    """``dist_checkpointing.load`` that reports a truncated or corrupt ``.distcp`` as a ``CheckpointError`` naming
    it; DCP alone raises a bare ``EOFError`` or zip-reader error wrapped in its ``CheckpointException``.

    A collective: every rank sees the same failure, and the files are checked only after one."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = Path(ckpt)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt), **kwargs)
    except (Exception, CheckpointException) as err:
        failure = _load_failure(ckpt, err)
        if failure is err:
            raise
        raise failure from (err if isinstance(failure, CheckpointError) else None)


def load_model_checkpoint(chunks: list, ckpt_dir: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill ``chunks`` (this rank's model chunks) from the ``dist_ckpt`` in ``ckpt_dir``; a collective."""
    path = check_dist_checkpoint(ckpt_dir)
    state = load_dist_checkpoint(chunks_sharded_state_dict(chunks), path)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=strict)
