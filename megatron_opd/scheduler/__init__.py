"""Schedulers order rollout, teacher scoring and updates; the training loop asks one for each step's batch."""

from megatron_opd.scheduler.zero_step_off import ScoredBatch, ZeroStepOff, build_scheduler

__all__ = ["ScoredBatch", "ZeroStepOff", "build_scheduler"]
