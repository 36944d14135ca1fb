"""The model-family API: shared machinery never branches on a family's name (import circles: test_import_graph.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_opd.models.families import BY_MODEL_TYPE, FAMILIES, ModelFamily

ROOT = Path(__file__).resolve().parents[1]
FAMILY_DIR = ROOT / "megatron_opd" / "models" / "families"
NAMES = frozenset(FAMILIES) | frozenset(BY_MODEL_TYPE)


def family_branches(source: str) -> list[str]:
    """Family names and model types written as string literals, and comparisons against ``model_type``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in NAMES:
            found.append(f"line {node.lineno}: literal {node.value!r}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            # model_type == x picks a family by name (the registry lookup `in BY_MODEL_TYPE` is how to ask);
            # SentencePiece's numeric model_type (tokenizer.py) is not a Hugging Face model type.
            operands = [node.left, *node.comparators]
            names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in operands}
            numeric = any(isinstance(n, ast.Constant) and isinstance(n.value, int) for n in operands)
            if "model_type" in names and not numeric:
                found.append(f"line {node.lineno}: model_type comparison")
    return found


def shared_modules() -> list[Path]:
    files = sorted((ROOT / "megatron_opd").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    return [f for f in files if FAMILY_DIR not in f.parents]


def test_scanner_finds_a_family_branch():
    assert family_branches('if arch.family == "qwen3":\n    pass') == ["line 1: literal 'qwen3'"]
    assert family_branches("ok = cfg.model_type != kind") == ["line 1: model_type comparison"]
    assert family_branches('"""Llama / Qwen2 / Qwen3 docs."""\nx = "llama3"') == []


def test_shared_machinery_never_names_a_family():
    offenders = {}
    for path in shared_modules():
        hits = family_branches(path.read_text(encoding="utf-8"))
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, f"declare these in megatron_opd/models/families/ instead: {offenders}"


def test_every_family_declares_its_model_types_and_shapes():
    for name, family in FAMILIES.items():
        assert family.name == name and family.model_types, name
        assert family.test_shapes, f"family {name} declares no test shape (ModelFamily.test_shapes)"
    assert len(BY_MODEL_TYPE) == sum(len(f.model_types) for f in FAMILIES.values()), "a model_type in two families"


def test_loader_fills_a_buffer_a_rule_names(monkeypatch, tmp_path):
    """A weight rule with ``buffer=True`` (DeepSeek-V3's expert bias) is loaded like a parameter."""
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from megatron_opd.models import families, loading
    from megatron_opd.models.families.base import ModelFamily
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.models.name_mapping import Split, WeightRule

    class WithBuffer(ModelFamily):
        def weight_rules(self, arch):
            return [
                WeightRule("norm.weight", ("model.norm.weight",), Split.REPLICATED),
                WeightRule("expert_bias", ("model.expert_bias",), Split.REPLICATED, buffer=True),
            ]

    base = next(iter(FAMILIES.values()))
    monkeypatch.setitem(families.FAMILIES, "with_buffer", WithBuffer("with_buffer", ("with_buffer",), base.read_config))
    monkeypatch.setattr(loading, "chunk_layer_range", lambda chunk: range(0))
    sizes = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=128, vocab_size=1000)
    arch = architecture_from_hf_config({"model_type": base.model_types[0], **sizes})
    arch = dataclasses.replace(arch, family="with_buffer")
    chunk = torch.nn.ModuleDict({"norm": torch.nn.Module()})
    chunk.norm.weight = torch.nn.Parameter(torch.zeros(64))
    chunk.register_buffer("expert_bias", torch.zeros(64))
    chunk.vocab_size = 1024
    want = {"model.norm.weight": torch.randn(64), "model.expert_bias": torch.randn(64)}
    save_file(want, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loading.load_hf_weights([chunk], arch, tmp_path, tp_rank=0, tp_size=1, te=False)
    assert torch.equal(chunk.norm.weight.detach(), want["model.norm.weight"])
    assert torch.equal(chunk.expert_bias, want["model.expert_bias"])


class _LocalFirstLayer(ModelFamily):
    """The dense decoder with Megatron's own core attention in layer 0 only: a spec per layer, as MoE needs."""

    def layer_specs(self, arch, layers, options):
        import dataclasses

        specs = super().layer_specs(arch, layers, dataclasses.replace(options, attention="sdpa"))
        local = super().layer_specs(arch, layers, dataclasses.replace(options, attention="local"))
        return [local[i] if layer == 0 else specs[i] for i, layer in enumerate(layers)]


def _per_layer_body(layout: dict):
    import dataclasses

    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models import families
    from megatron_opd.models.builder import build_model
    from megatron_opd.models.hf_config import architecture_from_hf_config

    base = next(iter(FAMILIES.values()))
    families.FAMILIES["local_first"] = _LocalFirstLayer("local_first", ("local_first",), base.read_config)
    parallel = ParallelConfig(**layout)
    initialize_distributed(parallel)
    sizes = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=4, intermediate_size=128, vocab_size=100)
    arch = dataclasses.replace(
        architecture_from_hf_config({"model_type": base.model_types[0], **sizes}), family="local_first"
    )
    chunks = build_model(arch, parallel, trainable=False)
    return [[type(layer.self_attention.core_attention).__name__ for layer in c.decoder.layers] for c in chunks]


def test_builder_takes_a_spec_per_layer():
    """Layer specs go by global layer index: only layer 0 (on the first of two pipeline stages) differs."""
    from megatron_opd.testing.multiprocess import run_distributed

    ranks = run_distributed(_per_layer_body, 2, args=(dict(pipeline_model_parallel_size=2),))
    assert ranks == [[["DotProductAttention", "SDPAttention"]], [["SDPAttention", "SDPAttention"]]], ranks


def test_issue_52_dense_fields_are_read_or_refused_by_name():
    """Each dense family of issue #52 reads its own ``config.json`` fields, and a field it cannot honour is refused
    naming that field (the logits of the tiny models against transformers are in the shape matrix)."""
    import pytest

    from megatron_opd.model_files import ConfigFileError, UnsupportedArchitectureError
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.tiny_models import tiny_hf_config

    def cfg(family, **fields):
        return {**tiny_hf_config(family).to_dict(), **fields}

    assert architecture_from_hf_config(cfg("smollm3", no_rope_layers=[1, 0, 1, 0])).no_rope_layers == (
        False, True, False, True,
    )  # fmt: skip
    assert architecture_from_hf_config(cfg("smollm3", no_rope_layers=[1, 1, 1, 1])).no_rope_layers is None
    granite = architecture_from_hf_config(cfg("granite"))
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert (granite.softmax_scale, granite.logits_scaling) == (0.015625, 8.0)
    gemma2 = architecture_from_hf_config(cfg("gemma2"))
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (0.5, 1.0)
    assert gemma2.sliding_layers == (True, False, True, False) and not gemma2.qk_norm
    olmo3 = architecture_from_hf_config(cfg("olmo3", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert olmo3.sliding_layers == (True, True, True, False) and olmo3.local_rope.type == "default"
    assert olmo3.rope.type == "linear"
    seed = architecture_from_hf_config(cfg("seed_oss"))
    assert seed.qkv_bias and seed.head_dim == 32 != seed.hidden_size // seed.num_attention_heads
    refused = [
        (cfg("seed_oss", attention_out_bias=True), UnsupportedArchitectureError, "attention_out_bias"),
        (cfg("smollm3", no_rope_layers=[1, 1]), UnsupportedArchitectureError, "no_rope_layers"),
        (cfg("smollm3", use_sliding_window=True, sliding_window=8), UnsupportedArchitectureError, "use_sliding_window"),
        (cfg("granite", logits_scaling=0), ConfigFileError, "'logits_scaling' must be a positive number"),
        (cfg("gemma2", attn_logit_softcapping=-1.0), ConfigFileError, "'attn_logit_softcapping' must be a positive"),
        (cfg("olmo3", layer_types=["sliding_attention"]), UnsupportedArchitectureError, "layer_types"),
    ]
    for config, error, message in refused:
        with pytest.raises(error, match=message):
            architecture_from_hf_config(config)


def test_gemma4_fields_are_read_and_crossing_layouts_refused_by_name():
    """Gemma 4's per-layer fields as transformers 5.19 writes them (``per_layer_config``) and as published
    checkpoints do (``global_head_dim``); pipeline and context parallelism refused by name, before any model, where
    per-layer inputs or shared keys/values would cross ranks, and allowed without them."""
    import pytest

    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.model_files import UnsupportedArchitectureError
    from megatron_opd.models.builder import validate_layout
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.tiny_models import tiny_hf_config

    written = tiny_hf_config("gemma4").to_dict()
    published = {k: v for k, v in written.items() if k != "per_layer_config"}
    for cfg in (written, {**published, "global_head_dim": 64}):
        arch = architecture_from_hf_config(cfg)
        g = arch.gemma4
        assert (g.full_layers, g.global_head_dim, g.global_kv_heads, arch.head_dim) == ((1, 4), 64, 2, 32)
        assert g.kv_sources == (None, None, None, 2, 1) and g.ffn_widths == (128, 128, 128, 256, 256)
        assert (arch.rope.type, arch.rope.partial_rotary_factor, g.sliding_rope.type) == (
            "proportional",
            0.25,
            "default",
        )
        assert (arch.softmax_scale, arch.final_logit_softcapping, g.per_layer_input_size) == (1.0, 1.0, 16)
    validate_layout(arch, ParallelConfig(tensor_model_parallel_size=2))
    for field in ("pipeline_model_parallel_size", "context_parallel_size"):
        with pytest.raises(ValueError, match=f"parallel.{field}=2: .*hidden_size_per_layer_input=16.*num_kv_shared_"):
            validate_layout(arch, ParallelConfig(**{field: 2}))
    from megatron_opd.models.builder import ModelBuildConfig, transformer_config

    with pytest.raises(ValueError, match="build.recompute_granularity=full: .*num_kv_shared_layers=2"):
        transformer_config(arch, ParallelConfig(), ModelBuildConfig(recompute_granularity="full"))
    plain = architecture_from_hf_config({**published, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0})
    moe = architecture_from_hf_config({**published, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                       "moe_intermediate_size": 32, "attention_k_eq_v": True,
                                       "num_global_key_value_heads": 1})  # fmt: skip
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.layers) == (4, 2, (0, 1, 2, 3, 4))
    assert moe.gemma4.keys_are_values and moe.gemma4.global_kv_heads == 1
    with pytest.raises(ValueError, match="does not divide the full-attention layers' 1 key/value heads"):
        validate_layout(moe, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    validate_layout(plain, ParallelConfig(pipeline_model_parallel_size=5))  # nothing crosses a stage
    refused = [
        ({"vocab_size_per_layer_input": 7}, "vocab_size_per_layer_input=7"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers=5"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ]
    for fields, message in refused:
        with pytest.raises(UnsupportedArchitectureError, match=message):
            architecture_from_hf_config({**written, **fields})


def test_gemma4_wrappers_and_unified_text_read_as_their_text_model(tmp_path, caplog):
    """A ``gemma4`` multimodal folder reads as its text tower (the other towers' tensors skipped, named in one log
    line); ``gemma4_unified_text`` is Gemma 4's text decoder without per-layer inputs (its fields' defaults)."""
    import json
    import logging

    import torch
    from safetensors.torch import save_file

    from megatron_opd.models.hf_config import architecture_from_hf_config, load_architecture
    from megatron_opd.models.hf_io import HFCheckpointReader
    from megatron_opd.testing.tiny_models import tiny_hf_config

    text = tiny_hf_config("gemma4").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")},
    }))  # fmt: skip
    tensors = {"model.language_model.norm.weight": torch.ones(64), "model.vision_tower.patch.weight": torch.ones(2),
               "model.audio_tower.conv.weight": torch.ones(2)}  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert load_architecture(tmp_path) == architecture_from_hf_config(text)
    with caplog.at_level(logging.INFO, logger="megatron_opd.models.wrappers"):
        assert HFCheckpointReader(tmp_path).names() == ["model.norm.weight"]
    assert "model.audio_tower.* (1 tensors), model.vision_tower.* (1 tensors)" in caplog.text
    unified = {k: v for k, v in text.items() if "per_layer_input" not in k and k != "model_type"}
    arch = architecture_from_hf_config({**unified, "model_type": "gemma4_unified_text",
                                        "use_bidirectional_attention": "vision"})  # fmt: skip
    assert arch.family == "gemma4" and arch.gemma4.per_layer_input_size == 0
    assert arch.gemma4.kv_sources == (None, None, None, 2, 1)
