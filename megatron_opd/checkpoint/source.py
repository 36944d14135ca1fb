"""Where a model's weights come from: a Hugging Face folder or a ``dist_ckpt`` written by ``tools/checkpoint``.

Users point ``student.path`` / ``teacher.path`` at either; this module detects which and loads it into this
rank's chunks under any TP/PP/VP layout (Hugging Face tensors are sliced per rank, a ``dist_ckpt`` goes
through Megatron's resharding load). The ``config.json`` (and tokenizer files) of a ``dist_ckpt`` live in its
``hf_config/`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch

from megatron_opd.model_files import HF_CONFIG_DIR, CheckpointError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.hf_config import load_architecture


def model_format(path: str | os.PathLike, field: str = "path") -> Literal["hf", "dist_ckpt"]:
    """``"dist_ckpt"`` for a Megatron checkpoint folder, ``"hf"`` for a Hugging Face one; a clear error otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{field}={str(path)!r} is not a folder: give a Hugging Face or dist_ckpt model folder")
    if (folder / "metadata.json").is_file():
        return "dist_ckpt"
    if (folder / "config.json").is_file():
        return "hf"
    raise CheckpointError(
        f"{field}={str(path)!r} holds neither config.json (Hugging Face) nor metadata.json (dist_ckpt from "
        "tools/checkpoint/convert.py hf-to-mcore)"
    )


def config_dir(path: str | os.PathLike, field: str = "path") -> Path:
    """The folder with ``config.json`` (and normally the tokenizer files) of the model at ``path``."""
    folder = Path(path)
    if model_format(folder, field) == "hf":
        return folder
    cfg = folder / HF_CONFIG_DIR
    if not (cfg / "config.json").is_file():
        raise CheckpointError(
            f"{field}={str(path)!r} is a dist_ckpt without {HF_CONFIG_DIR}/config.json; convert it with "
            "tools/checkpoint/convert.py, which writes the Hugging Face config beside the weights"
        )
    return cfg


def model_architecture(path: str | os.PathLike, field: str = "path") -> ModelArchitecture:
    """The architecture of the model at ``path`` (either format)."""
    return load_architecture(config_dir(path, field))


def load_weights(
    chunks: list,
    arch: ModelArchitecture,
    path: str | os.PathLike,
    *,
    tp_rank: int,
    tp_size: int,
    expert_tp_rank: int | None = None,
    expert_tp_size: int | None = None,
) -> None:
    """Fill this rank's ``chunks`` from the model at ``path`` (a collective for a dist_ckpt)."""
    if model_format(path) == "dist_ckpt":
        from megatron_opd.checkpoint.mcore_io import load_model_checkpoint

        load_model_checkpoint(chunks, path)
    else:
        from megatron_opd.models.loading import load_hf_weights

        load_hf_weights(
            chunks,
            arch,
            path,
            tp_rank=tp_rank,
            tp_size=tp_size,
            expert_tp_rank=expert_tp_rank,
            expert_tp_size=expert_tp_size,
        )


def build_and_load(path: str | os.PathLike, parallel, build=None, *, trainable: bool = True, field: str = "path"):
    """``(architecture, chunks)``: this rank's chunks of the model at ``path`` under ``parallel``, weights loaded.

    Megatron's groups must already be initialised for ``parallel``; ``trainable=False`` builds a frozen teacher.
    """
    from megatron.core import parallel_state as ps

    from megatron_opd.models.builder import build_model, validate_layout

    arch = model_architecture(path, field)
    validate_layout(arch, parallel)
    chunks = build_model(arch, parallel, build, trainable=trainable)
    load_weights(
        chunks,
        arch,
        path,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
        expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
    )
    return arch, chunks


def load_output_weight(path: str | os.PathLike, field: str = "path") -> torch.Tensor:
    """The full output-layer weight ``[rows, H]`` of the model at ``path`` (the embedding when tied; rows may
    include padding), on the CPU in its stored dtype. A collective for a ``dist_ckpt``: every rank calls it."""
    arch = model_architecture(path, field)
    megatron_name = "embedding.word_embeddings.weight" if arch.tie_word_embeddings else "output_layer.weight"
    if model_format(path, field) == "hf":
        from megatron_opd.models.hf_io import HFCheckpointReader
        from megatron_opd.models.name_mapping import weight_rules

        (rule,) = [r for r in weight_rules(arch) if r.megatron == megatron_name]
        return HFCheckpointReader(path).get(rule.hf[0])
    from megatron_opd.checkpoint.mcore_io import load_dist_checkpoint
    from megatron_opd.checkpoint.mcore_to_hf import plan_reads

    (read,) = [r for group in plan_reads(Path(path), arch) for r in group if r.key.endswith(megatron_name)]
    loaded = load_dist_checkpoint({"w": read.sharded_tensor()}, path, validate_access_integrity=False)
    return read.unwrap(loaded["w"])
