"""The staleness-aware step size (``optim.lag_lr_target``): a shorter step where the batch's sampler lags the weights.

A stale batch was sampled by weights ``staleness`` updates older than the ones it trains, so each update answers
the state the policy was in a few steps before: a control loop with delay, which overshoots when the gain (the
learning rate) is high. The step of such a batch is cut to ``lr x min(1, target / lag)``, with ``lag`` the batch's
``staleness/policy_lag`` (mean |log p_trainer - log p_sampler| per sampled token, read in the same step's loss pass,
identical on every rank before ``optimizer.step()``): a trust region in nats per token. Fresh batches, and stale ones
that lag less than the target, keep the schedule's learning rate. The objective is unchanged; only the step size is.

The scale is applied to every parameter group's ``lr`` for the one ``optimizer.step()`` and undone right after, so
Megatron's ``OptimizerParamScheduler`` (warm-up, decay, per-group multipliers) keeps setting the rate of each step as
without it. Scaling the loss would not do: Adam normalises the gradient's scale away. Off by default: on issue 42's
fast-moving task it reached a target score in fewer steps but ended level with the uncorrected modes
(``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator


def lag_lr_scale(lag: float | None, staleness: int, target: float | None) -> float:
    """``min(1, target / lag)`` for a stale batch whose policy lag ``lag`` (nats per token) is known; 1 for a fresh
    batch, without a lag (no sampler log-probabilities), with the knob off (``target`` 0 or None) or a lag that is
    not a finite number (a NaN loss stops the step elsewhere)."""
    if not target or staleness == 0 or lag is None or not math.isfinite(lag) or lag <= target:
        return 1.0
    return target / lag


@contextlib.contextmanager
def scaled_lr(optimizer, scale: float) -> Iterator[None]:
    """Multiply every parameter group's learning rate by ``scale`` while active (one ``optimizer.step()``), then put
    back exactly what the LR schedule had set."""
    if scale == 1.0:
        yield
        return
    groups = list(optimizer.param_groups)  # a chained optimizer's groups: the sub-optimizers' own dicts
    saved = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(groups, saved):
            group["lr"] = lr
