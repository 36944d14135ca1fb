"""``optim.lag_lr_target``: a stale batch's step uses lr x min(1, target / lag), through Megatron's LR schedule
(warm-up included) for that one ``optimizer.step()`` and no other; the config refusals. One process, no model: the
student's optimizer and forward-backward are stand-ins, the LR schedule is Megatron's."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from megatron_opd.rollout.fidelity import fidelity_metrics
from megatron_opd.trainer.lag_lr import lag_lr_scale, scaled_lr
from megatron_opd.trainer.objective import StepStats

TARGET = 0.1


class _Optimizer:
    """Megatron's optimizer interface around torch's Adam on one parameter (two groups, the second at half rate as
    a per-group multiplier would set it); records the rate of each group when it steps."""

    def __init__(self) -> None:
        self.weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
        self.inner = torch.optim.Adam([{"params": [self.weights[0]]}, {"params": [self.weights[1]], "max_lr": 5e-4}])
        self.applied: list[list[float]] = []

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self):
        for w in self.weights:
            w.grad = torch.ones_like(w)
        self.applied.append([g["lr"] for g in self.param_groups])
        self.inner.step()
        return True, 1.0, None


def _schedule(optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=3,
                                   lr_decay_steps=13, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=1, wd_incr_style="constant")  # fmt: skip


def _stats(lag: float) -> StepStats:
    """A step's statistics whose policy lag (mean |d| per token) is ``lag``."""
    return StepStats(loss=1.0, tokens=10.0, fidelity_tokens=10.0, logprob_diff_abs_sum=10.0 * lag)


def test_scale_is_min_one_target_over_lag_on_stale_batches_only():
    assert lag_lr_scale(0.4, staleness=2, target=TARGET) == pytest.approx(0.25)
    assert lag_lr_scale(0.05, staleness=1, target=TARGET) == 1.0  # within the target
    assert lag_lr_scale(0.4, staleness=0, target=TARGET) == 1.0  # fresh: the gap is the sampler's, not a lag
    for off in (None, 0.0):
        assert lag_lr_scale(0.4, staleness=2, target=off) == 1.0
    for unknown in (None, math.nan):  # no sampler log-probabilities; a NaN loss is stopped elsewhere
        assert lag_lr_scale(unknown, staleness=2, target=TARGET) == 1.0


def test_student_step_scales_that_steps_lr_and_restores_the_schedule():
    """Each step's applied rate is the schedule's (warm-up, per-group rates) times min(1, target / lag); after the
    step every group holds exactly the schedule's next rate, as in a run without the knob."""
    from megatron_opd.trainer import student as student_module
    from megatron_opd.trainer.student import Student

    reference = _Optimizer()
    ref_schedule = _schedule(reference)
    student = Student.__new__(Student)
    student.model, student.router_metrics = [mock.Mock()], None
    student.optimizer = _Optimizer()
    student.lr_schedule = _schedule(student.optimizer)
    lags = [0.0, 0.4, 0.05, 0.2, 0.3]  # through the warm-up (3 steps) and after
    for lag in lags:
        stats = _stats(lag)
        with mock.patch.object(student_module, "forward_backward", return_value=[stats]):
            result = student.step([{}], loss_fn=None, lr_scale=lambda s: lag_lr_scale(
                fidelity_metrics(s.as_dict())["rollout/logprob_diff_mean"], staleness=2, target=TARGET))  # fmt: skip
        scale = min(1.0, TARGET / lag) if lag else 1.0
        assert result.lr_scale == pytest.approx(scale)
        reference.step()
        ref_schedule.step(increment=1)
        assert student.optimizer.applied[-1] == pytest.approx([lr * scale for lr in reference.applied[-1]], rel=1e-12)
        assert [g["lr"] for g in student.optimizer.param_groups] == [g["lr"] for g in reference.param_groups]
        assert result.lr == reference.param_groups[0]["lr"]
    assert reference.applied[1][0] > 0 and reference.applied[1][1] == reference.applied[1][0] / 2  # warm-up, groups
    # Without lr_scale the step is the schedule's.
    with mock.patch.object(student_module, "forward_backward", return_value=[_stats(0.4)]):
        assert student.step([{}], loss_fn=None).lr_scale == 1.0
    reference.step()
    assert student.optimizer.applied[-1] == reference.applied[-1]


def test_scaled_lr_restores_on_error():
    optimizer = _Optimizer()
    for group in optimizer.param_groups:
        group["lr"] = 1e-3
    with pytest.raises(RuntimeError), scaled_lr(optimizer, 0.5):
        assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 5e-4]
        raise RuntimeError("the step failed")
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 1e-3]


def test_config_refusals():
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl"]
    for ok in ("optim.lag_lr_target=0.1", "optim.lag_lr_target=0", "optim.lag_lr_target=null"):
        parse_args(TrainConfig, [*base, ok]).validate()
    assert parse_args(TrainConfig, base).optim.lag_lr_target is None  # off by default
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(ValueError, match="optim.lag_lr_target must be a finite number"):
            parse_args(TrainConfig, [*base, f"optim.lag_lr_target={bad}"]).validate()
    with pytest.raises(ValueError, match="loss.kind=sft trains on the records' responses"):
        parse_args(TrainConfig, [*base, "optim.lag_lr_target=0.1", "loss.kind=sft"]).validate()
