"""Load a ``dist_ckpt`` into this rank's model chunks, under whatever TP/PP/VP layout they were built for.

This is Megatron-Core's own resharding load (``dist_checkpointing.load`` of the chunks'
``sharded_state_dict()``); the layout the checkpoint was written with does not matter, and a
vocabulary padded for another tensor-parallel size is cut or zero-extended.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_opd.models.hf_io import CheckpointError


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


def load_model_checkpoint(chunks: list, ckpt_dir: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill ``chunks`` (this rank's model chunks) from the ``dist_ckpt`` in ``ckpt_dir``; a collective."""
    from megatron.core import dist_checkpointing

    path = check_dist_checkpoint(ckpt_dir)
    state = dist_checkpointing.load(chunks_sharded_state_dict(chunks), str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=strict)
