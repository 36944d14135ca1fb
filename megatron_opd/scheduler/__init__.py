"""Schedulers order rollout, teacher scoring and updates; the training loop asks one for each step's batch."""

from megatron_opd.scheduler.batch_schedule import DEPTH, Scheduler, ScoredBatch, build_scheduler
from megatron_opd.scheduler.delayed_sync import DelayedSync

__all__ = ["DEPTH", "DelayedSync", "ScoredBatch", "Scheduler", "build_scheduler"]
