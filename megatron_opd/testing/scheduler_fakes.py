"""Stand-ins for scheduler tests and benchmarks: back ends that record what was asked of them, and ones whose
phases take a controlled time (sleeps on background workers, so they overlap whatever the machine's load).

``RecordingRollout`` samples in the background like the vLLM back end (results are made when collected) and its
sync waits for rollouts in flight; ``RecordingTeacher`` logs each request. The first response token of every
rollout encodes its batch's seed (``seed % 50 + 1``), so a log shows which batch each phase handled.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_opd.interfaces import DeferredFuture, Rollouts, SamplingParams, TeacherScores, completed
from megatron_opd.scheduler import DEPTH, Scheduler


class RecordingRollout:
    """Samples in the background (results are computed when collected); a sync waits for rollouts in flight."""

    asynchronous = True

    def __init__(self, log: list) -> None:
        self.version, self.log, self.in_flight = 0, log, []

    @property
    def policy_version(self) -> int:
        return self.version

    def generate(self, prompt_token_ids, sampling: SamplingParams, n: int) -> DeferredFuture:
        version, seed = self.version, sampling.seed
        self.log.append(("rollout", seed, version))

        def sample() -> Rollouts:
            responses = [torch.tensor([seed % 50 + 1, 2]) for _ in range(len(prompt_token_ids) * n)]
            return Rollouts(
                prompt_ids=[torch.tensor(p) for p in prompt_token_ids for _ in range(n)],
                response_ids=responses,
                response_mask=[torch.ones(2, dtype=torch.int64) for _ in responses],
                logprobs=[torch.zeros(2) for _ in responses],
                finish_reasons=["stop"] * len(responses),
                prompt_index=[i // n for i in range(len(responses))],
                policy_version=version,
            )

        future = DeferredFuture(sample)
        self.in_flight.append(future)
        return future

    def close(self) -> None:
        self.log.append(("close",))

    def sync_weights(self, policy_version: int) -> None:
        for future in self.in_flight:
            future.result()
        self.in_flight.clear()
        self.version = policy_version
        self.log.append(("sync", policy_version))


class RecordingTeacher:
    supports_dense = False
    supports_requested_logprobs = True

    def __init__(self, log: list) -> None:
        self.log = log

    def score(self, tokens, request_ids=None, lengths=None):
        self.log.append(("teacher", int(tokens[0, 3])))  # the first response token (after 3 prompt tokens): the seed
        return completed(TeacherScores())


class TimedRollout(RecordingRollout):
    """Each rollout takes ``seconds`` on a background worker (an engine process's stand-in)."""

    def __init__(self, log: list, seconds: float) -> None:
        super().__init__(log)
        self.seconds, self.worker = seconds, ThreadPoolExecutor(max_workers=1)

    def generate(self, prompt_token_ids, sampling: SamplingParams, n: int):
        inner = super().generate(prompt_token_ids, sampling, n)
        self.in_flight.pop()
        job = self.worker.submit(lambda: (time.sleep(self.seconds), inner.result())[1])
        self.in_flight.append(job)
        return job


class TimedTeacher(RecordingTeacher):
    def __init__(self, log: list, seconds: float) -> None:
        super().__init__(log)
        self.seconds, self.worker = seconds, ThreadPoolExecutor(max_workers=1)

    def score(self, tokens, request_ids=None, lengths=None):
        super().score(tokens, request_ids)
        return self.worker.submit(lambda: (time.sleep(self.seconds), TeacherScores())[1])


class SynchronousRollout(RecordingRollout):
    """Samples inside ``generate`` (``seconds``) and returns a completed future, like the built-in sampler."""

    asynchronous = False

    def __init__(self, log: list, seconds: float) -> None:
        super().__init__(log)
        self.seconds = seconds

    def generate(self, prompt_token_ids, sampling: SamplingParams, n: int):
        time.sleep(self.seconds)
        return completed(super().generate(prompt_token_ids, sampling, n).result())


class SynchronousTeacher(RecordingTeacher):
    """Scores inside ``score`` (``seconds``), like the in-process teacher."""

    def __init__(self, log: list, seconds: float) -> None:
        super().__init__(log)
        self.seconds = seconds

    def score(self, tokens, request_ids=None, lengths=None):
        time.sleep(self.seconds)
        return super().score(tokens, request_ids)


PHASES = {"rollout": 0.4, "teacher": 0.1, "update": 0.2}
"""Seconds per phase (sleeps: they overlap whatever the machine's load)."""


def timed_steps(mode: str, steps: int, data, phases: dict[str, float] = PHASES) -> tuple[float, list[int]]:
    """Mean seconds per steady-state step of ``mode`` with phases of controlled duration; and the staleness."""
    log = []
    rollout, teacher = TimedRollout(log, phases["rollout"]), TimedTeacher(log, phases["teacher"])
    scheduler = Scheduler(mode, rollout, teacher, SamplingParams(max_new_tokens=2), 1, data=data,
                          seed_for=lambda b: 100 + b, pad_token_id=0, max_len=16)  # fmt: skip
    warm_up, staleness, started = DEPTH[mode], [], 0.0
    for step in range(steps):
        if step == warm_up:
            started = time.perf_counter()
        staleness.append(scheduler.next_batch(step).staleness)
        time.sleep(phases["update"])  # the optimizer step
        rollout.sync_weights(step + 1)
    return (time.perf_counter() - started) / (steps - warm_up), staleness
