"""``build.moe_shared_expert_overlap``: shared experts computed while the alltoall dispatcher moves the routed tokens
(Megatron-Core's ``moe_shared_expert_overlap``) give the per-token losses and gradients of the plain layer at EP=2
and at TP=2 with sequence parallelism, and the combinations it cannot run are refused before any model is built."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_opd.distributed import ParallelConfig
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.tiny_models import routing_margin

SEQ = 16
SHAPES_RUN = ("qwen2_moe_shared", "deepseek_v3_mla")  # a gated shared expert; an ungated one next to MLA
LAYOUTS = {
    "ep2": dict(expert_model_parallel_size=2),
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
}
RUNS = (("ep2", "deepseek_v3_mla"), ("tp2_sp", "qwen2_moe_shared"))
"""Each shape at one layout (CI's time): EP=2 with MLA's ungated shared expert, TP=2 + SP with Qwen2-MoE's gate."""


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    """Each data-parallel rank's own 2 micro-batches of 2 sequences."""
    return torch.randint(0, vocab, (2, 2, SEQ), generator=torch.Generator().manual_seed(rank))


def _overlap_runs(models: dict[str, str]):
    """Per layout, model and overlap: this rank's per-token losses, gradients and how often (per micro-batch and MoE
    layer) the overlapped shared experts handed their output to the dispatcher."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.transformer.moe import shared_experts
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors

    def ce(logits, batch):
        per_token = vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1))
        return per_token.mean(), per_token.detach()

    handed = []
    get_output = shared_experts.SharedExpertMLP.get_output
    shared_experts.SharedExpertMLP.get_output = lambda self: handed.append(1) or get_output(self)
    out, rank = {}, dist.get_rank()
    for layout, kwargs in LAYOUTS.items():
        parallel = ParallelConfig(**kwargs)
        initialize_distributed(parallel)
        for name, hf_dir in models.items():
            if (layout, name) not in RUNS:
                continue
            for overlap in (False, True):
                build = ModelBuildConfig(moe_token_dispatcher="alltoall", moe_shared_expert_overlap=overlap)
                arch, chunks = build_and_load(hf_dir, parallel, build, trainable=True)
                handed.clear()
                tokens = _tokens(rank if layout == "ep2" else 0, arch.vocab_size)
                losses = forward_backward(chunks, [{"tokens": t} for t in tokens], ce)
                grads = full_tensors(
                    chunks, arch, ps.get_tensor_model_parallel_group(), "grad", ps.get_expert_tensor_parallel_group()
                )
                moe_layers = sum(isinstance(layer.mlp, MoELayer) for layer in chunks[0].decoder.layers)
                calls = len(handed) / (len(tokens) * moe_layers)  # per micro-batch and MoE layer
                out[layout, name, overlap] = torch.cat([x.reshape(-1) for x in losses]), grads, calls
    return out


def test_shared_expert_overlap_equals_the_plain_layer(shape_dirs):
    """Megatron computes an overlapped shared expert after the router, so the input gradient adds its two parts in
    another order: equal to ~1e-7, not bitwise."""
    from megatron_opd.testing.shapes import SHAPES

    models = {name: shape_dirs[name] for name in SHAPES_RUN}
    for name, hf_dir in models.items():
        margin = min(routing_margin(hf_dir, _tokens(rank, SHAPES[name].vocab_size)) for rank in range(2))
        assert margin > 1e-5, f"{name}: routing near-tie ({margin:.1e}) would test tie-breaking, not arithmetic"
    ranks = run_distributed(_overlap_runs, 2, args=(models,), timeout=600)
    for layout, name in RUNS:
        for rank, result in enumerate(ranks):
            (ref_losses, ref_grads, plain_calls), (losses, grads, calls) = (
                result[layout, name, overlap] for overlap in (False, True)
            )
            what = f"{layout}/{name} rank {rank}"
            assert (plain_calls, calls) == (0, 1), f"{what}: the overlapped path did not run once per layer"
            torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0, msg=lambda m, w=what: f"{w} losses: {m}")
            assert grads.keys() == ref_grads.keys()
            for param, ref in ref_grads.items():
                rel = ((grads[param] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                assert rel <= 1e-6, f"{what} {param}: max relative difference {rel:.1e}"


def test_bad_shared_expert_overlaps_are_refused_before_any_model():
    from megatron_opd.config import parse_args
    from megatron_opd.models import architecture_from_hf_config
    from megatron_opd.models.builder import ModelBuildConfig, check_shared_expert_overlap, transformer_config
    from megatron_opd.testing.tiny_models import tiny_hf_config
    from megatron_opd.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="build.moe_shared_expert_overlap=true with build.moe_token_dispatcher=all"):
        ModelBuildConfig(moe_token_dispatcher="allgather", moe_shared_expert_overlap=True)
    overlap = ModelBuildConfig(moe_shared_expert_overlap=True)
    with pytest.raises(ValueError, match=re.escape("the allgather token dispatcher (build.moe_token_dispatcher=auto")):
        check_shared_expert_overlap(overlap, ParallelConfig())  # auto at EP=1: allgather
    ep2 = ParallelConfig(expert_model_parallel_size=2)
    no_shared = architecture_from_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    with pytest.raises(ValueError, match=re.escape("the student (s) (qwen3_moe) has no shared expert")):
        check_shared_expert_overlap(overlap, ep2, no_shared, "the student (s)")
    # A model without shared experts (a teacher) builds without the overlap; one with them, with it.
    assert not transformer_config(no_shared, ep2, overlap).moe_shared_expert_overlap
    shared = architecture_from_hf_config(tiny_hf_config("qwen2_moe").to_dict())
    assert (
        shared.moe.shared_expert_ffn_hidden_size and transformer_config(shared, ep2, overlap).moe_shared_expert_overlap
    )

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl", "build.moe_shared_expert_overlap=true"]
    parse_args(TrainConfig, [*base, "parallel.expert_model_parallel_size=2"]).validate()
    for extra, message in [
        (
            [],
            "the allgather token dispatcher (build.moe_token_dispatcher=auto at parallel.expert_model_parallel_size=1)",
        ),
        (
            ["build.moe_token_dispatcher=alltoall", "parallel.tensor_model_parallel_size=2", "student.lora.rank=8"],
            "build.moe_shared_expert_overlap=true with student.lora.target_modules=['linear_fc1', 'linear_fc2'] at "
            "tensor_model_parallel_size=2",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_args(TrainConfig, [*base, *extra]).validate()
