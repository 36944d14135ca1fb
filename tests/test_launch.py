"""The trainer under a real multi-node torchrun: two single-process nodes rendezvous over loopback (TP=2 across
them) and distil, as two machines would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from megatron_opd.testing.distill_fixture import make_distill_fixture
from megatron_opd.testing.multiprocess import find_free_port


def test_trainer_two_nodes(tmp_path):
    pair = make_distill_fixture(tmp_path / "pair")
    port = find_free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    overrides = pair.overrides(
        tmp_path / "run", **{"parallel.tensor_model_parallel_size": 2, "train.steps": 2, "export_hf": False}
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *common,
                f"--node-rank={r}",
                "-m",
                "megatron_opd.train",
                *overrides,
            ],
            cwd=tmp_path,  # outside the repository: the package as installed
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    outs = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=300)
            outs.append(out)
            assert node.returncode == 0, out[-3000:]
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert "TP=2" in outs[0]
