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


# ---- alignment: every phase's output a function of what it was given ------------------------------------------
def policy_response(prompt: list[int], seed: int, version: int, length: int = 3) -> list[int]:
    """The response a fake policy of ``version`` samples for ``prompt`` with ``seed``: a function of all three."""
    return [(sum(prompt) * 7 + seed * 3 + version * 11 + 5 * j) % 97 + 2 for j in range(length)]


def policy_logprob(token: int, position: int, version: int) -> float:
    """The fake policy's log-probability of ``token`` at response position ``position``, at ``version``."""
    return -(0.01 * token + 0.1 * position + 0.5 * version) - 0.001


def teacher_logprobs(tokens_NS: torch.Tensor, k: int = 2) -> torch.Tensor:
    """``[N, S, k]`` the fake teacher's top-k log-probabilities: position s a function of the tokens up to s + 1
    (the prefix and the token it predicts), so scores paired with another batch differ."""
    prefix_NS = torch.cumsum(tokens_NS.double() * torch.arange(1, tokens_NS.shape[1] + 1), dim=1)
    ahead_NS = torch.cat([tokens_NS[:, 1:], tokens_NS[:, -1:]], dim=1).double()
    base_NS = -torch.remainder(prefix_NS + 13 * ahead_NS, 1009) / 1009 - 1e-3
    return torch.stack([base_NS - j for j in range(k)], dim=-1).to(torch.float32)


class PolicyRollout(RecordingRollout):
    """Samples in the background like ``RecordingRollout``, its responses and recorded log-probabilities functions of
    (prompt, seed, the policy version at the ``generate`` call): a rollout paired with the wrong batch, seed or
    version is told apart. ``lag_versions``: the log-probabilities it records are those of ``version - lag_versions``
    (a deliberately misaligned back end)."""

    def __init__(self, log: list, lag_versions: int = 0) -> None:
        super().__init__(log)
        self.lag_versions = lag_versions

    def generate(self, prompt_token_ids, sampling: SamplingParams, n: int) -> DeferredFuture:
        version, seed, lag = self.version, sampling.seed, self.lag_versions
        self.log.append(("rollout", seed, version))

        def sample() -> Rollouts:
            prompts = [p for p in prompt_token_ids for _ in range(n)]
            responses = [policy_response(p, seed + i % n, version) for i, p in enumerate(prompts)]
            return Rollouts(
                prompt_ids=[torch.tensor(p) for p in prompts],
                response_ids=[torch.tensor(r) for r in responses],
                response_mask=[torch.ones(len(r), dtype=torch.int64) for r in responses],
                logprobs=[
                    torch.tensor([policy_logprob(t, j, version - lag) for j, t in enumerate(r)]) for r in responses
                ],
                finish_reasons=["length"] * len(responses),
                prompt_index=[i // n for i in range(len(responses))],
                policy_version=version,
            )

        future = DeferredFuture(sample)
        self.in_flight.append(future)
        return future


class TokenTeacher:
    """Scores on a pool of ``workers`` threads whose answers come back out of order (later requests sleep less),
    like a remote teacher with several requests in flight; its scores are ``teacher_logprobs(tokens)``.
    ``shift``: answer each request with the scores of the one ``shift`` before it (a deliberately shifted pairing)."""

    supports_dense = False
    supports_requested_logprobs = True

    def __init__(self, log: list, workers: int = 2, shift: int = 0) -> None:
        self.log, self.shift, self.asked = log, shift, []
        self.worker = ThreadPoolExecutor(max_workers=workers)

    def score(self, tokens, request_ids=None, lengths=None):
        self.asked.append(tokens.clone())
        self.log.append(("teacher", len(self.asked) - 1))
        scored = self.asked[max(len(self.asked) - 1 - self.shift, 0)]
        delay = 0.02 if len(self.asked) % 2 else 0.0

        def answer() -> TeacherScores:
            time.sleep(delay)
            logprobs = teacher_logprobs(scored)
            ids = torch.stack([torch.remainder(scored, 50), torch.remainder(scored, 50) + 50], dim=-1)
            return TeacherScores(topk_ids=ids, topk_logprobs=logprobs, requested_logprobs=logprobs[..., :1])

        return self.worker.submit(answer)
