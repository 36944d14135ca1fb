"""Schedulers order rollout, teacher scoring and updates; the training loop asks one for each step's batch."""

from megatron_opd.scheduler.batch_schedule import DEPTH, Scheduler, ScoredBatch, build_scheduler

__all__ = ["DEPTH", "ScoredBatch", "Scheduler", "build_scheduler"]
