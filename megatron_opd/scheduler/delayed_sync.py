"""A debug back end that samples with older weights: staleness without the asynchronous machinery.

``scheduler.sync_delay = k`` (``zero_step_off``, built-in sampler): each rollout is sampled by the weights of ``k``
optimizer steps before the ones it trains (fewer while the run is younger than ``k`` steps), as ``k``-step-off
does, but in sequence, with the same sampler, teacher and pairing as the synchronous mode. A run at ``k = 1, 2``
beside one at ``k = 0`` measures what staleness alone costs per step; one beside ``one_step_off`` /
``two_step_off`` shows whether their machinery costs anything on top (``benchmarks/bench_scheduler.py --quality``).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from megatron_opd.interfaces import Rollouts, SamplingParams, completed


class DelayedSync:
    """Wraps a synchronous rollout back end that samples from ``params`` (the student's own tensors, as the built-in
    sampler does): keeps a copy of them per policy version and swaps the one ``delay`` versions back in for each
    ``generate``. Costs ``delay + 1`` copies of this rank's parameters."""

    asynchronous = False

    def __init__(self, rollout, params: list[torch.Tensor], delay: int) -> None:
        if rollout.asynchronous:
            raise ValueError("scheduler.sync_delay needs a rollout back end that samples from the trainer's tensors")
        if delay < 1:
            raise ValueError(f"a sync delay must be >= 1 step, got {delay}")
        self.inner, self.params, self.sync_delay = rollout, params, delay
        self._copies: dict[int, list[torch.Tensor]] = {}
        self._latest: int | None = None

    @property
    def policy_version(self) -> int:
        """The version of the weights that sample now: ``delay`` behind the trainer's (not before the first)."""
        return min(self._copies)

    def sync_weights(self, policy_version: int) -> None:
        self._copies[policy_version] = [p.detach().clone() for p in self.params]
        self._latest = policy_version
        for version in [v for v in self._copies if v < policy_version - self.sync_delay]:
            del self._copies[version]
        self.inner.sync_weights(self.policy_version)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int) -> Future[Rollouts]:
        if self.policy_version == self._latest:
            return self.inner.generate(prompt_token_ids, sampling, n)
        with torch.no_grad():
            for p, old in zip(self.params, self._copies[self.policy_version]):
                p.copy_(old)
            try:
                return completed(self.inner.generate(prompt_token_ids, sampling, n).result())
            finally:  # the trainer's weights back, whatever happened
                for p, now in zip(self.params, self._copies[self._latest]):
                    p.copy_(now)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):  # the wrapped back end's other attributes
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
