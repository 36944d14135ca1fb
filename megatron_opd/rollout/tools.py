"""Multi-turn tool rollouts: the model calls a tool with a stop string, the tool's answer joins the response.

:class:`ToolRollout` wraps any rollout back end. Each turn samples a continuation of prompt + response so far; when
the model's text reaches the tool-call stop string (``</calc>``), the turn is cut right after it (tokens sampled
past the call are dropped: the policy continues from the tool's answer instead), the user function
``module:function(call_text) -> str`` answers, and its text is tokenized and appended with response mask 0 and
log-probability 0. So the loss never sees tool tokens (``data.batch`` turns mask 0 into loss mask 0) while the
student and teacher still read them as context. Up to ``max_turns`` model turns; a call in the last turn gets no
answer. The whole response (model and tool tokens) stays within ``sampling.max_new_tokens``.

Inner back ends may be collective over all ranks (vLLM) or a tensor-parallel group (built-in sampler): every rank
runs the same number of turns (an all-reduce of "any row still calling"), and a rank with nothing left to continue
samples one throw-away token to keep the collective in step.

Over an asynchronous back end (vLLM) the first turn is asked at once and the later turns when the rollout is
collected (``result()``, which every rank calls at the same point), so the scheduler's asynchronous modes work with
tool turns. A later turn may then be sampled by newer weights than the first (the weights synced in between); the
rollout is tagged with its *oldest* turn's policy version, so the staleness the scheduler counts and bounds is the
largest of its turns'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import torch

from megatron_opd.distributed.lockstep import agree_count
from megatron_opd.interfaces import DeferredFuture, RolloutBackend, Rollouts, SamplingParams, completed


@dataclasses.dataclass
class _Row:
    prompt: list[int]
    prompt_index: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    topk_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # ``[len, k]`` per turn and tool answer
    finish: str = "length"
    calling: bool = False


def cut_at_stop_string(tokens: list[int], decode: Callable[[list[int]], str], stop: str) -> int | None:
    """The length of the shortest prefix of ``tokens`` whose text contains ``stop`` (None if none does)."""
    if stop not in decode(tokens):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:  # the prefix text grows with the prefix, so the first containing prefix is found by bisection
        mid = (lo + hi) // 2
        if stop in decode(tokens[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class ToolRollout:
    """:class:`~megatron_opd.interfaces.RolloutBackend` that adds tool turns to an inner back end's rollouts."""

    def __init__(
        self,
        inner: RolloutBackend,
        tokenizer,
        tool: Callable[[str], str],
        *,
        stop: str,
        max_turns: int,
    ) -> None:
        """``tokenizer``: encodes the tool's text, decodes the model's (``decode``/``encode``); ``tool``: the user
        function; ``stop``: the text that ends a tool call; ``max_turns``: model turns per sample (>= 1)."""
        if max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {max_turns}")
        if not stop:
            raise ValueError("rollout.tool_stop must be a non-empty string (the text that ends a tool call)")
        self.inner = inner
        self.tokenizer = tokenizer
        self.tool = tool
        self.stop = stop
        self.max_turns = max_turns

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def asynchronous(self) -> bool:
        """As the inner back end: the later turns run when the rollout is collected."""
        return self.inner.asynchronous

    def sync_weights(self, policy_version: int) -> None:
        self.inner.sync_weights(policy_version)

    def score(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        """The inner engine's log-probabilities of ``sequences`` (the rollout start-up check's probe)."""
        return self.inner.score(sequences)

    def close(self) -> None:
        self.inner.close()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _take_turn(self, row: _Row, out: Rollouts, i: int, budget: int, last_turn: bool) -> None:
        """Append one model turn to ``row``; cut it at a tool call and append the tool's answer."""
        ids, lps = out.response_ids[i].tolist(), out.logprobs[i].tolist()
        cut = None if last_turn else cut_at_stop_string(ids, self._decode, self.stop)
        if cut is not None:
            ids, lps = ids[:cut], lps[:cut]
        row.tokens += ids
        row.mask += [1] * len(ids)
        row.logprobs += lps
        if out.topk_ids is not None:  # loss.support=union: the sampler's top-k of each model token
            row.topk_ids.append(out.topk_ids[i][: len(ids)])
        row.finish, row.calling = out.finish_reasons[i], False
        if cut is None:
            return
        answer = self.tokenizer.encode(self.tool(self._decode(ids)), add_special_tokens=False)
        room = budget - len(row.tokens) - 1  # leave room for at least one more model token
        if room < 1:
            row.finish = "length"
            return
        answer = answer[:room]
        row.tokens += answer
        row.mask += [0] * len(answer)
        row.logprobs += [0.0] * len(answer)
        if out.topk_ids is not None:  # a tool token's rows are never read (response mask 0)
            row.topk_ids.append(out.topk_ids[i].new_zeros(len(answer), out.topk_ids[i].shape[-1]))
        row.calling = True

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int) -> Future[Rollouts]:
        first = self.inner.generate(prompt_token_ids, sampling, n)
        if self.asynchronous:
            return DeferredFuture(lambda: self._turns(first.result(), sampling))
        return completed(self._turns(first.result(), sampling))

    def _turns(self, first: Rollouts, sampling: SamplingParams) -> Rollouts:
        """The first turn's rollouts with the later turns (and the tool's answers) appended."""
        version = first.policy_version
        rows = [_Row(p.tolist(), g) for p, g in zip(first.prompt_ids, first.prompt_index)]
        budget = sampling.max_new_tokens
        for i, row in enumerate(rows):
            self._take_turn(row, first, i, budget, last_turn=self.max_turns == 1)
        for turn in range(1, self.max_turns):
            active = [r for r in rows if r.calling]
            if not agree_count(int(bool(active))):  # every rank takes as many turns
                break
            step = dataclasses.replace(sampling, seed=sampling.seed + 7919 * turn)
            if not active:  # keep a collective back end in step; the sample is thrown away
                self.inner.generate([rows[0].prompt], dataclasses.replace(step, max_new_tokens=1), 1).result()
                continue
            contexts = [r.prompt + r.tokens for r in active]
            remaining = min(budget - len(r.tokens) for r in active)
            out = self.inner.generate(contexts, dataclasses.replace(step, max_new_tokens=max(1, remaining)), 1).result()
            if out.policy_version < version:
                raise RuntimeError(f"tool turn {turn} sampled by version {out.policy_version}, turn 0 by {version}")
            for i, row in enumerate(active):
                self._take_turn(row, out, i, budget, last_turn=turn == self.max_turns - 1)
        as_tensor = dict(dtype=torch.int64)
        return Rollouts(
            prompt_ids=[torch.tensor(r.prompt, **as_tensor) for r in rows],
            response_ids=[torch.tensor(r.tokens, **as_tensor) for r in rows],
            response_mask=[torch.tensor(r.mask, **as_tensor) for r in rows],
            logprobs=[torch.tensor(r.logprobs, dtype=torch.float32) for r in rows],
            finish_reasons=[r.finish for r in rows],
            prompt_index=[r.prompt_index for r in rows],
            policy_version=version,  # the oldest turn's: staleness is counted from it
            topk_ids=[torch.cat(r.topk_ids) for r in rows] if first.topk_ids is not None else None,
        )
