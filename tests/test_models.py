"""Megatron-Core models built from Hugging Face configs match transformers under TP, PP and VP."""

from __future__ import annotations

import json
import shutil
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_opd.distributed import ParallelConfig
from megatron_opd.models import (
    CheckpointError,
    UnsupportedArchitectureError,
    architecture_from_hf_config,
    load_architecture,
    validate_layout,
)
from megatron_opd.models.reference import hf_logits
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import SHAPES, shapes_at
from megatron_opd.testing.tiny_models import routing_margin, tiny_hf_config

SEQ = 16


def _tokens(num_micro_batches: int = 2, batch: int = 2, vocab: int = 1000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (num_micro_batches, batch, SEQ), generator=gen)


def _load(parallel: ParallelConfig, hf_dir: str, trainable: bool, build: dict | None = None):
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.models.builder import ModelBuildConfig

    return build_and_load(hf_dir, parallel, ModelBuildConfig(**(build or {})), trainable=trainable)


def _logits_body(layout: dict, models: dict[str, tuple[str, torch.Tensor]], build: dict | None = None):
    """Full logits of every model (name -> (HF folder, its tokens)) on the last pipeline stage (tensor-parallel
    rank 0), else None; ``build``: ``ModelBuildConfig`` fields."""
    from megatron.core import parallel_state as ps

    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.distributed.gather import gather_vocab_shards
    from megatron_opd.models.forward_backward import forward_backward

    parallel = ParallelConfig(**layout)
    initialize_distributed(parallel)
    tp_group = ps.get_tensor_model_parallel_group()
    results = {}
    for name, (hf_dir, tokens) in models.items():
        arch, chunks = _load(parallel, hf_dir, trainable=False, build=build)
        assert not any(p.requires_grad for c in chunks for p in c.parameters()), "teacher must be frozen"

        def collect(logits, batch, vocab=arch.vocab_size):
            return logits.sum() * 0.0, gather_vocab_shards(logits.detach(), tp_group)[..., :vocab]

        with torch.no_grad():
            data = forward_backward(chunks, [{"tokens": t} for t in tokens], collect, forward_only=True)
        if data and ps.get_tensor_model_parallel_rank() == 0:
            results[name] = torch.stack(data)
    return results or None


LAYOUTS = {
    "tp1": (1, dict()),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "pp2_vp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
}
MATRIX_PATH = "Megatron model vs transformers logits"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(layout, shape_dirs):
    """The matrix's shapes at each layout (sequence parallelism: TP=2's and the MoE ones; at EP=2 the alltoall
    token dispatcher, allgather elsewhere); tokens below each vocabulary, routed with a margin."""
    world, kwargs = LAYOUTS[layout]
    names = shapes_at(MATRIX_PATH, layout)
    models = {name: (shape_dirs[name], _tokens(vocab=SHAPES[name].vocab_size)) for name in names}
    for name, (hf_dir, tokens) in models.items():
        margin = routing_margin(hf_dir, tokens)
        assert margin > 1e-5, f"{name}: routing near-tie ({margin:.1e}) would test tie-breaking, not arithmetic"
    build = {"moe_token_dispatcher": "alltoall"} if layout == "ep2" else {}
    per_rank = run_distributed(_logits_body, world, args=(kwargs, models, build), timeout=600)
    results = [r for r in per_rank if r is not None]
    model_parallel = kwargs.get("tensor_model_parallel_size", 1) * kwargs.get("pipeline_model_parallel_size", 1)
    data_parallel = world // model_parallel  # EP=2 is two data-parallel ranks, each reporting the same tokens
    assert len(results) == data_parallel, f"expected {data_parallel} reporting ranks, got {len(results)}"
    for name, (hf_dir, tokens) in models.items():
        ref = torch.stack([hf_logits(hf_dir, t) for t in tokens])
        for ours in (result[name] for result in results):
            assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
            rel = ((ours - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-5, f"{layout}/{name}: max relative error {rel:.2e} vs transformers"


def _grads_body(model_dir: str, tokens: torch.Tensor):
    """Loss and full (TP-unsharded) gradients, first at TP=1 PP=1 then at TP=2 x PP=2 in the same job."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.distributed import initialize_distributed, initialize_model_parallel
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors

    def ce(logits, batch):
        labels = torch.roll(batch["tokens"], -1, dims=1)
        loss = vocab_parallel_cross_entropy(logits.float(), labels).mean()
        return loss, loss.detach()

    def run(parallel: ParallelConfig):
        arch, chunks = _load(parallel, model_dir, trainable=True)
        losses = forward_backward(chunks, [{"tokens": t} for t in tokens], ce)
        grads = full_tensors(chunks, arch, ps.get_tensor_model_parallel_group(), of="grad")
        loss = torch.stack(losses).mean() if losses else None
        return loss, grads

    initialize_distributed(ParallelConfig())
    ref = run(ParallelConfig())
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    initialize_model_parallel(parallel)
    got = run(parallel)
    return ref, got, ps.get_tensor_model_parallel_rank()


def test_forward_backward_tp2_pp2_matches_single_process(tiny_model_dirs):
    results = run_distributed(_grads_body, 4, args=(tiny_model_dirs["llama"], _tokens()), timeout=600)
    (ref_loss, ref_grads), _, _ = results[0]
    got_grads, got_losses = {}, []
    for _, (loss, grads), tp_rank in results:
        if loss is not None:
            got_losses.append(loss)
        if tp_rank == 0:
            got_grads.update(grads)
    assert len(got_losses) == 2, "both last-stage ranks report the loss"
    for loss in got_losses:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert set(got_grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"reference gradient of {name} is zero: the test would be vacuous"
        torch.testing.assert_close(got_grads[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_tp_must_divide_heads_and_kv_heads():
    arch = architecture_from_hf_config(tiny_hf_config("qwen3", num_attention_heads=6, num_key_value_heads=2).to_dict())
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        validate_layout(arch, ParallelConfig(tensor_model_parallel_size=4))
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        validate_layout(arch, ParallelConfig(tensor_model_parallel_size=3))
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        validate_layout(arch, ParallelConfig(pipeline_model_parallel_size=3))


def test_unsupported_architecture_is_named():
    cfg = tiny_hf_config("llama").to_dict()
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="model_type='gpt2'"):
        architecture_from_hf_config(cfg)
    from megatron_opd.models import families

    cfg.update(model_type="later", architectures=["LaterForCausalLM"])  # a deferred type: the reason is named
    with mock.patch.dict(families.DEFERRED, {"later": "its widget is not built"}):
        with pytest.raises(UnsupportedArchitectureError, match="model_type='later'.*widget is not built"):
            architecture_from_hf_config(cfg)
    cfg = tiny_hf_config("qwen2").to_dict()
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    with pytest.raises(UnsupportedArchitectureError, match="dynamic"):
        architecture_from_hf_config(cfg)


def _load_errors_body(missing_dir: str, wrong_dir: str):
    from megatron_opd.distributed import initialize_distributed

    initialize_distributed(ParallelConfig())
    messages = []
    for hf_dir in (missing_dir, wrong_dir):
        try:
            _load(ParallelConfig(), hf_dir, trainable=True)
            messages.append(None)
        except CheckpointError as err:
            messages.append(str(err))
    return messages


def test_missing_or_misshapen_weight_is_named(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["llama"]
    dirs = {}
    for case in ("missing", "wrong"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        if case == "missing":
            del tensors["model.layers.2.mlp.up_proj.weight"]
        else:
            tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        dirs[case] = str(dst)
    missing, wrong = run_distributed(_load_errors_body, 1, args=(dirs["missing"], dirs["wrong"]))[0]
    assert missing is not None and "model.layers.2.mlp.up_proj.weight" in missing and "missing" in missing
    assert wrong is not None and "model.layers.1.self_attn.k_proj.weight" in wrong
    assert "(32, 64)" in wrong and "(64, 64)" in wrong and "model.safetensors" in wrong


def test_architecture_reads_config_json(tiny_model_dirs):
    arch = load_architecture(tiny_model_dirs["qwen3"])
    with open(f"{tiny_model_dirs['qwen3']}/config.json") as f:
        cfg = json.load(f)
    assert (arch.family, arch.vocab_size, arch.qk_norm, arch.qkv_bias) == ("qwen3", 1001, True, False)
    assert arch.num_key_value_heads == cfg["num_key_value_heads"] == 2
    assert arch.padded_vocab_size(2) == 1024 and arch.padded_vocab_size(4) == 1024 and arch.padded_vocab_size(1) == 1024
    assert load_architecture(tiny_model_dirs["qwen2"]).qkv_bias


def test_sliding_window_is_read_never_ignored(shape_dirs):
    """Mistral's window reaches Megatron's config (its logits, window 5 < 16 tokens, are in the shape matrix)."""
    from megatron_opd.models import ModelBuildConfig, transformer_config

    arch = load_architecture(shape_dirs["mistral_window"])
    assert arch.sliding_window == 5
    assert transformer_config(arch, ParallelConfig(), ModelBuildConfig()).window_size == (4, 0)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("llama", tmp_path / "linear", rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert load_architecture(hf_dir).rope.type == "linear"
    tokens = _tokens(num_micro_batches=1)
    (result,) = run_distributed(_logits_body, 1, args=({}, {"linear": (hf_dir, tokens)}))
    ref = hf_logits(hf_dir, tokens[0])
    rel = ((result["linear"][0] - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"linear RoPE scaling: max relative error {rel:.2e} vs transformers"


def _hf_named_grads_body(models: dict[str, str], tokens: torch.Tensor):
    """Each model's cross-entropy loss and every gradient at TP=1 (the padded vocabulary rows masked), by Hugging
    Face name (a stacked expert tensor's row as ``name[e]``)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.name_mapping import megatron_to_hf, rules_by_megatron_name
    from megatron_opd.models.reference import full_tensors

    initialize_distributed(ParallelConfig())
    out = {}
    for name, hf_dir in models.items():
        arch, chunks = _load(ParallelConfig(), hf_dir, trainable=True)

        def ce(logits, batch, vocab=arch.vocab_size):
            labels = torch.roll(batch["tokens"], -1, dims=1)
            padded = torch.arange(logits.shape[-1]) >= vocab
            loss = vocab_parallel_cross_entropy(logits.float().masked_fill(padded, -1e30), labels).mean()
            return loss, loss.detach()

        (loss,) = forward_backward(chunks, [{"tokens": tokens}], ce)
        rules, grads = rules_by_megatron_name(arch), {}
        for megatron, grad in full_tensors(chunks, arch, None, of="grad").items():
            layer = int(megatron.split(".")[2]) if megatron.startswith("decoder.layers.") else None
            grads.update(zip(rules[megatron].hf_names(layer), megatron_to_hf(rules[megatron], grad, arch)))
        out[name] = (loss, grads)
    return out


def test_gemma4_student_gradients_match_transformers(shape_dirs):
    """A Gemma 4 student's every gradient equals transformers' (TP=1, fp32): shared keys/values carry the sharing
    layers' gradient back to the producing layers, the per-layer input tables and projections, the layer scalars'
    neighbours, and in the MoE variant the router's scales, the experts and keys = values."""
    from transformers import AutoModelForCausalLM

    models = {name: shape_dirs[name] for name in ("gemma4_shared_kv", "gemma4_moe")}
    tokens = _tokens(num_micro_batches=1, vocab=1001)[0]
    (results,) = run_distributed(_hf_named_grads_body, 1, args=(models, tokens), timeout=600)
    for name, (loss, grads) in results.items():
        model = AutoModelForCausalLM.from_pretrained(models[name]).float()
        logits = model(tokens).logits
        ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, dims=1).flatten())
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        params = dict(model.named_parameters())
        checked = 0
        for hf_name, grad in grads.items():
            base, _, row = hf_name[:-1].partition("[") if hf_name.endswith("]") else (hf_name, "", "")
            if base not in params:  # buffers (layer_scalar)
                continue
            ref = params[base].grad[int(row)] if row else params[base].grad
            rel = ((grad[: ref.shape[0]] - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-4, f"{name}: gradient of {hf_name} off by {rel:.1e} (relative) from transformers'"
            checked += 1
        assert checked >= len(params) - 1, f"{name}: {checked} of {len(params)} gradients compared"
