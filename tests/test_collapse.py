"""The trainer's watch for collapsing responses (``megatron_opd.trainer.collapse``, issue #41) on synthetic metric
traces: the collapse the issue reported stops the run, a run that learns (shorter answers with a better divergence,
or a steady length) does not, and the modes and thresholds do what the config says."""

from __future__ import annotations

import pytest

from megatron_opd.trainer.collapse import CollapseWatch, ResponseCollapseError, likely_cause
from megatron_opd.trainer.config import LossConfig, TrainLoopConfig


def trace(steps: int, length: tuple[float, float], divergence: tuple[float, float], over: int = 50):
    """Rows whose response length and divergence move linearly from the first to the second value over ``over``
    steps, then stay."""
    for step in range(1, steps + 1):
        f = min((step - 1) / (over - 1), 1.0)
        yield (
            step,
            {
                "response_length": length[0] + f * (length[1] - length[0]),
                "divergence": divergence[0] + f * (divergence[1] - divergence[0]),
            },
        )


def feed(watch: CollapseWatch, rows) -> tuple[list[tuple[int, str]], int | None]:
    """(warnings by step, the step it raised at or None)."""
    warnings = []
    for step, row in rows:
        try:
            message = watch.update(step, row)
        except ResponseCollapseError:
            return warnings, step
        if message:
            warnings.append((step, message))
    return warnings, None


def test_the_collapse_of_issue_41_warns_then_stops():
    """Responses 9.3 -> 2.2 tokens in 50 steps, the per-token divergence 1.90 -> 1.96: the aligned run of #41."""
    watch = CollapseWatch("stop", cause=likely_cause(LossConfig(mode="topk", cross_tokenizer="aligned")))
    warnings, stopped = feed(watch, trace(100, (9.3, 2.2), (1.90, 1.96)))
    # The last 10 steps' mean falls below half the first 10's (9.3 + ... ~ 8.6) near step 36: warned there, stopped
    # 20 steps later.
    assert len(warnings) == 1 and 30 <= warnings[0][0] <= 40
    assert "response length fell" in warnings[0][1] and "did not improve" in warnings[0][1]
    assert stopped == warnings[0][0] + 19
    fresh = CollapseWatch("stop", cause=watch.cause)
    with pytest.raises(ResponseCollapseError, match="learning to stop early.*mapped_teacher_mass.*collapse_check"):
        for step, row in trace(100, (9.3, 2.2), (1.90, 1.96)):
            fresh.update(step, row)


@pytest.mark.parametrize(
    "length, divergence",
    [
        ((9.3, 8.7), (1.94, 1.0)),  # the issue's sampled run: length kept, divergence down
        ((9.3, 3.0), (1.94, 1.0)),  # a student that learns to stop sooner and gets better
        ((9.3, 9.3), (1.90, 2.40)),  # the divergence worsens but nothing collapses
        ((6.0, 4.0), (0.5, 0.6)),  # answers shorten by a third only
    ],
)
def test_runs_that_do_not_collapse_pass(length, divergence):
    assert feed(CollapseWatch("stop"), trace(200, length, divergence)) == ([], None)


def test_negative_divergences_count_improvement_by_their_size():
    """A sampled estimate can be negative: improving means falling by a share of its size."""
    assert feed(CollapseWatch("stop"), trace(100, (9.0, 2.0), (-0.5, -1.0))) == ([], None)
    assert feed(CollapseWatch("stop"), trace(100, (9.0, 2.0), (-0.5, -0.52)))[1] is not None


def test_warn_and_off_and_thresholds():
    collapsed = list(trace(200, (9.3, 2.2), (1.90, 1.96)))
    warnings, stopped = feed(CollapseWatch("warn"), collapsed)
    assert stopped is None and len(warnings) == 1
    assert feed(CollapseWatch("off"), collapsed) == ([], None)
    assert feed(CollapseWatch("stop", length_ratio=0.2), collapsed) == ([], None)  # 2.2 / 8.6 is above 0.2
    assert feed(CollapseWatch("stop", min_improvement=0.0), trace(200, (9.3, 2.2), (1.90, 1.80)))[1] is None
    _, early = feed(CollapseWatch("stop", window=5, patience=3), collapsed)
    _, late = feed(CollapseWatch("stop"), collapsed)
    assert early < late
    # A collapse that recovers before the patience runs out resets the count.
    recovering = collapsed[:45] + [(s, {**r, "divergence": 0.5}) for s, r in collapsed[45:60]] + collapsed[60:]
    warnings, stopped = feed(CollapseWatch("stop"), recovering)
    assert len(warnings) == 2 and stopped == warnings[-1][0] + 19


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(collapse_check="maybe"), "train.collapse_check must be stop, warn or off"),
        (dict(collapse_length_ratio=1.5), "train.collapse_length_ratio must be in"),
        (dict(collapse_min_improvement=-0.1), "train.collapse_min_improvement must be in"),
        (dict(collapse_window=0), "train.collapse_window must be >= 1"),
    ],
)
def test_config_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainLoopConfig(**kwargs)
