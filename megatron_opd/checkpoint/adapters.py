"""Adapter-only checkpoints of a LoRA student (``student.lora``): the adapters saved, the frozen base referenced.

A LoRA student's base weights never change, so its training checkpoints hold the adapter factors only (``A``, ``B``
and ``alpha/r`` of each adapted layer), with their optimizer state (the optimizer holds nothing else), the LR
schedule, RNG states and data position: a few MB where the full student's checkpoint holds every weight and two Adam
moments. The base is reloaded from ``student.path`` at resume and read from there by the converter's exports; the
checkpoint's trainer state records where it was (``trainer.adapters``). The factors are ``ShardedTensor`` s split as
their layers are, so ``dist_checkpointing`` reshards them to another TP/PP like full weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from megatron_opd.model_files import CheckpointError

logger = logging.getLogger(__name__)

ADAPTER_MARK = ".lora."
"""In a parameter or checkpoint key, what marks an adapter factor (``...linear_qkv.lora.A``)."""


def adapter_entries(model_state: dict) -> dict:
    """One model chunk's sharded state dict with only its adapters' entries (factors and ``alpha/r``)."""
    return {key: value for key, value in model_state.items() if ADAPTER_MARK in key}


def adapter_record(student) -> dict:
    """What a checkpoint records of its adapters (``student``: the run's ``StudentConfig``): the frozen base's path
    and the adapters' settings, which a resume must match."""
    lora = student.lora
    return {
        "base": str(Path(student.path).resolve()),
        "rank": lora.rank,
        "alpha": float(lora.alpha),
        "target_modules": list(lora.target_modules),
    }


def saved_adapter_record(path: str | os.PathLike) -> dict | None:
    """The adapter record of the training checkpoint ``path`` (None: a full student's checkpoint, or not one of the
    trainer's). Reads its small common file: no collective."""
    from megatron.core import dist_checkpointing

    trainer = dist_checkpointing.load_common_state_dict(str(path)).get("trainer", {})
    return trainer.get("adapters") if isinstance(trainer, dict) else None


def is_adapter_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an adapter-only checkpoint (a LoRA student's, written by the trainer). Megatron-Core 0.17+
    keeps the common state inside the checkpoint's items (no ``common.pt``): any ``dist_checkpointing`` folder is
    asked."""
    return (Path(path) / "metadata.json").is_file() and saved_adapter_record(path) is not None


def check_adapter_resume(saved: dict | None, student, path: str | os.PathLike) -> None:
    """Refuse, before anything is loaded, a resume whose student does not fit checkpoint ``path``: a LoRA student
    from a full student's checkpoint or the reverse, or adapters of another rank, alpha or set of layers. A base at
    another path than the saved one is only logged (a moved folder); it must hold the same weights."""
    lora = student.lora
    if saved is None and lora.enabled:
        raise ValueError(
            f"{path} holds a full student (no adapters), but student.lora.rank={lora.rank}: set student.lora.rank=0 "
            "to resume it, or start the LoRA run in a fresh checkpoint.dir (on an export of those weights: "
            "opd-convert mcore-to-hf, then student.path=that folder)"
        )
    if saved is None:
        return
    if not lora.enabled:
        raise ValueError(
            f"{path} holds a LoRA student's adapters only (rank {saved['rank']}, base {saved['base']}), but "
            f"student.lora.rank=0: set student.lora.rank={saved['rank']} to resume it, or merge it into its base "
            "first (opd-convert mcore-to-hf --ckpt ...) and train that folder in a fresh checkpoint.dir"
        )
    ours = adapter_record(student)
    for key, field in (("rank", "rank"), ("alpha", "alpha"), ("target_modules", "target_modules")):
        if saved[key] != ours[key]:
            raise ValueError(
                f"{path} holds adapters with {key} {saved[key]}, but student.lora.{field}={ours[key]}: set "
                f"student.lora.{field}={saved[key]} to resume them, or start in a fresh checkpoint.dir"
            )
    if saved["base"] != ours["base"]:
        logger.warning(
            "resuming adapters trained on the base %s with student.path=%s: it must hold the same weights",
            saved["base"], ours["base"],
        )  # fmt: skip


def load_adapters(chunk, state: dict, path: str | os.PathLike) -> None:
    """Load a chunk's adapter entries from an adapter-only checkpoint's ``state`` (its frozen weights are already
    the base's); every adapter of the chunk must be there."""
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    missing = [key for key in missing if ADAPTER_MARK in key]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the adapters do not fit this student (missing {missing[:4]}, unexpected {list(unexpected)[:4]});"
            " resume with the student.path and student.lora.* it was trained with"
        )
