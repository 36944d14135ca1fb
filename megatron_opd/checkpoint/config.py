"""``checkpoint.*``: resumable training checkpoints (a section of ``trainer.config.TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """Resumable training checkpoints (Megatron dist_checkpointing)."""

    dir: str | None = None
    """Folder of ``step_N`` checkpoints and the ``latest`` pointer; default ``output_dir/checkpoints``. A run
    started on a folder with checkpoints resumes from the latest."""
    every: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a successful save."""
    resume: bool = True
    """Resume from ``dir``'s latest checkpoint when there is one (at any parallel layout: see
    ``trainer/resharding.py``)."""
    load_optimizer: bool = True
    """Resume the optimizer state too; false starts Adam's moments afresh (the model, LR schedule and data position
    still carry over), for a distributed-optimizer checkpoint resumed at another TP/PP/VP."""
