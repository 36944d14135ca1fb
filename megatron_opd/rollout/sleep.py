"""Trainer-driven sleep mode of a colocated vLLM engine (``rollout.vllm_sleep``, GPU).

vLLM's ``sleep(level=1)`` frees the engine's GPU memory (weights offloaded, KV cache dropped) so the trainer can
use it for the teacher and the update. The trainer decides when: the engine sleeps once the last rollout it was
asked for has been collected, wakes its *weights* before a weight sync (the sync writes into them) and its *KV
cache* only before the next rollout, so a sync never competes with the KV cache for memory. With the
asynchronous scheduler modes a rollout is always in flight, so the engine never sleeps (they are refused with it).
"""

from __future__ import annotations

from collections.abc import Callable

AWAKE, ASLEEP, WEIGHTS_ONLY = "awake", "asleep", "weights_only"


class SleepCycle:
    """Sends ``sleep`` / ``wake_up(tags=...)`` to an engine at the points of the training loop that allow them."""

    def __init__(self, call: Callable[..., object], enabled: bool) -> None:
        """``call(method, **kwargs)``: the engine's control call (an engine process, or every server of a group)."""
        self.call, self.enabled, self.state = call, enabled, AWAKE

    def rollouts_collected(self, outstanding: int) -> None:
        """After a rollout was collected: sleep when no other is outstanding."""
        if self.enabled and outstanding == 0 and self.state == AWAKE:
            self.call("sleep", level=1)
            self.state = ASLEEP

    def before_sync(self) -> None:
        """Before a weight sync: the weights must be resident; the KV cache may stay freed."""
        if self.state == ASLEEP:
            self.call("wake_up", tags=["weights"])
            self.state = WEIGHTS_ONLY

    def before_rollout(self) -> None:
        """Before asking for a rollout: weights (if still asleep) first, then the KV cache."""
        self.before_sync()
        if self.state == WEIGHTS_ONLY:
            self.call("wake_up", tags=["kv_cache"])
            self.state = AWAKE
