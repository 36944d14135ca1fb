"""``zero_step_off``: rollout -> teacher -> update, in sequence; every batch is sampled by the current weights.

The scheduler owns the order of the phases and their timings; the training loop only asks for the next scored
batch and applies the update. Asynchronous modes (rollouts sampled by weights one or two steps old, overlapping
the update) plug in here with the same ``next_batch`` contract.

With the union loss support (``student_topk > 0``) the phases stay the same: the rollout records the student's
top-k ids while it samples (no extra student forward) and the one teacher request also asks for the teacher's
log-probabilities at them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from megatron_opd.interfaces import RolloutBackend, Rollouts, SamplingParams, TeacherBackend, TeacherScores
from megatron_opd.trainer.batch import TrainBatch, pack_rollouts


@dataclass
class ScoredBatch:
    """A step's rollouts, packed for training, with the teacher's scores and the phase times."""

    rollouts: Rollouts
    batch: TrainBatch
    scores: TeacherScores
    trained_version: int = 0
    """The policy version (optimizer step) of the weights this batch will update."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each phase (``rollout``, ``teacher``)."""

    @property
    def staleness(self) -> int:
        """Optimizer steps between the weights that sampled the rollouts and the weights they train."""
        return self.trained_version - self.rollouts.policy_version


class ZeroStepOff:
    """On-policy: sample with the current weights, score, then hand the batch to the update."""

    mode = "zero_step_off"

    def __init__(
        self,
        rollout: RolloutBackend,
        teacher: TeacherBackend,
        sampling: SamplingParams,
        n: int,
        *,
        pad_token_id: int,
        max_len: int,
        student_topk: int = 0,
    ) -> None:
        """``student_topk > 0``: the rollouts record the student's top-k ids and the teacher scores them too (union
        loss support); a teacher that cannot return log-probabilities at requested ids is refused here."""
        if student_topk and not getattr(teacher, "supports_requested_logprobs", False):
            raise ValueError(
                f"loss.support=union needs the teacher's log-probabilities at the student's top-k ids, which the "
                f"teacher back end {type(teacher).__name__} does not return (no requested_logprobs); use "
                "teacher.backend=inprocess or server, or loss.support=teacher_topk"
            )
        self.rollout = rollout
        self.teacher = teacher
        self.sampling = dataclasses.replace(sampling, return_topk=student_topk) if student_topk else sampling
        self.n = n
        self.pad_token_id = pad_token_id
        self.max_len = max_len
        self.student_topk = student_topk

    def next_batch(self, prompt_token_ids: list[list[int]], policy_version: int, seed: int) -> ScoredBatch:
        """Rollouts of these prompts by the weights of ``policy_version``, packed and scored by the teacher."""
        t0 = time.perf_counter()
        sampling = dataclasses.replace(self.sampling, seed=seed)
        rollouts = self.rollout.generate(prompt_token_ids, sampling, self.n).result()
        if rollouts.policy_version != policy_version:
            raise RuntimeError(
                f"rollouts come from policy version {rollouts.policy_version}, expected {policy_version} (on-policy)"
            )
        t1 = time.perf_counter()
        batch = pack_rollouts(
            rollouts, pad_token_id=self.pad_token_id, max_len=self.max_len, student_topk=self.student_topk
        )
        # Also ask for the teacher's log-probability of each sampled token (teacher-confidence weights, metrics) and,
        # for the union support, of the student's top-k ids.
        scores = self.teacher.score(batch.tokens, batch.teacher_request_ids()).result()
        t2 = time.perf_counter()
        timings = {"rollout": t1 - t0, "teacher": t2 - t1}
        return ScoredBatch(rollouts, batch, scores, trained_version=policy_version, timings=timings)


def build_scheduler(mode: str, rollout: RolloutBackend, teacher: TeacherBackend, **kwargs) -> ZeroStepOff:
    """The scheduler for ``scheduler.mode``."""
    if mode != "zero_step_off":
        raise ValueError(
            f"scheduler.mode={mode!r} needs rollouts outside the trainer's ranks (rollout.backend=vllm); the built-in "
            "sampler supports scheduler.mode=zero_step_off only"
        )
    return ZeroStepOff(rollout, teacher, **kwargs)
