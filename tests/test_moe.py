"""Expert parallelism changes where experts run, not what they compute: per-token losses and gradients at EP=2
(both token dispatchers) equal EP=1's at the same data-parallel size, and bad layouts are refused before any
model is built."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.distributed import ParallelConfig
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import SHAPES
from megatron_opd.testing.tiny_models import routing_margin, tiny_hf_config

SEQ = 16
SHAPES_RUN = ("qwen3_moe_dense0",)  # a dense first layer next to MoE layers
LAYOUTS = {
    "ep1": (dict(), "allgather"),
    "ep2 allgather": (dict(expert_model_parallel_size=2), "allgather"),
    "ep2 alltoall": (dict(expert_model_parallel_size=2), "alltoall"),
}


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    """Each data-parallel rank's own 2 micro-batches of 2 sequences."""
    return torch.randint(0, vocab, (2, 2, SEQ), generator=torch.Generator().manual_seed(rank))


def _losses_and_grads(models: dict[str, str]):
    """Per layout and model: this rank's per-token losses and gradients (experts by global index)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.models.source import build_and_load

    def ce(logits, batch):
        per_token = vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1))
        return per_token.mean(), per_token.detach()

    out = {}
    for layout, (kwargs, dispatcher) in LAYOUTS.items():
        parallel = ParallelConfig(**kwargs)
        initialize_distributed(parallel)
        for name, hf_dir in models.items():
            build = ModelBuildConfig(moe_token_dispatcher=dispatcher)
            arch, chunks = build_and_load(hf_dir, parallel, build, trainable=True)
            tokens = _tokens(dist.get_rank(), arch.vocab_size)
            losses = forward_backward(chunks, [{"tokens": t} for t in tokens], ce)
            grads = full_tensors(
                chunks, arch, ps.get_tensor_model_parallel_group(), "grad", ps.get_expert_tensor_parallel_group()
            )
            out[layout, name] = (torch.stack(losses), grads)
    return out


def test_expert_parallel_losses_and_gradients_equal_ep1(shape_dirs):
    models = {name: shape_dirs[name] for name in SHAPES_RUN}
    for name, hf_dir in models.items():
        margin = min(routing_margin(hf_dir, _tokens(rank, SHAPES[name].vocab_size)) for rank in range(2))
        assert margin > 1e-5, f"{name}: routing near-tie ({margin:.1e}) would test tie-breaking, not arithmetic"
    ranks = run_distributed(_losses_and_grads, 2, args=(models,), timeout=600)

    def close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert rel <= 1e-6, f"{what}: max relative difference {rel:.2e} from EP=1"

    for name in SHAPES_RUN:
        ref = [r["ep1", name] for r in ranks]
        for layout in ("ep2 allgather", "ep2 alltoall"):
            held = set()
            for rank, result in enumerate(ranks):
                losses, grads = result[layout, name]
                close(losses, ref[rank][0], f"{layout}/{name} rank {rank} per-token losses")
                for param, grad in grads.items():
                    if ".local_experts." in param:  # an expert sees both ranks' tokens at EP=2
                        close(grad, ref[0][1][param] + ref[1][1][param], f"{layout}/{name} {param}")
                        held.add(param)
                    else:
                        close(grad, ref[rank][1][param], f"{layout}/{name} rank {rank} {param}")
            experts = {p for p in ref[0][1] if ".local_experts." in p}
            assert held == experts and experts, f"{layout}/{name}: the EP ranks together hold every expert once"


@pytest.mark.parametrize(
    "overrides, parallel, message",
    [
        (dict(), dict(expert_model_parallel_size=3), "expert_model_parallel_size=3 does not divide the 4 experts"),
        (dict(), dict(tensor_model_parallel_size=2), "set parallel.sequence_parallel=true"),
        (
            dict(moe_intermediate_size=30),
            dict(expert_tensor_parallel_size=4),
            "does not divide moe_intermediate_size=30",
        ),
    ],
)
def test_bad_expert_layouts_are_refused(overrides, parallel, message):
    from megatron_opd.models import architecture_from_hf_config, validate_layout

    arch = architecture_from_hf_config(tiny_hf_config("qwen3_moe", **overrides).to_dict())
    with pytest.raises(ValueError, match=message):
        validate_layout(arch, ParallelConfig(**parallel))


def test_memory_estimate_counts_experts_per_expert_parallel_rank():
    """Qwen3-30B-A3B's sizes (``launch.memory.KNOWN_CONFIGS``): at EP=8 a device holds an eighth of the routed
    experts and all the rest, counted against transformers' own parameters."""
    from megatron_opd.launch.memory import hf_config, meta_model, shard_parameters, stage_params

    model = meta_model(hf_config("Qwen3-30B-A3B"))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert 30e9 < total < 31e9 and experts > 0.9 * total
    (ep1,) = stage_params(shard_parameters(model, 1, 1, None), 1)
    (ep8,) = stage_params(shard_parameters(model, 1, 1, None, ep=8), 1)
    assert ep1 == total and ep8 == total - experts + experts // 8


def test_the_trainer_refuses_expert_parallelism_before_any_model():
    """Its loops do not keep expert-parallel ranks in lockstep yet (a run hung): refused by ``validate``."""
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl"]
    parse_args(TrainConfig, base).validate()
    cfg = parse_args(TrainConfig, [*base, "parallel.expert_model_parallel_size=2"])
    with pytest.raises(ValueError, match="parallel.expert_model_parallel_size=2: the trainer does not run expert"):
        cfg.validate()
