"""Fault-injection points for the fault tests: a process killed or paused at a named place, set by environment
variables that runs never set otherwise (``MEGATRON_OPD_FAULT=name:step``, ``MEGATRON_OPD_HOLD=steps@DIR``)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

FAULT_ENV = "MEGATRON_OPD_FAULT"
HOLD_ENV = "MEGATRON_OPD_HOLD"


def fault_point(name: str, step: int) -> None:
    """Kill this process here when ``MEGATRON_OPD_FAULT=name:step`` (fault-injection tests; never set otherwise)."""
    if os.environ.get(FAULT_ENV) == f"{name}:{step}":
        import psutil

        logger.error("fault injection: %s at step %d", name, step)
        # dist_checkpointing's helper processes (a multiprocessing manager) die with us, as under a job kill.
        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(17)


def hold_point(step: int, timeout_s: float = 900.0) -> None:
    """Pause after ``step`` when ``MEGATRON_OPD_HOLD=steps@DIR`` names it, until ``DIR/release_<step>`` exists
    (fault-injection tests; never set otherwise)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    steps, folder = spec.split("@", 1)
    if str(step) not in steps.split(","):
        return

    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(folder) / f"held_{step}").touch()
    logger.warning("fault injection: holding after step %d until %s/release_%d exists", step, folder, step)
    deadline = time.monotonic() + timeout_s
    while not (Path(folder) / f"release_{step}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"fault injection: nobody released the hold after step {step}")
        time.sleep(0.2)
