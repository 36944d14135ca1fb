"""The built-in sampler against transformers, a chi-square test of its draws, TP=2 against TP=1, stops and limits,
and the vocab-parallel sampling functions on hand-made logits split over two gloo ranks.

Every model test spawns ranks with ``run_distributed`` (Megatron-Core needs a process group) and groups its checks
in one job, since each spawn costs seconds. References run in this process: transformers in float32 and float64
full-vocabulary maths.

Shape legend: ``B`` rows, ``V`` full (padded) vocabulary, ``W`` one rank's shard.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_opd.interfaces import RolloutBackend, Rollouts, SamplingParams
from megatron_opd.losses.vocab_parallel import make_vocab_shard
from megatron_opd.rollout.sampling import processed_logits, sample_next, token_logprobs
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import SHAPES, shapes_at

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16], [100], [7, 8, 9, 10, 200]]
MAX_NEW = 10


# ---------------------------------------------------------------------------------------------------------------
# Helpers that run on the spawned ranks


def _build_sampler(hf_dir: str, parallel, **sampler_kwargs):
    """Load ``hf_dir`` as a trainable student under ``parallel`` (groups already initialised) and wrap it."""
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.rollout import BuiltinSampler

    arch, chunks = build_and_load(hf_dir, parallel, trainable=True)
    kwargs = dict(vocab_size=arch.vocab_size, max_seq_len=64, pad_token_id=0)
    kwargs.update(sampler_kwargs)
    return chunks, BuiltinSampler(chunks, **kwargs)


def _greedy_body(layouts: dict[str, dict], models: dict[str, tuple[str, list[list[int]]]]):
    """Greedy rollouts of every model (name -> (HF folder, its prompts)) under every layout (re-initialised in this
    job), n=2."""
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel

    out = {}
    for i, (label, layout) in enumerate(layouts.items()):
        parallel = ParallelConfig(**layout)
        (initialize_distributed if i == 0 else initialize_model_parallel)(parallel)
        for name, (hf_dir, prompts) in models.items():
            chunks, sampler = _build_sampler(hf_dir, parallel)
            sampler.sync_weights(3)
            rollouts = sampler.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0), n=2).result()
            out[label, name] = (rollouts, chunks[0].training)
    return out


def _first_token_body(hf_dir: str, prompt: list[int], sampling: SamplingParams, n: int) -> Rollouts:
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    _, sampler = _build_sampler(hf_dir, parallel)
    return sampler.generate([prompt], sampling, n=n).result()


def _tp_equivalence_body(hf_dir: str, samplings: list[SamplingParams]):
    """The same sampling at TP=1 (two data-parallel copies) and then TP=2, in one job."""
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel

    out = {}
    for tp in (1, 2):
        parallel = ParallelConfig(tensor_model_parallel_size=tp)
        (initialize_distributed if tp == 1 else initialize_model_parallel)(parallel)
        _, sampler = _build_sampler(hf_dir, parallel)
        out[tp] = [sampler.generate(PROMPTS, s, n=2).result() for s in samplings]
    return out


def _topk_ids_body(hf_dir: str, sampling: SamplingParams):
    """The same sampling with and without ``return_topk``, at TP=1 and then TP=2, in one job."""
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel

    out = {}
    for tp in (1, 2):
        parallel = ParallelConfig(tensor_model_parallel_size=tp)
        (initialize_distributed if tp == 1 else initialize_model_parallel)(parallel)
        _, sampler = _build_sampler(hf_dir, parallel)
        plain = sampler.generate(PROMPTS, replace(sampling, return_topk=0), n=2).result()
        out[tp] = (sampler.generate(PROMPTS, sampling, n=2).result(), plain)
    return out


def _stop_and_limits_body(hf_dir: str):
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    chunks, sampler = _build_sampler(hf_dir, parallel)
    out = {"is_backend": isinstance(sampler, RolloutBackend)}
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    out["free"] = sampler.generate(PROMPTS, sampling, n=2).result()
    free_ids = [r.tolist() for r in out["free"].response_ids]
    # A stop id that occurs mid-way in some rows; the noise stream does not depend on stops, so each row must be its
    # free run cut after the first stop id.
    stop_id = free_ids[0][3]
    out["stop_id"] = stop_id
    out["stopped"] = sampler.generate(PROMPTS, replace(sampling, stop_token_ids=(stop_id,)), n=2).result()
    # Every row stops on its first token: generation must end as soon as the longest prompt has its first token.
    calls = []
    hook = chunks[0].register_forward_hook(lambda *_: calls.append(1))
    first_ids = tuple(sorted({ids[0] for ids in free_ids}))
    all_stop = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, stop_token_ids=first_ids)
    out["all_stop"] = sampler.generate(PROMPTS, all_stop, n=2).result()
    hook.remove()
    out["all_stop_forwards"] = len(calls)
    # max_seq_len caps prompt + response.
    _, short = _build_sampler(hf_dir, parallel, max_seq_len=8)
    out["capped"] = short.generate([[1, 2, 3], [1, 2, 3, 4, 5, 6]], SamplingParams(max_new_tokens=10), n=1).result()
    # A tokenizer smaller than the model's vocabulary: ids at or above it are never sampled, not even greedily.
    _, small = _build_sampler(hf_dir, parallel, vocab_size=500)
    out["small_vocab"] = small.generate(
        [[3, 4]], SamplingParams(max_new_tokens=4, temperature=1.5, seed=1), n=256
    ).result()
    out["small_vocab_greedy"] = small.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0), n=1).result()
    out["training_after"] = chunks[0].training
    errors = {}
    bad_inputs = {
        "is empty": ([[]], SamplingParams(), 1),
        "leaves no room": ([list(range(1, 65))], SamplingParams(), 1),
        "outside the vocabulary": ([[1, 1000]], SamplingParams(), 1),
        "stop_token_ids": ([[1]], SamplingParams(stop_token_ids=(1000,)), 1),
        "n (samples": ([[1]], SamplingParams(), 0),
        "return_topk=1001 asks for more ids": ([[1]], SamplingParams(return_topk=1001), 1),
    }
    for label, (prompts, params, n) in bad_inputs.items():
        try:
            sampler.generate(prompts, params, n)
            errors[label] = None
        except ValueError as err:
            errors[label] = str(err)
    out["errors"] = errors
    return out


def _pipeline_body(hf_dir: str) -> str | None:
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    initialize_distributed(parallel)
    try:
        _build_sampler(hf_dir, parallel)
    except ValueError as err:
        return str(err)
    return None


def _sampling_shards_body(cases: list[tuple[torch.Tensor, int, SamplingParams]]):
    """Per case on this rank: the kept columns, the sampled ids and their log-probabilities (2 ranks, plain gloo)."""
    out = []
    for logits_BV, vocab, params in cases:
        width = logits_BV.shape[1] // dist.get_world_size()
        shard = make_vocab_shard(width, dist.group.WORLD, vocab)
        local_BW = logits_BV[:, shard.start : shard.start + width]
        kept = torch.isfinite(processed_logits(local_BW, shard, params)) if params.temperature > 0 else None
        ids_B = sample_next(local_BW, shard, params, torch.Generator().manual_seed(params.seed))
        drawn = sample_next(local_BW, shard, params, torch.Generator().manual_seed(params.seed), drawn=True)
        assert torch.equal(drawn[0], ids_B), "asking for the drawn log-probabilities changed the draw"
        out.append((kept, ids_B, token_logprobs(local_BW, ids_B, shard), drawn[1]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# References


@functools.cache
def _hf_model(hf_dir: str):
    from megatron_opd.models.reference import hf_model

    model = hf_model(hf_dir).float().eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(hf_dir: str, prompt: list[int], max_new: int) -> torch.Tensor:
    """transformers' greedy continuation of ``prompt`` run alone (float32)."""
    with torch.no_grad():
        out = _hf_model(hf_dir).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :]


def _hf_logprobs(hf_dir: str, prompt: list[int], response: list[int], vocab: int | None = None) -> torch.Tensor:
    """transformers' log-probabilities (temperature 1, over the first ``vocab`` ids) of ``response`` after ``prompt``."""
    with torch.no_grad():
        logits = _hf_model(hf_dir)(torch.tensor([prompt + response])).logits[0].double()
    logits = logits[len(prompt) - 1 : -1, :vocab]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def reference_kept(z_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Float64 full-vocabulary support of temperature-scaled logits ``z`` (``-inf`` = excluded) after top-k/top-p."""
    z_BV = z_BV.double().clone()
    if top_k:
        kth_B = z_BV.topk(top_k, dim=-1).values[:, -1:]
        z_BV[z_BV < kth_B] = float("-inf")
    probs_BV = torch.softmax(z_BV, -1)
    # mass of the tokens strictly more probable than each token
    above_BV = (probs_BV[:, None, :] * (z_BV[:, None, :] > z_BV[:, :, None])).sum(-1)
    return torch.isfinite(z_BV) & (above_BV < top_p) if top_p < 1.0 else torch.isfinite(z_BV)


def reference_probs(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a sampler with these settings draws from (float64)."""
    z_1V = (logits_V.double() / temperature)[None]
    kept_1V = reference_kept(z_1V, top_k, top_p)
    return torch.softmax(torch.where(kept_1V, z_1V, float("-inf")), -1)[0]


def chi_square_pvalue(counts_V: torch.Tensor, probs_V: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness-of-fit p-value; bins expected below ``min_expected`` are pooled into one.

    A count where the hypothesis has zero probability gives p = 0.
    """
    counts_V, probs_V = counts_V.double(), probs_V.double()
    total = counts_V.sum()
    if bool(((probs_V == 0) & (counts_V > 0)).any()):
        return 0.0
    expected_V = probs_V * total
    big = expected_V >= min_expected
    obs = torch.cat([counts_V[big], counts_V[~big].sum()[None]])
    exp = torch.cat([expected_V[big], expected_V[~big].sum()[None]])
    if exp[-1] < 1e-12:  # nothing pooled
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


# ---------------------------------------------------------------------------------------------------------------
# Model tests


GREEDY_LAYOUTS = {
    "tp1": (1, {"tp1": dict()}),
    "tp2": (
        2,
        {
            "tp2": dict(tensor_model_parallel_size=2),
            "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        },
    ),
}


def _prompts(vocab: int) -> list[list[int]]:
    """``PROMPTS`` with every id below ``vocab``."""
    return [[t % vocab for t in prompt] for prompt in PROMPTS]


@pytest.mark.parametrize("layout", list(GREEDY_LAYOUTS))
def test_greedy_matches_transformers(layout, shape_dirs):
    """The matrix's shapes at TP=1, and at TP=2 with and without sequence parallelism."""
    world, layouts = GREEDY_LAYOUTS[layout]
    names = shapes_at("built-in sampler greedy vs transformers", layout)
    models = {name: (shape_dirs[name], _prompts(SHAPES[name].vocab_size)) for name in names}
    per_rank = run_distributed(_greedy_body, world, args=(layouts, models), timeout=300)
    results = per_rank[0]
    assert set(results) == {(label, name) for label in layouts for name in names}
    for (label, name), (rollouts, training) in results.items():
        hf_dir, prompts = models[name]
        where = f"{label}/{name}"
        assert training, f"{where}: the trainer's training mode was not restored"
        for other in per_rank[1:]:  # every rank returns the same rollouts
            assert all(torch.equal(a, b) for a, b in zip(rollouts.response_ids, other[label, name][0].response_ids))
        assert len(rollouts) == 2 * len(prompts)
        assert rollouts.prompt_index == [i // 2 for i in range(2 * len(prompts))]
        assert rollouts.policy_version == 3
        assert rollouts.finish_reasons == ["length"] * len(rollouts)
        for i, prompt in enumerate(prompts):
            ref = _hf_greedy(hf_dir, prompt, MAX_NEW)
            assert len(ref) == MAX_NEW
            for row in (2 * i, 2 * i + 1):
                assert rollouts.prompt_ids[row].tolist() == prompt
                got = rollouts.response_ids[row]
                assert got.dtype == torch.int64 and got.tolist() == ref.tolist(), f"{where} prompt {i}: {got} vs {ref}"
                assert rollouts.response_mask[row].tolist() == [1] * MAX_NEW
            ref_lp = _hf_logprobs(hf_dir, prompt, ref.tolist())
            torch.testing.assert_close(rollouts.logprobs[2 * i].double(), ref_lp, rtol=0, atol=1e-5, msg=where)


def _scaled_model(src: str, dst, scale: float) -> str:
    """A copy of the tiny (untied) model whose output logits are ``scale`` times larger: a peaked distribution."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


CHI_PROMPT = [3, 14, 15, 92]
CHI_DRAWS = 4096


def test_first_token_follows_reference_distribution(tiny_model_dirs, tmp_path):
    """Chi-square of 4096 first tokens against transformers' distribution after temperature, top-k and top-p.

    Controls: the same counts are rejected against a wrong temperature and a wrong top-p. The logits are scaled up
    so the nucleus holds about ten tokens (bins with at least ~5 expected draws).
    """
    temperature, top_k, top_p = 0.7, 12, 0.9
    hf_dir = _scaled_model(tiny_model_dirs["llama"], tmp_path / "peaked", scale=20.0)
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    (rollouts,) = run_distributed(_first_token_body, 1, args=(hf_dir, CHI_PROMPT, sampling, CHI_DRAWS), timeout=300)

    with torch.no_grad():
        logits_V = _hf_model(hf_dir)(torch.tensor([CHI_PROMPT])).logits[0, -1].double()
    # The test relies on no token sitting at the nucleus edge (where Megatron vs transformers rounding could flip it).
    z_V = (logits_V / temperature).topk(top_k + 1).values
    assert z_V[-2] - z_V[-1] > 1e-3, "the k-th and (k+1)-th logits are too close"
    z_V = z_V[:-1]
    mass_above = torch.cat([torch.zeros(1), torch.softmax(z_V, -1).cumsum(0)[:-1].float()])
    assert (mass_above - top_p).abs().min() > 1e-3

    ids = torch.stack(rollouts.response_ids)[:, 0]
    counts_V = torch.bincount(ids, minlength=logits_V.numel())
    probs_V = reference_probs(logits_V, temperature, top_k, top_p)
    assert 6 <= int((probs_V > 0).sum()) <= top_k
    assert chi_square_pvalue(counts_V, probs_V) > 1e-3
    assert chi_square_pvalue(counts_V, reference_probs(logits_V, 1.0, top_k, top_p)) < 1e-6
    assert chi_square_pvalue(counts_V, reference_probs(logits_V, temperature, top_k, 0.97)) < 1e-6
    # Log-probabilities are those of the unmodified distribution (temperature 1, no truncation).
    logprobs = torch.stack(rollouts.logprobs)[:, 0]
    torch.testing.assert_close(logprobs.double(), torch.log_softmax(logits_V, -1)[ids], rtol=0, atol=1e-5)


def test_tp2_samples_equal_tp1(tiny_model_dirs):
    """Same seed: token-for-token the same samples at TP=1 and TP=2 (qwen3: vocabulary 1001, padded to 1024)."""
    base = dict(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9)
    samplings = [SamplingParams(**base, seed=7), SamplingParams(**base, seed=8)]
    per_rank = run_distributed(_tp_equivalence_body, 2, args=(tiny_model_dirs["qwen3"], samplings), timeout=300)
    for rank_out in per_rank:
        for tp in (1, 2):
            for rollouts in rank_out[tp]:
                ids = torch.cat(rollouts.response_ids)
                assert int(ids.max()) < 1001, "a padding column was sampled"
        for a, b in zip(rank_out[1], rank_out[2]):
            assert [r.tolist() for r in a.response_ids] == [r.tolist() for r in b.response_ids]
            torch.testing.assert_close(torch.cat(a.logprobs), torch.cat(b.logprobs), rtol=0, atol=1e-5)
            # Truncated sampling: also the log-probabilities of the distribution drawn from, above the model's own.
            drawn_a, drawn_b = torch.cat(a.drawn_logprobs), torch.cat(b.drawn_logprobs)
            torch.testing.assert_close(drawn_a, drawn_b, rtol=0, atol=1e-5)
            assert (drawn_a >= torch.cat(a.logprobs) - 1e-5).all() and (drawn_a <= 0).all()
    seed7, seed8 = per_rank[0][2]
    prompt, response = seed7.prompt_ids[0].tolist(), seed7.response_ids[0].tolist()
    with torch.no_grad():  # the recorded values against transformers' logits through the float64 reference
        logits = _hf_model(tiny_model_dirs["qwen3"])(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    for j, token in enumerate(response):
        ref = reference_probs(logits[j, :1001], base["temperature"], base["top_k"], base["top_p"])[token].log()
        assert float(seed7.drawn_logprobs[0][j]) == pytest.approx(float(ref), abs=1e-4)
    assert [r.tolist() for r in seed7.response_ids] != [r.tolist() for r in seed8.response_ids]
    # The two samples of one prompt differ (independent noise per row).
    assert seed7.response_ids[0].tolist() != seed7.response_ids[1].tolist()


def test_student_topk_ids_are_recorded(tiny_model_dirs):
    """``return_topk``: each generated position's global top-k ids of the raw logits (qwen3: vocabulary 1001 padded
    to 1024), the same at TP=1 and TP=2, equal to transformers' top-k, and the samples themselves unchanged."""
    hf_dir, k = tiny_model_dirs["qwen3"], 8
    sampling = SamplingParams(max_new_tokens=9, temperature=1.3, top_k=20, seed=11, return_topk=k)
    per_rank = run_distributed(_topk_ids_body, 2, args=(hf_dir, sampling), timeout=300)
    for rank_out in per_rank:
        (tp1, tp1_plain), (tp2, tp2_plain) = rank_out[1], rank_out[2]
        assert tp1_plain.topk_ids is None
        for with_ids, plain in ((tp1, tp1_plain), (tp2, tp2_plain)):  # asking for ids draws no noise
            assert [r.tolist() for r in with_ids.response_ids] == [r.tolist() for r in plain.response_ids]
        for a, b in zip(tp1.topk_ids, tp2.topk_ids):
            assert torch.equal(a, b)
    rollouts = per_rank[0][2][0]
    for prompt, response, ids in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.topk_ids):
        assert ids.dtype == torch.int64 and ids.shape == (response.numel(), k)
        assert int(ids.min()) >= 0 and int(ids.max()) < 1001, "a padding column entered the top-k"
        with torch.no_grad():
            logits = _hf_model(hf_dir)(torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1, :1001]
        # The recorded ids hold the k largest logits, largest first (ids may differ only on float32 ties).
        torch.testing.assert_close(logits.gather(-1, ids), logits.topk(k, dim=-1).values, rtol=0, atol=1e-4)
        assert (ids.sort(-1).values[:, 1:] != ids.sort(-1).values[:, :-1]).all()


def test_stop_tokens_limits_and_errors(tiny_model_dirs):
    hf_dir = tiny_model_dirs["llama"]
    (out,) = run_distributed(_stop_and_limits_body, 1, args=(hf_dir,), timeout=300)
    assert out["is_backend"]
    assert out["training_after"]

    free, stopped, stop_id = out["free"], out["stopped"], out["stop_id"]
    assert free.finish_reasons == ["length"] * len(free)
    n_stopped = 0
    for row, ids in enumerate(r.tolist() for r in free.response_ids):
        if stop_id in ids:
            cut = ids[: ids.index(stop_id) + 1]
            assert stopped.finish_reasons[row] == "stop"
            n_stopped += 1
        else:
            cut = ids
            assert stopped.finish_reasons[row] == "length"
        assert stopped.response_ids[row].tolist() == cut
        assert stopped.logprobs[row].tolist() == free.logprobs[row][: len(cut)].tolist()
        assert stopped.response_mask[row].tolist() == [1] * len(cut)
    assert n_stopped >= 1

    assert out["all_stop"].finish_reasons == ["stop"] * len(out["all_stop"])
    assert out["all_stop"].response_lengths == [1] * len(out["all_stop"])
    lengths = [len(p) for p in PROMPTS]
    # A prefill to the shortest prompt, then one forward per position until the longest prompt's first token.
    expected_forwards = 1 + max(lengths) - min(lengths)
    assert out["all_stop_forwards"] == expected_forwards, "generation did not stop when every row had finished"

    capped = out["capped"]
    assert capped.response_lengths == [5, 2] and capped.finish_reasons == ["length", "length"]

    small = torch.cat(out["small_vocab"].response_ids)
    assert int(small.max()) < 500 and len(set(small.tolist())) > 100
    assert int(torch.cat(out["free"].response_ids).max()) >= 500, "the unrestricted sampler reaches ids >= 500"
    greedy = out["small_vocab_greedy"]
    for prompt, response, logprobs in zip(PROMPTS, greedy.response_ids, greedy.logprobs):
        ref = _hf_logprobs(hf_dir, prompt, response.tolist(), vocab=500)
        torch.testing.assert_close(logprobs.double(), ref, rtol=0, atol=1e-5)
        with torch.no_grad():
            logits = _hf_model(hf_dir)(torch.tensor([prompt + response.tolist()])).logits[0, len(prompt) - 1 : -1]
        assert response.tolist() == logits[:, :500].argmax(-1).tolist()

    for label, message in out["errors"].items():
        assert message is not None and label in message, (label, message)


def test_pipeline_parallel_is_refused(tiny_model_dirs):
    messages = run_distributed(_pipeline_body, 2, args=(tiny_model_dirs["llama"],), timeout=300)
    for message in messages:
        assert message is not None and "pipeline_model_parallel_size=1" in message and "rollout.backend=vllm" in message


# ---------------------------------------------------------------------------------------------------------------
# sampling.py on hand-made shards


TIED = [3, 4, 5, 25, 26, 27]


def _hand_made_cases() -> list[tuple[torch.Tensor, int, SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    cases = []
    # 16 rows over a padded vocabulary of 2 x 24 with 45 real ids; padding columns hold huge logits to tempt a bug.
    logits_BV = torch.randn(16, 48, generator=g) * 2.0
    logits_BV[:, 45:] = 100.0
    logits_BV[0, 7] = logits_BV[0, 30] = logits_BV[0, :45].max() + 1.0  # a tie across shards: greedy picks id 7
    tied = TIED  # six equal top logits on both shards: top-k and top-p keep all or none of them
    logits_BV[1, :45] = torch.randn(45, generator=g) * 0.5 - 2.0
    logits_BV[1, tied] = 3.0
    logits_BV[2, :45] = 0.0  # uniform row
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
        SamplingParams(temperature=1.3, top_p=0.6, seed=3),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=4),
        SamplingParams(temperature=1.0, top_k=45, top_p=0.05, seed=5),
    ):
        cases.append((logits_BV, 45, params))
    # One row repeated: the draws are a sample of the distribution (chi-square below).
    one_V = torch.randn(48, generator=g) * 1.5
    one_V[40:] = 50.0
    cases.append(
        (one_V.expand(20000, -1).contiguous(), 40, SamplingParams(temperature=0.8, top_k=30, top_p=0.95, seed=9))
    )
    return cases


def test_sampling_on_two_shards_matches_full_vocabulary():
    cases = _hand_made_cases()
    rank0, rank1 = run_distributed(_sampling_shards_body, 2, args=(cases,), timeout=120)
    for (logits_BV, vocab, params), (kept0, ids0, lp0, drawn0), (kept1, ids1, lp1, drawn1) in zip(cases, rank0, rank1):
        where = f"{params}"
        assert torch.equal(ids0, ids1) and torch.equal(lp0, lp1), f"{where}: ranks disagree"
        assert torch.equal(drawn0, drawn1), f"{where}: ranks disagree on the drawn log-probabilities"
        if params.temperature > 0:  # each sampled id's log-probability under the distribution it was drawn from
            for row in range(min(logits_BV.shape[0], 4)):
                ref = reference_probs(logits_BV[row, :vocab], params.temperature, params.top_k, params.top_p)
                torch.testing.assert_close(drawn0[row].double(), ref[ids0[row]].log(), rtol=0, atol=1e-5)
        assert int(ids0.max()) < vocab, f"{where}: a padding column was sampled"
        full_shard = make_vocab_shard(logits_BV.shape[1], None, vocab)
        # The same draw on one unsplit shard (TP=1).
        single = sample_next(logits_BV, full_shard, params, torch.Generator().manual_seed(params.seed))
        assert torch.equal(ids0, single), f"{where}: two shards and one shard sample differently"
        ref_lp = torch.log_softmax(logits_BV[:, :vocab].double(), -1).gather(-1, ids0[:, None])[:, 0]
        torch.testing.assert_close(lp0.double(), ref_lp, rtol=0, atol=1e-5)
        if params.temperature == 0:
            assert ids0.tolist() == logits_BV[:, :vocab].argmax(-1).tolist()
            assert int(ids0[0]) == 7
            continue
        kept_BV = torch.cat([kept0, kept1], dim=-1)
        repeated = logits_BV.shape[0] > 1000  # one row repeated: compare that row (the reference is O(V^2) per row)
        rows = logits_BV[:1] if repeated else logits_BV
        z_BV = (rows / params.temperature).double()  # float32 division, as the sampler does
        ref_BV = torch.zeros(rows.shape, dtype=torch.bool)
        ref_BV[:, :vocab] = reference_kept(z_BV[:, :vocab], params.top_k, params.top_p)
        assert torch.equal(kept_BV, ref_BV.expand_as(kept_BV)), f"{where}: kept columns differ from the reference"
        assert bool(kept_BV.gather(-1, ids0[:, None]).all()), f"{where}: a token outside the support was sampled"
        if not repeated:
            assert bool(kept_BV[1, TIED].all()), f"{where}: equal logits split by the top-k or top-p cut"
        if repeated:
            probs_V = reference_probs(logits_BV[0, :vocab], params.temperature, params.top_k, params.top_p)
            counts_V = torch.bincount(ids0, minlength=vocab)
            assert chi_square_pvalue(counts_V, probs_V) > 1e-3
            wrong_t_V = reference_probs(logits_BV[0, :vocab], params.temperature * 1.2, params.top_k, params.top_p)
            assert chi_square_pvalue(counts_V, wrong_t_V) < 1e-6
            wrong_p_V = reference_probs(logits_BV[0, :vocab], params.temperature, params.top_k, 0.99)
            assert chi_square_pvalue(counts_V, wrong_p_V) < 1e-6


def test_chi_square_helper():
    """The hand-written p-value matches known chi-square quantiles (scipy is not installed)."""
    # chi2.sf(3.841459, df=1) = 0.05, chi2.sf(18.307038, df=10) = 0.05
    assert math.isclose(
        float(torch.special.gammaincc(torch.tensor(0.5, dtype=torch.float64), torch.tensor(3.841459 / 2))),
        0.05,
        rel_tol=1e-5,
    )
    counts = torch.tensor([50.0, 50.0])
    assert math.isclose(chi_square_pvalue(counts, torch.tensor([0.5, 0.5])), 1.0)
    assert chi_square_pvalue(torch.tensor([10.0, 0.0]), torch.tensor([0.0, 1.0])) == 0.0
    stat_df10 = torch.special.gammaincc(torch.tensor(5.0, dtype=torch.float64), torch.tensor(18.307038 / 2))
    assert math.isclose(float(stat_df10), 0.05, rel_tol=1e-5)
