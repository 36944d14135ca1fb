"""A run checks its own metric rows for two failures that most figures hide (issues #41 and #51).

**Responses that collapse** (#41). A student that learns to stop early looks fine in most figures: a per-sequence
sum (``sequence_log_ratio``) moves towards 0 as answers shorten, and a loss can fall. What does not improve is the
divergence per token. So each step the watch compares two running means over ``train.collapse_window`` steps with
the same means over the run's first window: the mean response length, and the per-token divergence (``divergence``,
the figure logged each step). When the length has fallen below ``train.collapse_length_ratio`` of the first window's
while the divergence has not fallen by ``train.collapse_min_improvement`` of its first window's value, it warns;
after ``train.collapse_patience`` such steps in a row it stops the run (``train.collapse_check=stop``) with an error
naming the likely cause. ``train.collapse_check=warn`` only warns, ``off`` does nothing.

**A student that moves away from its teacher** (#51). On a tokenizer pair the loss does not fit, or at too high a
learning rate, the divergence the run minimises rises step after step (aligned forward KL from 1.0 to hundreds of
nats per token) while the responses keep their length, so the check above never fires. So the watch also compares,
over the same windows, the per-token ``divergence`` with its first window's, and ``top1_agreement`` (the share of
tokens where the student's top-1 is the teacher's; logged where the teacher has a top-1 for the student's
vocabulary, so ``cross_tokenizer=sampled`` is watched on the divergence alone) with its first window's. A divergence
above ``train.drift_divergence_ratio`` times the start (measured by its size, as a sampled estimate can be
negative), or an agreement more than ``train.drift_agreement_drop`` below the start, warns; after
``train.drift_patience`` such steps in a row it stops the run (``train.drift_check=stop``) with an error naming the
likely cause for the run's loss and the setting to change. While the collapse check flags a step, the drift check
does not count it (answers that shorten raise the per-token divergence too; the collapse names the cause).

The defaults (ratio 1.5, drop 0.04, patience 13) were chosen on recorded traces (``tests/data/metric_traces/``) by
one rule: stop every failing trace and none of the healthy ones, each value near the middle of the range that does
with the other two at their defaults (ratio 1.25-1.85, drop 0.03-0.05, patience 11-16). Healthy runs (every
quick-start variant, ``bench_scheduler.py --quality`` synchronous and two steps off, the same-tokenizer controls of
issue #51's pairs) reach at most 1.11 times their first window's divergence and 0.027 below its agreement. The
failing ones: issue #51's pairs (``boundary``, ``boundary-spaced``, ``mistral_word``) with ``aligned`` (forward and
reverse KL) and the sampled forward KL, the quick
start's cross-tokenizer pair with ``aligned`` at lr 1e-2 and 2e-2. The forward KL's divergence is spiky (single
steps of 1e3 nats): a window's mean carries the spikes, which is what stops those runs, and a patience longer than
the window keeps one outlier step (in the window for ``collapse_window`` steps) from stopping a run alone.

Every loss is watched; SFT (no sampled responses) is not. The watch is a pure function of the rows it is fed; its
state goes into the training checkpoint (:meth:`CollapseWatch.state_dict`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

logger = logging.getLogger("megatron_opd.train")


class ResponseCollapseError(RuntimeError):
    """The student's responses collapsed while the per-token divergence did not improve."""


class TeacherDriftError(RuntimeError):
    """The per-token divergence to the teacher rose (or top-1 agreement fell) well past the run's start."""


class CollapseWatch:
    """Feeds on each step's metrics row (``response_length``, ``divergence``, ``top1_agreement`` where logged); see
    the module docstring."""

    def __init__(
        self,
        action: str = "stop",
        length_ratio: float = 0.7,
        min_improvement: float = 0.1,
        window: int = 10,
        patience: int = 20,
        cause: str = "",
        *,
        drift_action: str = "stop",
        divergence_ratio: float = 1.5,
        agreement_drop: float = 0.04,
        drift_patience: int = 13,
        drift_cause: str = "",
    ):
        """``cause`` / ``drift_cause``: what each error names as the likely cause (the run's loss settings)."""
        self.action, self.length_ratio, self.min_improvement = action, length_ratio, min_improvement
        self.window, self.patience, self.cause = window, patience, cause
        self.drift_action, self.divergence_ratio, self.agreement_drop = drift_action, divergence_ratio, agreement_drop
        self.drift_patience, self.drift_cause = drift_patience, drift_cause
        self.lengths: list[float] = []
        self.divergences: list[float] = []
        self.agreements: list[float] = []
        self.flagged = 0
        """Consecutive steps the collapse held."""
        self.drift_flagged = 0
        """Consecutive steps the drift from the teacher held."""

    @classmethod
    def for_run(cls, train, loss) -> CollapseWatch:
        """The watch a run's ``train`` (``TrainLoopConfig``) and ``loss`` (``LossConfig``) settings ask for."""
        return cls(
            train.collapse_check, train.collapse_length_ratio, train.collapse_min_improvement, train.collapse_window,
            train.collapse_patience, likely_cause(loss), drift_action=train.drift_check,
            divergence_ratio=train.drift_divergence_ratio, agreement_drop=train.drift_agreement_drop,
            drift_patience=train.drift_patience, drift_cause=drift_cause(loss),
        )  # fmt: skip

    def state_dict(self) -> dict:
        """What a resume needs to go on where the run stopped (saved in the training checkpoint): the first window
        and the last window of figures (the only ones :meth:`update` reads) and the flagged counts."""
        return {
            "lengths": self._ends(self.lengths),
            "divergences": self._ends(self.divergences),
            "agreements": self._ends(self.agreements),
            "flagged": self.flagged,
            "drift_flagged": self.drift_flagged,
            "window": self.window,
        }

    def _ends(self, values: list[float]) -> list[float]:
        w = self.window
        return values[:w] + values[max(w, len(values) - w) :]  # the first w, then the last w after them

    def load_state_dict(self, state: Mapping) -> None:
        """Go on from :meth:`state_dict`. A checkpoint saved with another ``train.collapse_window`` starts the
        watch afresh (its windows mean other steps), with a log line; one saved before the drift check was added
        (no ``agreements``) starts that check's agreement figures and count afresh."""
        if int(state.get("window", -1)) != self.window:
            logger.info(
                "collapse watch: the checkpoint's window (%s steps) is not train.collapse_window=%d; watching afresh",
                state.get("window"), self.window,
            )  # fmt: skip
            return
        self.lengths = [float(x) for x in state["lengths"]]
        self.divergences = [float(x) for x in state["divergences"]]
        self.agreements = [float(x) for x in state.get("agreements", [])]
        self.flagged = int(state["flagged"])
        self.drift_flagged = int(state.get("drift_flagged", 0))

    def update(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """Take one step's row; returns a warning the first step a collapse or a drift is seen, raises
        :class:`ResponseCollapseError` / :class:`TeacherDriftError` after their patience (``action="stop"``)."""
        if self.action == "off" and self.drift_action == "off":
            return None
        length, divergence = metrics.get("response_length"), metrics.get("divergence")
        if length is None or divergence is None or not math.isfinite(divergence):
            return None
        self.lengths.append(float(length))
        self.divergences.append(float(divergence))
        agreement = metrics.get("top1_agreement")
        if agreement is not None and math.isfinite(agreement):
            self.agreements.append(float(agreement))
        if len(self.lengths) < 2 * self.window:
            return None
        warning = self._collapse(step) if self.action != "off" else None
        if self.action != "off" and self.flagged:  # shorter answers raise the divergence too: the collapse is the cause
            self.drift_flagged = 0
            return warning
        return self._drift(step) if self.drift_action != "off" else None

    def _collapse(self, step: int) -> str | None:
        w = self.window
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
        return _escalate(
            what, self.flagged, self.action, self.patience, "responses are collapsing",
            ResponseCollapseError(
                f"{what}, for {self.flagged} steps in a row: the student is learning to stop early, not to answer "
                f"like the teacher. Likely cause: {self.cause or 'the loss credits stopping more than continuing'}. "
                "Stopped; check the loss settings, or set train.collapse_check=warn (or off) to go on"
            ),
        )  # fmt: skip

    def _drift(self, step: int) -> str | None:
        w = self.window
        start_div, now_div = _mean(self.divergences[:w]), _mean(self.divergences[-w:])
        reasons = []
        if now_div > start_div + (self.divergence_ratio - 1.0) * abs(start_div):
            reasons.append(
                f"the per-token divergence rose from {start_div:.4g} to {now_div:.4g} (above "
                f"train.drift_divergence_ratio={self.divergence_ratio:g} times the start)"
            )
        if len(self.agreements) >= 2 * w:
            start_agree, now_agree = _mean(self.agreements[:w]), _mean(self.agreements[-w:])
            if now_agree < start_agree - self.agreement_drop:
                reasons.append(
                    f"top-1 agreement with the teacher fell from {start_agree:.3f} to {now_agree:.3f} (more than "
                    f"train.drift_agreement_drop={self.agreement_drop:g} below the start)"
                )
        if not reasons:
            self.drift_flagged = 0
            return None
        self.drift_flagged += 1
        start_len, now_len = _mean(self.lengths[:w]), _mean(self.lengths[-w:])
        what = (
            f"step {step}: {' and '.join(reasons)}, first and last {w} steps (responses {start_len:.2f} -> "
            f"{now_len:.2f} tokens)"
        )
        return _escalate(
            what, self.drift_flagged, self.drift_action, self.drift_patience, "moving away from the teacher",
            TeacherDriftError(
                f"{what}, for {self.drift_flagged} steps in a row: the student is moving away from its teacher. "
                f"Likely cause: {self.drift_cause or 'a learning rate too high for this student: lower optim.lr'}. "
                "Stopped; change that setting, or set train.drift_check=warn (or off) to go on"
            ),
        )  # fmt: skip


def _escalate(what: str, flagged: int, action: str, patience: int, sign: str, error: RuntimeError) -> str | None:
    """One watch's answer to a flagged step: ``error`` raised once ``flagged`` steps in a row reach ``patience``
    (``action="stop"``), a warning at the first such step, else nothing."""
    if action == "stop" and flagged >= patience:
        raise error
    if flagged == 1:
        logger.warning("%s: %s (stopping after %d such steps)", what, sign, patience)
        return f"warning: {what}"
    return None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


COLLAPSE_CAUSE_BY_CROSS_TOKENIZER = {
    "aligned": (
        "a teacher with another tokenizer whose top-k maps poorly to the student's vocabulary (see "
        "cross_tokenizer/mapped_teacher_mass and topk_share), so the top-k loss credits the teacher's EOS more "
        "than its continuations; compare loss.cross_tokenizer=sampled"
    ),
    "sampled": "a teacher with another tokenizer that judges stopping differently (the stop correction, EOS mapping)",
}
"""The likely cause of a collapse by ``loss.cross_tokenizer`` (a teacher with another tokenizer)."""
COLLAPSE_CAUSE_BY_MODE = {
    "sampled": "the sampled estimator's variance at this learning rate ({fix}; docs/training.md)",
}
"""The likely cause of a collapse with a same-tokenizer teacher by ``loss.mode`` (any other: the teacher's EOS)."""
SAMPLED_COLLAPSE_FIX_BY_KIND = {"forward_kl": "lower optim.lr"}
"""What to change when a same-tokenizer ``loss.mode=sampled`` run collapses, by ``loss.kind`` (any other kind: move
to the sampled forward KL first)."""


def likely_cause(loss) -> str:
    """The likely cause of a collapse under ``loss`` (a ``LossConfig``), for the error message."""
    teacher_eos = "a teacher that puts more mass on EOS than on continuing (check its tokenizer's EOS and the data)"
    cause = COLLAPSE_CAUSE_BY_CROSS_TOKENIZER.get(
        loss.cross_tokenizer, COLLAPSE_CAUSE_BY_MODE.get(loss.mode, teacher_eos)
    )
    return cause.format(fix=SAMPLED_COLLAPSE_FIX_BY_KIND.get(loss.kind, "loss.kind=forward_kl, or lower optim.lr"))


DRIFT_CAUSE_BY_CROSS_TOKENIZER = {
    "aligned": (
        "the aligned cross-tokenizer loss on a pair whose teacher tokens map poorly to the student's (see "
        "cross_tokenizer/mapped_teacher_mass): lower optim.lr, or try loss.cross_tokenizer=sampled"
    ),
    "sampled": (
        "the variance of the sampled cross-tokenizer estimate at this learning rate (its teacher/student ratios, "
        "clipped at loss.sampled_ratio_clip): lower optim.lr or loss.sampled_ratio_clip{other_kind}"
    ),
}
"""The likely cause of a drift from the teacher by ``loss.cross_tokenizer`` (a teacher with another tokenizer)."""
DRIFT_CAUSE_BY_MODE = {
    "sampled": "the variance of the sampled estimate at this learning rate: lower optim.lr{other_kind}",
    "topk": (
        "a learning rate too high for this student, or a top-k that leaves out much of the teacher's mass: lower "
        "optim.lr or raise loss.topk"
    ),
    "dense": "a learning rate too high for this student: lower optim.lr (or raise optim.lr_warmup_steps)",
}
"""The likely cause of a drift from a same-tokenizer teacher by ``loss.mode``."""
OTHER_SAMPLED_KIND = {"forward_kl": "reverse_kl", "reverse_kl": "forward_kl"}
"""The sampled estimate to try instead of each (the forward KL's teacher/student ratio is the high-variance one, the
reverse KL the one that can reward stopping)."""


def drift_cause(loss) -> str:
    """The likely cause of a drift from the teacher under ``loss`` (a ``LossConfig``) and the setting to change, for
    the error message."""
    cause = DRIFT_CAUSE_BY_CROSS_TOKENIZER.get(loss.cross_tokenizer) or DRIFT_CAUSE_BY_MODE[loss.mode]
    other = OTHER_SAMPLED_KIND.get(loss.kind)
    return cause.format(other_kind=f", or try loss.kind={other}" if other else "")
