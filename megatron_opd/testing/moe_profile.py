"""Per-layer operator counts and host syncs of the tiny MoE and MLA shapes, built in this process at EP=1.

``benchmarks/RESULTS.md`` records the counts :func:`layer_profiles` gives and ``tests/test_moe_ops.py`` pins them:
a change that adds operators to an MoE layer (the router, the token permutation, the experts, the shared expert) or
to multi-latent attention shows on CPU, and so does one that adds a host sync. The fused layer's custom operators
(``megatron_opd.moe.ops``, ``fused_topk_routing``) count one each, their launches on CUDA (one Triton kernel each),
not the torch operators of their CPU implementation (``megatron_opd.testing.op_count``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from megatron_opd.testing.host_sync import count_host_syncs
from megatron_opd.testing.op_count import count_ops

PROFILED = ("qwen3_moe_dense0", "qwen2_moe_shared", "mixtral_untied", "deepseek_v3_mla")
"""Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral and DeepSeek-V3 (MLA, sigmoid group-limited router)."""
TOKENS = 32
"""Tokens through each layer (``[s, b] = [16, 2]``)."""


@dataclass
class LayerProfile:
    """One layer's operators launched (forward, backward) and the host syncs of its forward."""

    forward: Counter = field(default_factory=Counter)
    backward: Counter = field(default_factory=Counter)
    syncs: list[str] = field(default_factory=list)


def build_shape(name: str, build=None, parallel=None):
    """The Megatron model of shape ``name`` (random weights) under the initialised groups of ``parallel``."""
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models.builder import ModelBuildConfig, build_model
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.shapes import SHAPES
    from megatron_opd.testing.tiny_models import tiny_hf_config

    shape = SHAPES[name]
    arch = architecture_from_hf_config(tiny_hf_config(shape.family, **shape.hf_overrides()).to_dict(), shape.family)
    (model,) = build_model(arch, parallel or ParallelConfig(), build or ModelBuildConfig())
    return arch, model


def profile(module, *inputs, **kwargs) -> LayerProfile:
    """``module(*inputs)``'s forward (operators and host syncs) and a backward of its output's sum (operators),
    after a first forward (what a layer makes once per process, such as a cached index range, is not counted)."""
    prof = LayerProfile()
    module(*inputs, **kwargs)
    with count_ops(prof.forward), count_host_syncs(prof.syncs):
        out = module(*inputs, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    loss = out.float().square().sum()
    with count_ops(prof.backward):
        loss.backward()
    return prof


def layer_profiles(name: str, build=None) -> dict[str, LayerProfile]:
    """``{"moe": ..., "attention": ...}`` of the first MoE layer of shape ``name``: its MLP (router, dispatcher,
    experts, shared expert) and its self-attention, each called on ``TOKENS`` random hidden states."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    arch, model = build_shape(name, build)
    layer = next(lyr for lyr in model.decoder.layers if isinstance(lyr.mlp, MoELayer))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS // 2, 2, arch.hidden_size, generator=gen, requires_grad=True)
    out = {"moe": profile(layer.mlp, hidden)}
    rotary = model.rotary_pos_emb(TOKENS // 2) if getattr(model, "rotary_pos_emb", None) is not None else None
    hidden = hidden.detach().requires_grad_()
    out["attention"] = profile(layer.self_attention, hidden, attention_mask=None, rotary_pos_emb=rotary)
    return out


def profiles(names: tuple[str, ...] = PROFILED) -> dict[str, dict[str, LayerProfile]]:
    """Per shape: Megatron's MoE layer (``moe``), the fused one (``moe fused``, ``build.moe_fused_routing``) and the
    attention (``attention``: MLA for DeepSeek-V3)."""
    from megatron_opd.models.builder import ModelBuildConfig

    out = {}
    for name in names:
        out[name] = layer_profiles(name)
        out[name]["moe fused"] = layer_profiles(name, ModelBuildConfig(moe_fused_routing=True))["moe"]
    return out


RECORDED: dict[str, dict[str, tuple[int, int]]] = {
    "qwen3_moe_dense0": {"moe": (27, 21), "moe fused": (9, 15), "attention": (36, 52)},
    "qwen2_moe_shared": {"moe": (36, 37), "moe fused": (12, 23), "attention": (24, 25)},
    "mixtral_untied": {"moe": (27, 21), "moe fused": (9, 15), "attention": (24, 24)},
    "deepseek_v3_mla": {"moe": (50, 38), "moe fused": (13, 21), "attention": (45, 70)},
}
"""Operators launched (forward, backward) per layer of each profiled shape at ``TOKENS`` tokens, CPU, fp32
(``benchmarks/RESULTS.md``); ``tests/test_moe_ops.py`` fails when a count rises above its number here."""


def markdown_table(recorded: dict[str, dict[str, tuple[int, int]]] = RECORDED) -> str:
    """:data:`RECORDED` as the table in ``benchmarks/RESULTS.md``."""
    lines = [
        "| shape | MoE layer, Megatron (fwd / bwd) | MoE layer, `build.moe_fused_routing` (fwd / bwd) | attention (fwd / bwd) |",
        "|---|---|---|---|",
    ]
    for name, layers in recorded.items():
        cells = [f"{layers[k][0]} / {layers[k][1]}" for k in ("moe", "moe fused", "attention")]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
