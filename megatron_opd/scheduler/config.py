"""``scheduler.*``: how rollout, teacher scoring and updates are ordered (a section of ``trainer.config.TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class SchedulerConfig:
    """How rollout, teacher scoring and updates are ordered."""

    mode: Literal["zero_step_off", "one_step_off", "two_step_off"] = "zero_step_off"
    """``zero_step_off``: rollout -> teacher -> update in sequence (on-policy). ``one_step_off``: batch i+1 is
    sampled (by the weights one update older) while batch i is scored and trained; ``two_step_off``: sampling,
    scoring and training of three consecutive batches overlap. Staleness is at most 0, 1 or 2 optimizer steps;
    the asynchronous modes need ``rollout.backend=vllm``."""
    sync_delay: int = 0
    """Debug and benchmarks: with ``zero_step_off`` and the built-in sampler, sample each batch with the weights of
    this many optimizer steps before the ones it trains (a copy of the student kept per step), so staleness 1 or 2
    is measured without the asynchronous machinery (``scheduler/delayed_sync.py``). 0: off."""
    warn_policy_lag: float = 0.1
    """Warn when a stale batch's policy lag (``staleness/policy_lag``: mean |log p_trainer - log p_sampler| per
    sampled token, the trainer's drift from the weights that sampled it) exceeds this many nats; at most once per
    ``logging.log_every`` steps. 0: never."""
