"""The contracts between the trainer and its pluggable back ends: rollout, teacher, scheduler.

The training loop calls one object per back end. Back ends return handles (``concurrent.futures.Future``)
so a scheduler can overlap them; the in-process back ends run collectives on every rank and hand back an
already completed future.

- ``Rollouts``: what a rollout back end produces for a batch of prompts (one entry per sample).
- ``TeacherScores``: what a teacher back end produces for the packed batch of those rollouts.
- ``policy_version``: the optimizer step of the weights that produced a rollout (0 = initial weights).

Shape legend: ``N`` samples (prompts x ``n``), ``S`` padded sequence positions, ``K`` teacher top-k,
``R`` requested ids per position, ``V`` this rank's vocabulary shard.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


def completed(value: T) -> Future[T]:
    """A future that already holds ``value`` (for back ends that run synchronously on every rank)."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


class DeferredFuture(Future):
    """A future whose value is computed by ``fn`` on the first ``result()``, by the caller's thread.

    For handles whose completion is a collective (e.g. scattering rollouts from rank 0): every rank calls
    ``result()`` at the same point of its program, so the collective runs in order on every rank while the work
    behind it (an engine process, a server) proceeds in the background until then.
    """

    def __init__(self, fn) -> None:
        super().__init__()
        self._fn = fn

    def result(self, timeout: float | None = None):
        if not self.done():
            try:
                self.set_result(self._fn())
            except BaseException as err:  # noqa: BLE001 - kept in the future, raised to the caller
                self.set_exception(err)
        return super().result(timeout)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a response. ``top_k=0`` and ``top_p=1.0`` mean off; ``temperature=0`` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these ids (they are kept in the response and trained on)."""
    seed: int = 0
    """Sampling seed; the same seed, prompts and weights give the same samples at any TP size."""
    return_topk: int = 0
    """Also record the ``k`` most probable ids at each generated position (``Rollouts.topk_ids``); 0: off."""
    return_routes: bool = False
    """Also record the experts each token was routed to in each MoE layer (``Rollouts.routes``)."""

    @property
    def truncates(self) -> bool:
        """Whether the draws come from another distribution than the model's own at temperature 1 (a temperature
        other than 1, top-k or top-p; greedy decoding draws nothing)."""
        return self.temperature not in (0.0, 1.0) or self.top_k > 0 or self.top_p < 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p must be in (0, 1] (1.0 is off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 is off), got {self.top_k}")
        if self.return_topk < 0:
            raise ValueError(f"return_topk must be >= 0 (0 is off), got {self.return_topk}")


@dataclass
class Rollouts:
    """Sampled responses, one entry per sample, grouped by prompt (``prompt_index``).

    Token lists are 1-D int64 tensors on the CPU. ``response_mask`` is 1 for tokens the model generated and 0 for
    tokens inserted by a tool or environment (never trained on). ``logprobs`` are the log-probabilities of the
    response tokens under the sampling policy's *unmodified* distribution (temperature 1, no top-k/top-p), as vLLM
    returns by default; 0 where ``response_mask`` is 0.
    """

    prompt_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    response_mask: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    """``"stop"`` (a stop token was produced) or ``"length"`` (max_new_tokens reached)."""
    prompt_index: list[int]
    """Index of each sample's prompt within the batch of prompts (samples of one prompt are adjacent)."""
    policy_version: int = 0
    topk_ids: list[torch.Tensor] | None = None
    """With ``SamplingParams.return_topk = k``: per sample ``[response_len, k]`` int64, the sampling policy's ``k``
    most probable ids at each response position, most probable first (of its raw logits: temperature, top-k and
    top-p do not change them). The union loss support (``loss.support=union``) reads them; a vLLM engine provides
    them with ``logprobs=k``. Rows of tool tokens (response mask 0) are never read."""
    routes: list[torch.Tensor] | None = None
    """With ``SamplingParams.return_routes`` (``rollout.routing_replay``, MoE students): per sample
    ``[prompt_len + response_len, M, k]`` int16, the ``k`` experts the sampler routed each position's token to in each
    of the ``M`` MoE layers (``-1``: not routed, e.g. the last token). The trainer replays them."""
    drawn_logprobs: list[torch.Tensor] | None = None
    """Where the sampling truncates (``SamplingParams.truncates``): per sample the log-probability of each response
    token under the distribution it was drawn from (after temperature, top-k and top-p; ``rollout.sampling.
    drawn_logprobs``), which the staleness and rollout corrections compare with the trainer's; None where the back
    end does not record it (vLLM servers; the trainer's vLLM engine without a correction) or nothing truncates. 0 where
    ``response_mask`` is 0."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        names = ["prompt_ids", "response_mask", "logprobs", "finish_reasons", "prompt_index"]
        optional = [name for name in ("topk_ids", "routes", "drawn_logprobs") if getattr(self, name) is not None]
        for name in names + optional:
            if len(getattr(self, name)) != n:
                raise ValueError(f"Rollouts.{name} has {len(getattr(self, name))} entries, response_ids has {n}")

    @property
    def response_lengths(self) -> list[int]:
        return [int(r.numel()) for r in self.response_ids]

    def select(self, rows: list[int]) -> Rollouts:
        """The samples ``rows`` (their ``prompt_index`` unchanged: still indices into the batch's prompts)."""
        pick = lambda values: None if values is None else [values[i] for i in rows]  # noqa: E731
        return Rollouts(
            pick(self.prompt_ids), pick(self.response_ids), pick(self.response_mask), pick(self.logprobs),
            pick(self.finish_reasons), pick(self.prompt_index), self.policy_version, pick(self.topk_ids),
            pick(self.routes),
            pick(self.drawn_logprobs),
        )  # fmt: skip


@dataclass
class TeacherScores:
    """The teacher's view of a packed batch ``[N, S]`` of token sequences (see ``data.batch.TrainBatch``).

    Position ``s`` holds the teacher's distribution of the token at ``s + 1`` (next-token, like logits).
    Exactly one of ``dense_logits`` / ``dense_hidden`` / ``topk_ids`` is set. Log-probabilities are at the teacher
    temperature.
    """

    topk_ids: torch.Tensor | None = None
    """``[N, S, K]`` int64 global token ids, most probable first, never a padded vocabulary column."""
    topk_logprobs: torch.Tensor | None = None
    """``[N, S, K]`` float32 log-probabilities at ``topk_ids`` (normalised over the full vocabulary)."""
    dense_logits: torch.Tensor | None = None
    """Colocated teachers only: this rank's ``[N, S, V]`` logit shard (raw logits; on the last pipeline stage)."""
    dense_hidden: torch.Tensor | None = None
    """Colocated teachers only, instead of ``dense_logits``: the final hidden states ``[N, S, H]`` (last pipeline
    stage); the loss forms the logits a chunk at a time as ``dense_hidden @ output_weight^T``."""
    output_weight: torch.Tensor | None = None
    """With ``dense_hidden``: this rank's ``[V, H]`` shard of the teacher's output layer (a reference, not a copy)."""
    requested_logprobs: torch.Tensor | None = None
    """``[N, S, R]`` float32 log-probabilities at the ids the request listed (e.g. the sampled next token)."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TeacherPart:
    """One teacher's share of a batch scored by several teachers (``teachers.*``)."""

    name: str
    rows: list[int]
    """The batch's samples this teacher scored, in batch order."""
    scores: TeacherScores
    """Its scores of those samples only (``[len(rows), S, ...]``, positions as in the batch)."""


@dataclass
class RoutedScores:
    """A batch scored by several teachers, each sample by the one its record names; every sample in one part."""

    parts: list[TeacherPart]


@runtime_checkable
class RolloutBackend(Protocol):
    """Samples responses from the student's current weights."""

    asynchronous: bool
    """Whether rollouts run outside the trainer's ranks, so they can overlap the update (the scheduler's
    one- and two-step-off modes need it)."""
    policy_version: int
    """The optimizer steps applied to the weights that sample now."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int) -> Future[Rollouts]:
        """Sample ``n`` responses per prompt; the future resolves to ``Rollouts`` (samples of a prompt adjacent)."""
        ...

    def sync_weights(self, policy_version: int) -> None:
        """Make the next rollouts use the trainer's weights after optimizer step ``policy_version``."""
        ...

    def close(self) -> None:
        """Release what the back end started (an engine process); the trainer calls it once, at the end."""
        ...


@runtime_checkable
class TeacherBackend(Protocol):
    """Scores packed token sequences with the frozen teacher."""

    supports_dense: bool
    """Whether ``score`` can return dense logit shards (only a teacher colocated with the student's layout)."""
    supports_requested_logprobs: bool
    """Whether ``score`` returns ``requested_logprobs`` at any ``request_ids`` (the union loss support needs them
    at the student's top-k ids; a back end without them is refused at start-up for ``loss.support=union``)."""

    def score(
        self, tokens: torch.Tensor, request_ids: torch.Tensor | None = None, lengths: list[int] | None = None
    ) -> Future[TeacherScores]:
        """Score ``tokens`` ``[N, S]``; ``request_ids`` ``[N, S, R]`` asks for log-probabilities at those ids.
        ``lengths``: each row's real tokens (the rest is padding), so a back end may skip the padding; scores at
        padded positions are then any valid ones (nothing trains on them)."""
        ...
