"""DeepSeek-V3 (multi-latent attention with YaRN, DeepSeek's routing) matches transformers at TP=1, TP=2 (SP) and
two uneven pipeline stages, and trains alike at TP=1, TP=2 (SP), EP=2 and PP=2 (one layer, then three): the same
gradients (the rotary key's, which Megatron-Core's own tensor-parallel key/value projection gets wrong, included),
parameters and load-balancing expert biases after three steps; and the expert bias at EP=2 equals EP=1's when the
ranks hold different numbers of micro-batches (the lockstep's dummies are not counted).

The tiny model (``families/deepseek_v3.TINY_DEEPSEEK``) routes with every DeepSeek feature: sigmoid scores plus a
random expert bias, 16 experts in 4 groups of which each token may use the best 2, top-4 among those, a shared
expert, a dense first layer. The test tokens keep every routing decision clear of a tie (a margin measured in
transformers' own router), so a match checks the arithmetic, not tie-breaking.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.tiny_models import routing_margin

SEQ = 16
MARGIN = 1e-4  # smallest gap between a chosen and a passed-over group or expert score; errors here are ~1e-7


def _tokens(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (2, 2, SEQ), generator=gen)  # [micro-batches, batch, sequence]


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    """The matrix's tiny DeepSeek-V3 (q-LoRA) and the same without a query latent (one ``q_proj``)."""
    from megatron_opd.testing.shapes import make_shape
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("deepseek_v3")
    return {
        "q_lora": str(make_shape("deepseek_v3_mla", root / "q_lora")),
        "no_q_lora": str(make_tiny_hf_model("deepseek_v3", root / "no_q_lora", seed=3, q_lora_rank=None)),
    }


def _reference(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits ``[micro-batches, b, s, V]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=t).logits.float() for t in tokens])


LAYOUTS = {  # world of two ranks: data-parallel size 2, 1, 2
    "tp1": dict(),
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),  # Megatron's MoE needs SP with TP
    "ep2": dict(expert_model_parallel_size=2),
    # two uneven stages, as DeepSeek-V3's 61 layers need: the dense layer alone, then the three MoE layers
    "pp2_uneven": dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
}
BIAS_RATE = 1e-2  # auxiliary-loss-free balancing on: the expert bias moves each step, alike at every layout


def _train(hf_dir: str, parallel, tokens: torch.Tensor, steps: int = 3, counts: tuple[int, ...] | None = None) -> dict:
    """Gradients of the first step (finalised as the trainer does: Megatron's DDP and ``finalize_model_grads``) and
    the parameters and expert biases after ``steps`` Adam steps. Each data-parallel rank takes its share of
    ``tokens``' micro-batches (every ``dp``-th, or ``counts[rank]`` of them in order), so every layout sees the
    same global batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.loading import chunk_layer_range
    from megatron_opd.models.name_mapping import global_layer_name
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.student import Student, precision_plan

    build = ModelBuildConfig(moe_token_dispatcher="alltoall", moe_router_bias_update_rate=BIAS_RATE)
    arch, chunks = build_and_load(hf_dir, parallel, build, trainable=True)
    optim = OptimConfig(lr=1e-3, adam_eps=1e-4)  # epsilon above float32 noise: see test_context_parallel.py
    student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = tokens[dp_rank::dp] if counts is None else tokens[sum(counts[:dp_rank]) : sum(counts[: dp_rank + 1])]

    def ce(logits, batch):
        return vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1)).mean(), None

    def gathered(of):
        return full_tensors(
            chunks, arch, ps.get_tensor_model_parallel_group(), of, ps.get_expert_tensor_parallel_group()
        )

    out = {}
    for step in range(steps):
        for chunk in student.model:
            chunk.zero_grad_buffer()
        student.optimizer.zero_grad()
        forward_backward(student.model, [{"tokens": t} for t in mine], ce)
        if step == 0:
            out["grads"] = gathered(lambda p: p.main_grad)
        student.optimizer.step()
    out["params"] = gathered("data")
    out["layers"] = list(chunk_layer_range(chunks[0]))
    offset = chunk_layer_range(chunks[0]).start  # by global layer, as the parameters
    buffers = chunks[0].named_buffers()
    out["bias"] = {global_layer_name(n, offset): b.clone() for n, b in buffers if n.endswith("expert_bias")}
    return out


def _body(hf_dirs: dict[str, str], tokens: torch.Tensor):
    """In one job of two ranks: logits at TP=1, TP=2 (sequence-parallel) and two uneven pipeline stages; gradients and
    three training steps at TP=1, TP=2 (sequence-parallel), EP=2 and the two uneven stages."""
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel
    from megatron_opd.distributed.gather import gather_vocab_shards
    from megatron_opd.models.forward_backward import forward_backward

    def logits(hf_dir: str, parallel: ParallelConfig):
        arch, chunks = build_and_load(hf_dir, parallel, trainable=False)
        group = ps.get_tensor_model_parallel_group()

        def full(logits, batch):
            return logits.sum() * 0, gather_vocab_shards(logits.detach(), group)[..., : arch.vocab_size].clone()

        out = forward_backward(chunks, [{"tokens": t} for t in tokens], full, forward_only=True)
        return torch.stack(out) if out else None  # the last pipeline stage's

    initialize_distributed(ParallelConfig())
    results = {}
    for layout, kwargs in LAYOUTS.items():
        parallel = ParallelConfig(**kwargs)
        initialize_model_parallel(parallel)
        if layout != "ep2":  # EP=2's logits: the shape matrix (test_models.py)
            for name, hf_dir in hf_dirs.items():
                if (got := logits(hf_dir, parallel)) is not None:
                    results["logits", layout, name] = got
        results["train", layout] = _train(hf_dirs["q_lora"], parallel, tokens.flatten(0, 1)[:, None])
    return results


def _uneven_bias(hf_dir: str, tokens: torch.Tensor, counts: tuple[int, int]) -> dict:
    """Expert biases after one step at EP=1 (DP=2) and EP=2 when the ranks hold ``counts`` micro-batches: at EP=2 the
    rank with fewer runs the lockstep's dummies (``distributed.lockstep``), at EP=1 nothing needs them."""
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel

    initialize_distributed(ParallelConfig())
    out = {}
    for layout, kwargs in {"ep1": {}, "ep2": dict(expert_model_parallel_size=2)}.items():
        parallel = ParallelConfig(**kwargs)
        initialize_model_parallel(parallel)
        out[layout] = _train(hf_dir, parallel, tokens, steps=1, counts=counts)["bias"]
    return out


def test_lockstep_dummies_leave_the_expert_bias_update_alone(deepseek_dirs):
    """Rank 0 trains one micro-batch, rank 1 three: at EP=2 rank 0 runs two lockstep dummies (copies of its one) to
    keep the token exchange in step. Their tokens do not exist, so the expert bias after the step (driven by the
    tokens each expert got over all ranks) equals EP=1's, which runs no dummies. The three-step matrix above splits
    its micro-batches evenly (no dummies), so it could not see this. Rank 0's micro-batch is the one whose doubled
    count turns an expert's load from below the mean to above it (layer 3; each of the others, or rank 1 with
    fewer, moves no bias the other way: its load is far from the mean)."""
    tokens = _tokens(1000).flatten(0, 1)[[2, 0, 1, 3], None]  # the matrix's 4 micro-batches (routed clear of ties)
    ranks = run_distributed(_uneven_bias, 2, args=(deepseek_dirs["q_lora"], tokens, (1, 3)), timeout=300)
    ep1 = {**ranks[1]["ep1"], **ranks[0]["ep1"]}
    ep2 = {**ranks[1]["ep2"], **ranks[0]["ep2"]}
    loaded = load_file(f"{deepseek_dirs['q_lora']}/model.safetensors")
    assert ep1 and ep2.keys() == ep1.keys()
    assert any(not torch.equal(b, loaded[_hf_bias_name(n)]) for n, b in ep1.items()), "the bias did not move"
    for name, value in ep2.items():
        assert torch.equal(value, ep1[name]), f"EP=2 expert bias {name} differs from EP=1's: {value - ep1[name]}"


def _hf_bias_name(megatron: str) -> str:
    layer = megatron.split("layers.")[1].split(".")[0]
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_logits_match_transformers_at_tp1_and_tp2(deepseek_dirs):
    tokens = _tokens(1000)
    refs = {}
    for name, hf_dir in deepseek_dirs.items():
        refs[name], margin = _reference(hf_dir, tokens), routing_margin(hf_dir, tokens)
        assert margin >= MARGIN, f"{name}: the test tokens route within {margin:.1e} of a tie; pick other tokens"
    ranks = run_distributed(_body, 2, args=(deepseek_dirs, tokens), timeout=600)
    logits = {k: v for rank in reversed(ranks) for k, v in rank.items() if k[0] == "logits"}  # PP: rank 1's
    assert {k[1] for k in logits} == set(LAYOUTS) - {"ep2"}, sorted(logits)
    for key, got in logits.items():
        _, layout, name = key
        ref = refs[name]
        assert got.shape == ref.shape, (key, got.shape, ref.shape)
        assert _rel(got, ref) <= 1e-5, f"{layout}/{name}: max relative error {_rel(got, ref):.2e} vs transformers"

    def merged(layout: str, what: str) -> dict:
        """Both ranks' tensors by global name: at EP=2 each holds half the experts."""
        return {**ranks[1]["train", layout][what], **ranks[0]["train", layout][what]}

    ref_grads, ref_params = merged("tp1", "grads"), merged("tp1", "params")
    assert all(ref_grads[n].abs().max() > 0 for n in ref_grads if "router" in n or "kv_down" in n)
    assert [r["train", "pp2_uneven"]["layers"] for r in ranks] == [[0], [1, 2, 3]]
    for layout in ("tp2_sp", "ep2", "pp2_uneven"):
        grads, params = merged(layout, "grads"), merged(layout, "params")
        assert grads.keys() == ref_grads.keys(), layout
        for name, ref in ref_grads.items():
            # the rotary key's share of the key/value latent is the part Megatron's own TP projection got wrong
            assert _rel(grads[name], ref) <= 2e-6, f"{layout} gradient of {name}: {_rel(grads[name], ref):.2e}"
        for name, ref in ref_params.items():
            assert _rel(params[name], ref) <= 1e-5, f"{layout} {name} after 3 steps: {_rel(params[name], ref):.2e}"
    initial = merged("tp1", "bias")
    loaded = load_file(f"{deepseek_dirs['q_lora']}/model.safetensors")
    moved = [n for n, b in initial.items() if not torch.equal(b, loaded[_hf_bias_name(n)])]
    assert moved, "the expert bias did not move in three steps at build.moe_router_bias_update_rate > 0"
    for layout in LAYOUTS:
        bias = merged(layout, "bias")
        assert bias.keys() == initial.keys() and bias, layout
        for name, value in bias.items():  # the load-driven bias updates: the same tokens per expert everywhere
            assert torch.equal(value, initial[name]), f"{layout}: expert bias {name} differs from TP=1's"


def test_what_deepseek_v3_cannot_run_is_refused_before_any_model(tmp_path):
    """Context parallelism (not wired for multi-latent attention), pipeline stages the layers do not split into and
    the expert-bias update rate on a student without the bias are refused by name; a negative rate is refused by
    the build config itself."""
    from megatron_opd.config import parse_args
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models.builder import ModelBuildConfig, validate_layout
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer, tiny_hf_config
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import check_inputs

    arch = architecture_from_hf_config(tiny_hf_config("deepseek_v3").to_dict())
    with pytest.raises(ValueError, match="context parallelism is not wired for multi-latent attention"):
        validate_layout(arch, ParallelConfig(context_parallel_size=2))
    # uneven pipeline stages: Megatron's rule, checked before any model
    uneven = ParallelConfig(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=30)
    assert uneven.stage_layers(61) == [30, 31]
    with pytest.raises(ValueError, match="does not split as parallel.num_layers_in_first_pipeline_stage=30"):
        ParallelConfig(
            pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=30, num_layers_in_last_pipeline_stage=30
        ).stage_layers(61)
    with pytest.raises(ValueError, match="or set parallel.num_layers_in_first/last_pipeline_stage"):
        validate_layout(arch, ParallelConfig(pipeline_model_parallel_size=3))
    with pytest.raises(ValueError, match="needs a positive number of layers and pipeline_model_parallel_size >= 2"):
        ParallelConfig(num_layers_in_first_pipeline_stage=1)
    with pytest.raises(ValueError, match="build.moe_router_bias_update_rate must be a number >= 0"):
        ModelBuildConfig(moe_router_bias_update_rate=-1e-3)
    qwen3_moe = make_tiny_hf_model("qwen3_moe", tmp_path / "student", seed=0)
    make_tiny_tokenizer(qwen3_moe, vocab_size=1000)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    cfg = parse_args(TrainConfig, [f"student.path={qwen3_moe}", "teacher.path=", "loss.kind=sft",
                                   f"data.train_files={tmp_path / 'train.jsonl'}", "data.eval_files=",
                                   "build.moe_router_bias_update_rate=0.001"])  # fmt: skip
    with pytest.raises(ValueError, match="has no sigmoid router with an expert bias to update"):
        check_inputs(cfg)
