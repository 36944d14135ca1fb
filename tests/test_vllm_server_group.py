"""The group of vLLM rollout servers (``rollout.address``) against stand-in HTTP servers (no vLLM needed): a server
that drops its connection mid-rollout fails the rollout at once, and servers that never answer stop start-up after
``rollout.server_wait_s`` with an error naming them, with progress logged meanwhile. Real servers:
``test_vllm_server.py``."""

from __future__ import annotations

import logging
import time

import pytest

from megatron_opd import server_wait
from megatron_opd.rollout.vllm_server import ServerDown, ServerGroup
from megatron_opd.testing.multiprocess import find_free_port
from megatron_opd.testing.rollout_fakes import FakeRolloutServer

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop_token_ids": [], "seed": 1, "max_new_tokens": 2}


@pytest.fixture
def servers():
    started: list[FakeRolloutServer] = []
    yield started
    for server in started:
        server.stop()


def test_rollout_fails_at_once_when_a_server_drops_its_connection(servers):
    """Row 0 goes to a slow server, row 1 to one that drops the connection: the failure does not wait for row 0.

    The slow server answers after 30 s and the bound is half that, so a loaded CI machine (1.7 s seen with a 3 s
    server and a 1.5 s bound) cannot fail the test while a rollout that waits for row 0 still does."""
    servers.extend([FakeRolloutServer(delay_s=30.0), FakeRolloutServer(mode="drop")])
    group = ServerGroup([s.address for s in servers], timeout_s=60, max_model_len=64)
    t0 = time.monotonic()
    with pytest.raises(ServerDown, match=f"vLLM server {servers[1].address} is down or unreachable"):
        group.call("generate", prompts=[[1, 2], [3, 4]], sampling=SAMPLING, n=1)
    assert time.monotonic() - t0 < 15.0, "the rollout waited for the slow server before failing"
    group.close()


def test_live_servers_answer(servers):
    servers.extend([FakeRolloutServer(), FakeRolloutServer()])
    group = ServerGroup([s.address for s in servers], timeout_s=60, max_model_len=64)
    out = group.call("generate", prompts=[[1, 2], [3, 4]], sampling=SAMPLING, n=2)
    assert out["tokens"] == [[7, 8]] * 4 and out["version"] == 3 and out["finish_reasons"] == ["length"] * 4
    group.close()


def test_no_server_stops_start_up_after_server_wait_naming_it(caplog, monkeypatch):
    monkeypatch.setattr(server_wait, "PROGRESS_EVERY_S", 0.2)
    caplog.set_level(logging.INFO, logger=server_wait.__name__)
    address = f"127.0.0.1:{find_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServerDown, match="no vLLM server answered within rollout.server_wait_s=1 s") as info:
        ServerGroup([address], timeout_s=60, max_model_len=64, wait_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 10.0 and address in str(info.value)  # waited its 1 s, then stopped
    assert f"waiting for vLLM server at {address} (" in caplog.text and "of 1 s, rollout.server_wait_s)" in caplog.text
