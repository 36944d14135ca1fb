"""Start-up waits for servers (teacher servers, vLLM rollout servers) that say what they wait for.

A server may still be loading when the trainer starts, so start-up waits for it; but a silent wait cannot be told
from a wrong address. While waiting, a line ``waiting for WHAT (N s of M s, KEY)`` is logged every
``PROGRESS_EVERY_S``, and after the config key's budget the caller stops with an error naming the address and key.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
"""Seconds between progress lines."""


class StartupWait:
    """The budget of one start-up wait: ``budget_s`` seconds, set by config key ``key``, for ``what``."""

    def __init__(self, what: str, budget_s: float, key: str) -> None:
        self.what, self.budget_s, self.key = what, budget_s, key
        self.started = time.monotonic()
        self._next_line = self.started + PROGRESS_EVERY_S

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def remaining(self) -> float:
        return max(self.budget_s - self.elapsed(), 0.0)

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def progress(self, last_error: str = "") -> None:
        """Log a progress line when one is due (call it once per attempt)."""
        now = time.monotonic()
        if now < self._next_line:
            return
        self._next_line = now + PROGRESS_EVERY_S
        detail = f"; last error: {last_error}" if last_error else ""
        logger.info("waiting for %s (%.0f s of %g s, %s)%s", self.what, self.elapsed(), self.budget_s, self.key, detail)

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or what is left of the budget if less."""
        time.sleep(min(seconds, self.remaining()))
