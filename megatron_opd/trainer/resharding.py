"""Resuming a training checkpoint at another parallel layout: what carries over, and what cannot.

Model weights and the plain optimizer's Adam moments are ``ShardedTensor`` s keyed by model parameter, so
``dist_checkpointing`` reshards them to any TP/PP/VP/DP. The LR schedule, step and data position are plain values.
Two things are per rank and do not reshard:

* RNG states (one per pipeline x tensor x data-parallel rank, and x context-parallel rank at CP > 1): restored when
  the layout is unchanged, otherwise every stream is re-seeded from ``seed`` and the step (as Megatron-LM's
  ``--no-load-rng``).

The distributed optimizer's state is saved in Megatron's ``fully_reshardable`` format: gathered over data-parallel
ranks into one tensor per model parameter (as the plain optimizer's), so it reshards like the model. Checkpoints
written before in ``dp_reshardable`` format (flat buckets of one model-parallel rank, which Megatron reshards over
data-parallel ranks only) load at their own TP/PP/VP/CP; elsewhere the resume is refused before anything is loaded.

The layout is saved in the checkpoint's trainer state; checkpoints written before that are read from their
metadata (the shape of the ``rng_state`` objects, the config's ``parallel`` section).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_opd.models.hf_io import CheckpointError


@dataclass(frozen=True)
class Layout:
    """How the ranks of a run are laid out, and which optimizer state format they hold."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    """Model chunks per pipeline rank (1: not interleaved)."""
    context_parallel_size: int
    data_parallel_size: int
    distributed_optimizer: bool
    """Optimizer state saved by Megatron's distributed optimizer."""
    optimizer_format: str = ""
    """The distributed optimizer's ``distrib_optim_sharding_type`` (``fully_reshardable``, or ``dp_reshardable``
    in older checkpoints); empty for the plain optimizer."""
    expert_model_parallel_size: int = 1
    """Ranks splitting each MoE layer's experts (1 in checkpoints from before expert parallelism)."""

    def ranks(self) -> tuple[int, ...]:
        """The sizes that decide which rank holds which per-rank state."""
        return self.model_parallel() + (self.data_parallel_size,)

    def model_parallel(self) -> tuple[int, ...]:
        return (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.context_parallel_size,
            self.expert_model_parallel_size,
        )

    def describe(self) -> str:
        expert = f" EP={self.expert_model_parallel_size}" if self.expert_model_parallel_size > 1 else ""
        return (
            f"TP={self.tensor_model_parallel_size} PP={self.pipeline_model_parallel_size} "
            f"VP={self.virtual_pipeline_model_parallel_size} CP={self.context_parallel_size}{expert} "
            f"DP={self.data_parallel_size}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SAVED_OPTIMIZER_FORMAT = "fully_reshardable"
"""How this trainer saves the distributed optimizer's state (Megatron's ``distrib_optim_sharding_type``)."""
LEGACY_OPTIMIZER_FORMAT = "dp_reshardable"
"""How it saved it before: distributed-optimizer checkpoints without ``optimizer_format`` hold this."""


def current_layout(student) -> Layout:
    """This run's layout (Megatron's parallel state and the student's optimizer)."""
    from megatron.core import parallel_state as ps

    distributed = bool(student.model[0].ddp_config.use_distributed_optimizer)
    return Layout(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=len(student.chunks),
        context_parallel_size=ps.get_context_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        distributed_optimizer=distributed,
        optimizer_format=SAVED_OPTIMIZER_FORMAT if distributed else "",
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
    )


_RNG_KEY = re.compile(r"^rng_state/shard_[\d.]+_(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?$")
"""An ``rng_state`` object's key: ``shard_<offset>_<PP>.<TP>.<DP>``, and ``.<CP>`` where CP > 1
(``checkpointing.sharded_rng_state``)."""


def saved_layout(path: str | Path) -> Layout:
    """The layout checkpoint ``path`` was written at (read on every rank: a small file, no collective)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))
    trainer = common.get("trainer", {})
    if "layout" in trainer:
        layout = trainer["layout"]
        legacy = LEGACY_OPTIMIZER_FORMAT if layout["distributed_optimizer"] else ""
        return Layout(**{"optimizer_format": legacy, **layout})
    return layout_from_metadata(Path(path), trainer.get("config", {}).get("parallel", {}), common)


def layout_from_metadata(path: Path, parallel: dict, common: dict) -> Layout:
    """A checkpoint from before the layout was saved: PP, TP, DP (and CP, where keyed) are the shape of its
    ``rng_state`` objects."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    shapes = {tuple(int(s) for s in m.groups() if s is not None) for m in map(_RNG_KEY.match, keys) if m}
    if len(shapes) != 1:
        raise CheckpointError(f"{path} holds no readable rng_state objects, so its parallel layout is unknown")
    pp, tp, dp, *cp = shapes.pop()
    distributed = "param_state_sharding_type" in repr(common.get("optimizer", {}))
    return Layout(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=parallel.get("virtual_pipeline_model_parallel_size") or 1,
        context_parallel_size=cp[0] if cp else parallel.get("context_parallel_size", 1),
        data_parallel_size=dp,
        distributed_optimizer=distributed,
        optimizer_format=LEGACY_OPTIMIZER_FORMAT if distributed else "",
    )


def check_optimizer_state(saved: Layout, current: Layout, path: str | Path) -> None:
    """Refuse, before anything is loaded, an optimizer state this layout cannot read."""
    names = {True: "Megatron's distributed optimizer", False: "the plain (non-distributed) optimizer"}
    if saved.distributed_optimizer != current.distributed_optimizer:
        raise ValueError(
            f"{path} holds the state of {names[saved.distributed_optimizer]}, but this run uses "
            f"{names[current.distributed_optimizer]}: set optim.use_distributed_optimizer="
            f"{str(saved.distributed_optimizer).lower()} to resume it, or checkpoint.load_optimizer=false to load "
            "the model, LR schedule and data position and start Adam's moments afresh"
        )
    movable = saved.optimizer_format != LEGACY_OPTIMIZER_FORMAT
    if saved.distributed_optimizer and not movable and saved.model_parallel() != current.model_parallel():
        raise ValueError(
            f"{path} holds the distributed optimizer's state in Megatron's dp_reshardable format (written by an "
            f"older megatron-opd; checkpoints written now are fully_reshardable), saved at "
            f"{saved.describe()}; it loads at that TP/PP/VP/CP/EP with any number of data-parallel ranks, not at "
            f"{current.describe()}. Resume at the saved parallel.* sizes, or set checkpoint.load_optimizer=false to "
            "reshard the model, keep the LR schedule and data position, and start Adam's moments afresh"
        )
