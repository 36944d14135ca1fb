"""The scheduler: which batch is sampled, scored and trained when, with bounded staleness.

``scheduler.mode`` sets how far rollouts run ahead of the update (their *depth*):

- ``zero_step_off`` (depth 0): rollout -> teacher -> update, in sequence; every batch is sampled by the weights it
  trains (on-policy).
- ``one_step_off`` (depth 1): the rollout of batch i+1, sampled by the weights after update i-1, runs while batch i
  is scored by the teacher and trained.
- ``two_step_off`` (depth 2): three batches in flight: batch i+2 being sampled, batch i+1 scored by the teacher,
  batch i trained.

Step ``i`` trains batch ``i``, always, exactly once: batch ``b`` is drawn from the prompt stream and asked of the
rollout back end at step ``max(b - depth, first step)`` (with the weights of that step, policy version
``b - depth``), so its staleness (optimizer steps between the weights that sampled it and the weights it trains)
is at most ``depth``, and less during warm-up (verl's one-step-off trains its first batch twice; this does not).
The rollout back end samples asked-for batches in order and a weight sync waits for them, so no rollout mixes
versions. A checkpoint saves the prompt stream's position before the oldest untrained batch: on resume, rollouts
that were in flight at the kill are sampled again, never half-used.

The asynchronous modes need rollouts that run outside the trainer's ranks (``rollout.backend=vllm``); a teacher
whose ``score`` returns at once (the remote clients) also overlaps with the update.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_opd.data.batch import TrainBatch, pack_rollouts
from megatron_opd.interfaces import (
    RolloutBackend,
    Rollouts,
    RoutedScores,
    SamplingParams,
    TeacherBackend,
    TeacherPart,
    TeacherScores,
)

DEPTH = {"zero_step_off": 0, "one_step_off": 1, "two_step_off": 2}
"""Batches sampled ahead of the update in each ``scheduler.mode`` (= the staleness bound)."""


class PromptSource(Protocol):
    """The prompt stream (:class:`megatron_opd.data.stream.PromptStream`) as the scheduler uses it."""

    def next_batch(self) -> list: ...

    def state_dict(self) -> dict[str, Any]: ...


@dataclass
class ScoredBatch:
    """A step's rollouts, packed for training, with the teacher's scores and the phase times."""

    rollouts: Rollouts
    batch: TrainBatch
    scores: TeacherScores
    trained_version: int = 0
    """The policy version (optimizer step) of the weights this batch will update."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds. ``rollout``: from just before the back end's ``generate`` call (where a synchronous sampler does all
    its work) until the scheduler collected the rollouts; ``teacher``: from just before ``score`` until its future
    completed. ``wait_rollout`` / ``wait_teacher``: how long the trainer was blocked on each phase (inside the
    asking call plus waiting for the result): all of it for a synchronous back end, only what was not overlapped
    for an asynchronous one."""
    items: list = field(default_factory=list)
    """The prompt-stream items of this batch (this rank's prompts)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-batch figures of the data path (this rank's; e.g. ``cross_tokenizer/*``)."""

    @property
    def staleness(self) -> int:
        """Optimizer steps between the weights that sampled the rollouts and the weights they train."""
        return self.trained_version - self.rollouts.policy_version


@dataclass
class RoutedTeacher:
    """One of several teachers (``teachers.NAME``): its back end and, with another tokenizer, its re-tokenizer."""

    backend: TeacherBackend
    retokenizer: object | None = None


@dataclass
class _Request:
    """One teacher's request for its part of a batch."""

    name: str
    rows: list[int]
    future: Future
    asked: float
    part: TrainBatch
    """Its samples of the batch (a copy: the re-tokenizer's changes to the loss mask are written back)."""
    request: object | None = None
    """With another tokenizer: its view of the part (``cross_tokenizer.TeacherRequest``)."""
    done: float | None = None
    """When its future completed (``time.perf_counter``)."""


@dataclass
class _InFlight:
    """One batch on its way: drawn, asked of the rollout back end, then of the teacher."""

    items: list
    rollout: Future
    asked: float
    """When ``generate`` was called (``time.perf_counter``)."""
    blocked: float
    """Seconds the ``generate`` call itself took (a synchronous sampler's whole rollout)."""
    rollouts: Rollouts | None = None
    batch: TrainBatch | None = None
    teacher: Future | None = None
    timings: dict[str, float] = field(default_factory=dict)
    teacher_request: object | None = None
    """With a teacher of another tokenizer: its view of the batch (``cross_tokenizer.TeacherRequest``)."""
    requests: list[_Request] = field(default_factory=list)
    """With several teachers: one request per teacher with samples in the batch, all out at once."""


class Scheduler:
    """Draws each batch's prompts, asks the rollout and teacher back ends as early as ``mode`` allows, and hands
    the training loop one scored batch per step."""

    def __init__(
        self,
        mode: str,
        rollout: RolloutBackend,
        teacher: TeacherBackend,
        sampling: SamplingParams,
        n: int,
        *,
        data: PromptSource,
        seed_for: Callable[[int], int],
        pad_token_id: int,
        max_len: int,
        student_topk: int = 0,
        total_steps: int | None = None,
        retokenizer=None,
        teachers: dict[str, RoutedTeacher] | None = None,
        route: Callable[[dict], str] | None = None,
    ) -> None:
        """``seed_for(b)``: the sampling seed of batch ``b``; ``total_steps``: no batch past the last step is asked
        for (``train.steps``; None: no end). ``student_topk > 0``: the rollouts record the
        student's top-k ids and the teacher scores them too (union loss support); a teacher that cannot return
        log-probabilities at requested ids is refused here. ``retokenizer`` (``cross_tokenizer.CrossTokenizer``): the
        teacher has another tokenizer and scores its own re-tokenization of each batch. ``teachers`` with ``route``
        (``teachers.*``; ``teacher`` is then None): several teachers, ``route(record)`` naming the one that scores the
        samples of a record; each batch's samples are grouped by teacher and the requests go out together."""
        if mode not in DEPTH:
            raise ValueError(f"scheduler.mode must be one of {sorted(DEPTH)}, got {mode!r}")
        if DEPTH[mode] and not rollout.asynchronous:
            raise ValueError(
                f"scheduler.mode={mode} samples while the trainer trains, which needs rollouts outside the trainer's "
                f"ranks (rollout.backend=vllm); the {type(rollout).__name__} back end supports "
                "scheduler.mode=zero_step_off only"
            )
        if teachers is not None and route is None:
            raise ValueError("several teachers need route(record) -> the name of the teacher of its samples")
        backends = [t.backend for t in teachers.values()] if teachers is not None else [teacher]
        if student_topk and not all(b.supports_requested_logprobs for b in backends):
            raise ValueError(
                f"loss.support=union needs the teacher's log-probabilities at the student's top-k ids, which the "
                f"teacher back end {type(teacher).__name__} does not return (no requested_logprobs); use "
                "teacher.backend=inprocess or server, or loss.support=teacher_topk"
            )
        self.mode, self.depth = mode, DEPTH[mode]
        self.bound = self.depth + getattr(rollout, "sync_delay", 0)
        """The staleness bound: the mode's depth, plus the debug weight-sync delay (``scheduler.sync_delay``)."""
        self.teacher_depth = 1 if mode == "two_step_off" else 0
        """Batches scored by the teacher ahead of the update (two_step_off scores batch i+1 while i trains)."""
        self.rollout, self.teacher, self.data, self.seed_for = rollout, teacher, data, seed_for
        self.sampling = dataclasses.replace(sampling, return_topk=student_topk) if student_topk else sampling
        self.n, self.pad_token_id, self.max_len, self.student_topk = n, pad_token_id, max_len, student_topk
        self.retokenizer = retokenizer
        self.teachers, self.route = teachers, route
        self._flights: dict[int, _InFlight] = {}
        self._data_before: dict[int, dict[str, Any]] = {}
        self._next_asked: int | None = None
        self._next_scored = 0
        self._next_trained = 0
        self._end = total_steps

    def next_batch(self, step: int) -> ScoredBatch:
        """Batch ``step``, scored, for the update from the weights of policy version ``step``."""
        if self._next_asked is None:  # the first step of this process (0, or the step a resume starts at)
            self._next_asked = self._next_scored = self._next_trained = step
        if step != self._next_trained:
            raise RuntimeError(f"the scheduler hands out batch {self._next_trained} next, the loop asked for {step}")
        last = step + self.depth if self._end is None else min(step + self.depth, self._end - 1)
        while self._next_asked <= last:
            self._ask_rollout(self._next_asked)  # sampled by the weights of now: policy version ``step``
        while self._next_scored <= min(step + self.teacher_depth, last):
            self._ask_teacher(self._next_scored)
        flight = self._flights.pop(step)
        t0 = time.perf_counter()
        if self.teachers is not None:
            scores, metrics = self._collect(flight)
        else:
            scores, metrics = flight.teacher.result(), {}
        if flight.teacher_request is not None:  # the teacher's scores of its own tokens -> the student's positions
            scores = self.retokenizer.scores(scores, flight.teacher_request, flight.batch)
            metrics = flight.teacher_request.metrics
        flight.timings["wait_teacher"] += time.perf_counter() - t0
        self._next_trained = step + 1
        scored = ScoredBatch(flight.rollouts, flight.batch, scores, step, flight.timings, flight.items, metrics)
        if not 0 <= scored.staleness <= self.bound:
            raise RuntimeError(
                f"batch {step} was sampled by policy version {scored.rollouts.policy_version} and trains version "
                f"{step}: staleness {scored.staleness} is outside scheduler.mode={self.mode}'s bound of {self.bound}"
            )
        return scored

    def data_state(self) -> dict[str, Any]:
        """The prompt stream's position before the oldest batch not yet trained (what a checkpoint must save)."""
        for b in [b for b in self._data_before if b < self._next_trained]:
            del self._data_before[b]
        return self._data_before.get(self._next_trained) or self.data.state_dict()

    # ---- phases ------------------------------------------------------------------------------------------------
    def _ask_rollout(self, b: int) -> None:
        self._data_before[b] = dict(self.data.state_dict())
        items = self.data.next_batch()
        sampling = dataclasses.replace(self.sampling, seed=self.seed_for(b))
        asked = time.perf_counter()  # before the call: a synchronous sampler returns a completed future
        future = self.rollout.generate([it.prompt_ids for it in items], sampling, self.n)
        self._flights[b] = _InFlight(items, future, asked, blocked=time.perf_counter() - asked)
        self._next_asked = b + 1

    def _ask_teacher(self, b: int) -> None:
        flight = self._flights[b]
        t0 = time.perf_counter()
        flight.rollouts = flight.rollout.result()
        done = time.perf_counter()
        flight.timings.update(rollout=done - flight.asked, wait_rollout=flight.blocked + done - t0)
        flight.batch = pack_rollouts(
            flight.rollouts, pad_token_id=self.pad_token_id, max_len=self.max_len, student_topk=self.student_topk
        )
        # Also ask for the teacher's log-probability of each sampled token (teacher-confidence weights, metrics)
        # and, for the union support, of the student's top-k ids.
        asked = time.perf_counter()
        if self.teachers is not None:
            self._ask_teachers(flight, asked)
        elif self.retokenizer is not None:  # the teacher's own tokens for the same texts
            request = self.retokenizer.request(flight.batch, flight.rollouts, [it.record for it in flight.items])
            flight.teacher_request = request
            flight.teacher = self.teacher.score(request.tokens, request.request_ids, request.lengths)
        else:
            flight.teacher = self.teacher.score(
                flight.batch.tokens, flight.batch.teacher_request_ids(), flight.batch.lengths
            )
        flight.timings["wait_teacher"] = time.perf_counter() - asked  # a synchronous teacher scores inside score()
        if flight.teacher is not None:
            flight.teacher.add_done_callback(
                lambda _: flight.timings.setdefault("teacher", time.perf_counter() - asked)
            )
        self._next_scored = b + 1

    def _ask_teachers(self, flight: _InFlight, asked: float) -> None:
        """Several teachers: each sample to the teacher its record names; every teacher's request goes out before
        any is waited for, so a slow or restarting teacher delays only its own part."""
        records = [it.record for it in flight.items]
        names = [self.route(records[g]) for g in flight.rollouts.prompt_index]
        for name in self.teachers:  # config order: the same on every rank
            rows = [i for i, n in enumerate(names) if n == name]
            if not rows:
                if getattr(self.teachers[name].backend, "lockstep", None) is not None:
                    # Its MoE layers exchange tokens with the ranks that have samples for it: join with none.
                    self.teachers[name].backend.score(flight.batch.tokens[:0], None, []).result()
                continue
            teacher, part = self.teachers[name], flight.batch.select(rows)
            if teacher.retokenizer is not None:
                request = teacher.retokenizer.request(part, flight.rollouts.select(rows), records)
                # Tokens it cannot compare are not trained on: its mask of them, in the whole batch too.
                flight.batch.loss_mask[torch.tensor(rows)] = part.loss_mask
                future = teacher.backend.score(request.tokens, request.request_ids, request.lengths)
            else:
                request = None
                future = teacher.backend.score(part.tokens, part.teacher_request_ids(), part.lengths)
            req = _Request(name, rows, future, asked, part, request)
            future.add_done_callback(lambda _, req=req: setattr(req, "done", time.perf_counter()))
            flight.requests.append(req)

    def _collect(self, flight: _InFlight) -> tuple[RoutedScores, dict[str, float]]:
        """The teachers' scores of a batch, each part in the student's positions, with per-teacher figures."""
        parts, metrics = [], {}
        for req in flight.requests:
            scores = req.future.result()
            if req.request is not None:
                scores = self.teachers[req.name].retokenizer.scores(scores, req.request, req.part)
                metrics.update({f"teacher/{req.name}/{k}": v for k, v in req.request.metrics.items()})
            parts.append(TeacherPart(req.name, req.rows, scores))
            metrics[f"teacher/{req.name}/samples"] = float(len(req.rows))
            metrics[f"teacher/{req.name}/latency"] = (req.done or time.perf_counter()) - req.asked
            retries = _client_retries(self.teachers[req.name].backend)
            if retries is not None:  # the rank that asks (the first TP rank of the last stage)
                metrics[f"teacher/{req.name}/retries"] = float(retries)
        flight.timings["teacher"] = max((metrics[f"teacher/{r.name}/latency"] for r in flight.requests), default=0.0)
        return RoutedScores(parts), metrics


def _client_retries(backend) -> int | None:
    """Requests a remote teacher's client has retried so far (its failures), through the wrappers around it."""
    for _ in range(4):
        stats = getattr(backend, "stats", None)
        if isinstance(stats, dict) and "retries" in stats:
            return int(stats["retries"])
        backend = getattr(backend, "backend", None)
    return None


def build_scheduler(mode: str, rollout: RolloutBackend, teacher: TeacherBackend, **kwargs) -> Scheduler:
    """The scheduler for ``scheduler.mode``."""
    return Scheduler(mode, rollout, teacher, **kwargs)
