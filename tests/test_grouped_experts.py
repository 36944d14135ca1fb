"""Grouped expert GEMMs (``build.moe_grouped_gemm`` without TransformerEngine) compute what Megatron's
``SequentialMLP`` computes: the same parameters, logits and gradients, also for experts that get no token."""

from __future__ import annotations

import torch

from megatron_opd.testing.multiprocess import run_distributed


def _body(families: tuple[str, ...]):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig, build_model
    from megatron_opd.models.grouped_experts import GroupedExperts
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.tiny_models import tiny_hf_config

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    results = {}
    for family in families:
        arch = architecture_from_hf_config(tiny_hf_config(family).to_dict(), family)
        models = {}
        for grouped in (False, True):
            (models[grouped],) = build_model(arch, parallel, ModelBuildConfig(dtype="fp32", moe_grouped_gemm=grouped))
        sequential, grouped = models[False], models[True]
        grouped.load_state_dict(sequential.state_dict())  # strict: the same parameter names
        experts = [m for m in grouped.modules() if isinstance(m, SequentialMLP)]
        assert experts and all(type(m) is GroupedExperts for m in experts)

        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 1000, (2, 24), generator=gen)
        positions = torch.arange(24).expand(2, -1)
        weight = torch.randn(2, 24, arch.padded_vocab_size(1, 128), generator=gen)
        out = {}
        for name, model in (("sequential", sequential), ("grouped", grouped)):
            logits = model(tokens, positions, attention_mask=None)
            (logits * weight).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            out[name] = (logits.detach(), grads)

        # One layer's experts called directly: uneven groups, one expert with no token.
        layer = experts[0]
        counts = torch.tensor([5, 0, 7, 4][: layer.num_local_experts])
        hidden = torch.randn(int(counts.sum()), arch.hidden_size, generator=gen)
        probs = torch.rand(int(counts.sum()), generator=gen)
        assert layer._grouped_ok(hidden), "the grouped path must run here, not SequentialMLP's loop"
        direct = layer(hidden, counts, probs)[0], SequentialMLP.forward(layer, hidden, counts, probs)[0]
        results[family] = (out, direct)
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_grouped_experts_equal_sequential():
    """Qwen3-MoE, Qwen2-MoE (a shared expert) and gpt-oss (biased experts, the clamped SwiGLU with its +1 offset)."""
    (results,) = run_distributed(_body, 1, args=(("qwen3_moe", "qwen2_moe", "gpt_oss"),), timeout=600)
    for family, (out, (grouped_direct, sequential_direct)) in results.items():
        (seq_logits, seq_grads), (grp_logits, grp_grads) = out["sequential"], out["grouped"]
        assert _rel(grp_logits, seq_logits) <= 1e-6, family
        assert seq_grads.keys() == grp_grads.keys()
        expert_grads = [n for n in seq_grads if ".experts.local_experts." in n]
        assert expert_grads, f"{family}: no expert received a gradient"
        for name, grad in seq_grads.items():
            assert _rel(grp_grads[name], grad) <= 1e-6, (family, name)
        assert _rel(grouped_direct, sequential_direct) <= 1e-6, family


def test_grouped_mm_probe_names_what_is_missing(monkeypatch):
    from megatron_opd.models import grouped_experts

    grouped_experts.grouped_mm_unavailable.cache_clear()
    try:
        assert grouped_experts.grouped_mm_unavailable("cpu", torch.float32) is None
        monkeypatch.delattr(torch, "_grouped_mm")
        grouped_experts.grouped_mm_unavailable.cache_clear()
        assert "has no torch._grouped_mm" in grouped_experts.grouped_mm_unavailable("cpu", torch.float32)
    finally:
        grouped_experts.grouped_mm_unavailable.cache_clear()
