"""LoRA students at every parallel layout (``models/lora.py``): pipeline (and virtual pipeline) stages, context
parallelism, packed sequences, full recompute, the fused output loss and expert parallelism each train the same
adapters as one process.

One spawned job of two ranks trains a dense student (the tiny Llama, 4 layers) from fixed synthetic top-k teacher
scores, three optimizer steps of the reverse KL with the output layer fused into the loss (its weight frozen), first
at DP=2 (the reference), then at PP=2 with full recompute, PP=2 with VP=2, CP=2 and DP=2 with packed sequences; and a
Mixture-of-Experts student with a shared expert (the tiny Qwen2-MoE) at DP=2, then at EP=2 (the routed experts frozen,
adapters on attention and the shared expert). Every layout's per-step losses, its adapters after the steps (which
carry every gradient) and its log-probabilities of fixed sequences afterwards equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed

N, S, VOCAB, TOPK, STEPS = 4, 16, 1000, 16, 3
RANK, ALPHA = 4, 8.0
TOL = 1e-6

# name -> (model, parallel options, build options, train_step options); each family's first layout is its reference.
LAYOUTS = {
    "dense/dp2": ("dense", {}, {}, {}),
    "dense/pp2_recompute": ("dense", dict(pipeline_model_parallel_size=2), dict(recompute_granularity="full"), {}),
    "dense/pp2_vp2": ("dense", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {}, {}),
    "dense/cp2": ("dense", dict(context_parallel_size=2), {}, {}),
    "dense/dp2_packed": ("dense", {}, {}, dict(packing=True)),
    "moe/dp2": ("moe", {}, {}, {}),
    "moe/ep2": ("moe", dict(expert_model_parallel_size=2), {}, {}),
}


def _batch():
    """The context-parallel tests' four samples (different lengths, a tool span, padded to S) with equal sequence
    weights, and the teacher's top-k scores (a random, peaked distribution per position), fixed by seed."""
    from megatron_opd.interfaces import TeacherScores
    from tests.test_context_parallel import _fixed_batch

    batch = _fixed_batch()
    batch.seq_weights = torch.ones(N)
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(3 * torch.randn(N, S, VOCAB, generator=gen), dim=-1)
    top = teacher.topk(TOPK, dim=-1)
    return batch, TeacherScores(topk_ids=top.indices, topk_logprobs=top.values)


def _probes() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (12, 7)]


def _train(model_dir: str, parallel, build, options: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.lora import LoRAConfig, add_lora, full_adapters, target_layers
    from megatron_opd.rollout.fidelity import sequence_logprobs
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    arch, chunks = build_and_load(model_dir, parallel, ModelBuildConfig(**build))
    add_lora(chunks, LoRAConfig(rank=RANK, alpha=ALPHA), seed=0, arch=arch)
    # adam_eps above the gradients: Adam's update is then about linear in them, not their sign (see test_lora.py).
    optim = OptimConfig(lr=1e-2, adam_eps=1e-2)
    student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10)
    batch, scores = _batch()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    lo, hi = dp_rank * N // dp_size, (dp_rank + 1) * N // dp_size
    batch = batch.select(list(range(lo, hi))) if dp_size > 1 else batch
    scores.topk_ids, scores.topk_logprobs = scores.topk_ids[lo:hi], scores.topk_logprobs[lo:hi]
    cfg = LossConfig(kind="reverse_kl", mode="topk", topk=TOPK, tail="bucket", fused_output="on")
    losses = [
        train_step(student, batch, scores, cfg, vocab_size=VOCAB, teacher_temperature=1.0, micro_batch_size=2,
                   **options).stats.as_dict()["loss"]
        for _ in range(STEPS)
    ]  # fmt: skip
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, full_adapters(chunks, arch, ps.get_tensor_model_parallel_group()),
                           group=ps.get_pipeline_model_parallel_group())  # fmt: skip
    for chunk in chunks:
        chunk.eval()
    frozen = [p for c in chunks for n, p in c.named_parameters() if ".lora." not in n]
    adapters = {name: t for stage in stages for name, t in stage.items()}
    adapted = {(name.split(".lora.")[0].rsplit(".", 1)[1], int(name.split(".")[2])) for name in adapters}
    return {
        "losses": losses,
        "adapters": adapters,
        # the layers add_lora adapted, every stage's, are those check_lora_targets reads from the architecture
        "adapted_as_predicted": adapted
        == {(t, layer) for t, layers in target_layers(arch).items() for layer in layers},
        "logprobs": sequence_logprobs(chunks, _probes(), VOCAB),
        "frozen_untouched": all(
            not p.requires_grad and p.grad is None and getattr(p, "main_grad", None) is None for p in frozen
        ),  # the fused output layer forms no gradient for its frozen weight either
    }


def _layouts_body(dirs: dict[str, str]) -> dict:
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel

    results = {}
    for i, (name, (model, parallel, build, options)) in enumerate(LAYOUTS.items()):
        parallel = ParallelConfig(**parallel)
        (initialize_model_parallel if i else initialize_distributed)(parallel)
        results[name] = _train(dirs[model], parallel, build, options)
    return results


@pytest.fixture(scope="module")
def layout_runs(tiny_model_dirs, tmp_path_factory):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    moe = make_tiny_hf_model("qwen2_moe", tmp_path_factory.mktemp("lora_moe"), seed=3, vocab_size=VOCAB)
    dirs = {"dense": tiny_model_dirs["llama"], "moe": str(moe)}
    return run_distributed(_layouts_body, 2, args=(dirs,), timeout=600)


def _reference(name: str) -> str:
    return next(other for other in LAYOUTS if other.split("/")[0] == name.split("/")[0])


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if _reference(name) != name])
def test_lora_layout_trains_the_reference_adapters(layout_runs, layout):
    ref = layout_runs[0][_reference(layout)]
    moved = max(t.abs().max().item() for name, t in ref["adapters"].items() if name.endswith(".B"))
    assert moved > 1e-3, f"B barely moved ({moved:.1e}): the comparison would be vacuous"
    ref_logprobs = next(r[_reference(layout)]["logprobs"] for r in layout_runs if r[_reference(layout)]["logprobs"])
    assert any(results[layout]["logprobs"] for results in layout_runs), f"{layout}: no rank scored the probes"
    for rank, results in enumerate(layout_runs):
        r, where = results[layout], f"rank {rank}, {layout}"
        assert r["frozen_untouched"] and results[_reference(layout)]["frozen_untouched"], (
            f"{where}: a base parameter has a gradient"
        )
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=TOL)
        assert set(r["adapters"]) == set(ref["adapters"]), where
        assert r["adapted_as_predicted"], f"{where}: the adapted layers are not models.lora.target_layers'"
        for name, want in ref["adapters"].items():
            err = (r["adapters"][name] - want).abs().max().item()
            assert err <= TOL, f"{where}: {name} differs from {_reference(layout)} by {err:.1e}"
        if r["logprobs"] is not None:  # the rank that gathers the last stage's logits
            err = max((a - b).abs().max().item() for a, b in zip(r["logprobs"], ref_logprobs))
            assert err <= 1e-5, f"{where}: log-probabilities differ by {err:.1e}"
