"""A run checks itself for responses that collapse while the divergence does not improve (issue #41).

A student that learns to stop early looks fine in most figures: a per-sequence sum (``sequence_log_ratio``) moves
towards 0 as answers shorten, and a loss can fall. What does not improve is the divergence per token. So each step
the watch compares two running means over ``train.collapse_window`` steps with the same means over the run's first
window: the mean response length, and the per-token divergence (``divergence``, the figure logged each step). When
the length has fallen below ``train.collapse_length_ratio`` of the first window's while the divergence has not
fallen by ``train.collapse_min_improvement`` of its first window's value, it warns; after
``train.collapse_patience`` such steps in a row it stops the run (``train.collapse_check=stop``) with an error
naming the likely cause. ``train.collapse_check=warn`` only warns, ``off`` does nothing. Every loss is watched;
SFT (no sampled responses) is not.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

logger = logging.getLogger("megatron_opd.train")


class ResponseCollapseError(RuntimeError):
    """The student's responses collapsed while the per-token divergence did not improve."""


class CollapseWatch:
    """Feeds on each step's metrics row (``response_length``, ``divergence``); see the module docstring."""

    def __init__(
        self,
        action: str = "stop",
        length_ratio: float = 0.7,
        min_improvement: float = 0.1,
        window: int = 10,
        patience: int = 20,
        cause: str = "",
    ):
        """``cause``: what the error names as the likely cause (the run's loss settings)."""
        self.action, self.length_ratio, self.min_improvement = action, length_ratio, min_improvement
        self.window, self.patience, self.cause = window, patience, cause
        self.lengths: list[float] = []
        self.divergences: list[float] = []
        self.flagged = 0
        """Consecutive steps the collapse held."""

    def state_dict(self) -> dict:
        """What a resume needs to go on where the run stopped (saved in the training checkpoint): the first window
        and the last window of figures (the only ones :meth:`update` reads) and the flagged count."""
        w = self.window
        keep = slice(max(w, len(self.lengths) - w), None)  # the first w, then the last w after them
        return {
            "lengths": self.lengths[:w] + self.lengths[keep],
            "divergences": self.divergences[:w] + self.divergences[keep],
            "flagged": self.flagged,
            "window": w,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Go on from :meth:`state_dict`. A checkpoint saved with another ``train.collapse_window`` starts the
        watch afresh (its windows mean other steps), with a log line."""
        if int(state.get("window", -1)) != self.window:
            logger.info(
                "collapse watch: the checkpoint's window (%s steps) is not train.collapse_window=%d; watching afresh",
                state.get("window"), self.window,
            )  # fmt: skip
            return
        self.lengths = [float(x) for x in state["lengths"]]
        self.divergences = [float(x) for x in state["divergences"]]
        self.flagged = int(state["flagged"])

    def update(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """Take one step's row; returns a warning the first step a collapse is seen, raises
        :class:`ResponseCollapseError` after ``patience`` steps of it (``action="stop"``)."""
        if self.action == "off":
            return None
        length, divergence = metrics.get("response_length"), metrics.get("divergence")
        if length is None or divergence is None or not math.isfinite(divergence):
            return None
        self.lengths.append(float(length))
        self.divergences.append(float(divergence))
        w = self.window
        if len(self.lengths) < 2 * w:
            return None
        start_len, start_div = _mean(self.lengths[:w]), _mean(self.divergences[:w])
        now_len, now_div = _mean(self.lengths[-w:]), _mean(self.divergences[-w:])
        shorter = now_len < self.length_ratio * start_len
        improved = now_div <= start_div - self.min_improvement * abs(start_div)
        if not shorter or improved:
            self.flagged = 0
            return None
        self.flagged += 1
        what = (
            f"step {step}: the mean response length fell from {start_len:.2f} to {now_len:.2f} tokens (first and last "
            f"{w} steps; below train.collapse_length_ratio={self.length_ratio:g} of the start) while the per-token "
            f"divergence did not improve ({start_div:.4f} -> {now_div:.4f}; train.collapse_min_improvement="
            f"{self.min_improvement:g})"
        )
        if self.action == "stop" and self.flagged >= self.patience:
            raise ResponseCollapseError(
                f"{what}, for {self.flagged} steps in a row: the student is learning to stop early, not to answer "
                f"like the teacher. Likely cause: {self.cause or 'the loss credits stopping more than continuing'}. "
                "Stopped; check the loss settings, or set train.collapse_check=warn (or off) to go on"
            )
        if self.flagged == 1:
            logger.warning("%s: responses are collapsing (stopping after %d such steps)", what, self.patience)
            return f"warning: {what}"
        return None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def likely_cause(loss) -> str:
    """The likely cause of a collapse under ``loss`` (a ``LossConfig``), for the error message."""
    if loss.cross_tokenizer == "aligned":
        return (
            "a teacher with another tokenizer whose top-k maps poorly to the student's vocabulary (see "
            "cross_tokenizer/mapped_teacher_mass and topk_share), so the top-k loss credits the teacher's EOS more "
            "than its continuations; compare loss.cross_tokenizer=sampled"
        )
    if loss.cross_tokenizer == "sampled":
        return "a teacher with another tokenizer that judges stopping differently (the stop correction, EOS mapping)"
    if loss.mode == "sampled":
        fix = "lower optim.lr" if loss.kind == "forward_kl" else "loss.kind=forward_kl, or lower optim.lr"
        return f"the sampled estimator's variance at this learning rate ({fix}; docs/training.md)"
    return "a teacher that puts more mass on EOS than on continuing (check its tokenizer's EOS and the data)"
