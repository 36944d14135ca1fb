"""Every GPU row of the open issues in one device call, as a markdown table for ``benchmarks/RESULTS.md``.

Prepare here, once (``.whl`` stays out of git; the device image has Python 3.12, torch, transformers, no network,
and no Megatron-Core or pyzmq):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl "megatron-core==0.19.*" pyzmq flash-linear-attention fla-core

Then one device call (``carry: [".whl"]``, ``timeout_s: 600``); every row runs in its own process under its own
time limit, and the whole script stops itself before ``--budget`` seconds:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu/check.py --budget 540 --out $OUT/gpu.md

Without a GPU, ``--cpu-smoke`` runs the same rows at tiny shapes on CPU in fp32 (random tiny models, a few
hundred tokens; about a minute): it checks the script, not the figures.

Rows (``ROWS``): #35 a Qwen3-30B-A3B-shaped MoE teacher scoring (bf16, 30.5B parameters, 3.3B active: MFU
counts active parameters), with sequential experts and with grouped expert GEMMs (TransformerEngine's, else
megatron-opd's ``GroupedExperts`` on ``torch._grouped_mm``; skipped with the reason where neither runs); #36 a
DeepSeek-V2-Lite-sized DeepSeek-V3-architecture teacher scoring (multi-latent attention with YaRN, 64 routed experts
top-6, 2 shared, the first layer dense; MFU against active parameters), sequential and grouped, and the same model
as a student: a 4,096-token update with full recompute; #39 the Qwen3-1.7B update at CP=1 at 32k and 64k tokens
with full recompute; #54 a Qwen3-Next-80B-A3B-shaped teacher scoring (Gated DeltaNet hybrid, 512 experts top-10, 16
of its 48 layers to fit one GPU; ``HYBRID_SIZES``) and a Qwen3.5-shaped (transformers' default dense text tower, 9.0B) student's 4,096-token
update with full recompute, the note saying whether fla's kernels ran; #53 a gpt-oss-20B-shaped teacher scoring (``memory_configs``' gpt-oss-20b: 24 layers, 32
experts top-4 with biases, attention sinks, 128-token windows on alternate layers, YaRN; 20.9B parameters, 4.19B
active as counted here, the input embedding included: OpenAI's 3.61B leaves it out), sequential and grouped (the
grouped GEMMs run its biased clamped-SwiGLU experts), beside #35's row; #40 the Qwen3-1.7B update at 4,096
tokens (bf16, no TransformerEngine; MFU against 989 TFLOP/s dense bf16, 6N FLOPs per token, attention not counted) and one end-to-end trainer run on the GPU
defaults (bf16 parameters, Megatron's distributed optimizer; the tiny distillation fixture, three steps). Update
and scoring rows are ``benchmarks/bench_phases_gpu.py``'s measurements (random weights in the recipes' shapes).
#57 before and after in one call (``issue_57_rows``), both the Qwen3-30B-A3B and the DeepSeek-V3 (V2-Lite sizes)
shapes with grouped experts: scoring with Megatron's MoE layer, with ``build.moe_fused_routing`` (routing on top-k
indices, the Triton router, the sort-based permutation: no host sync; the gather, SwiGLU-times-probability and
combine one Triton kernel each, ``kernels/moe_dispatch_triton.py``), and with ``teacher.cuda_graphs`` too (one
4,096-token bucket captured on the first call; the note gives the capture's time and the replay's top-k gap to the
eager teacher); then the updates (full recompute) with each MoE layer, the Qwen3-30B-A3B one last (bf16 parameters
and gradients, about 114 GiB of the H200's 139). Each #57 row's note counts the aten operators of one MoE layer and
its attention on the device (``layer_counts``) and the MoE layer's host syncs. ``--cpu-smoke`` runs the graph rows
through the same bucketed path with the eager runner (no capture on CPU).
``--issues 36,40`` runs those issues' rows only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

PEAK_FLOPS = 989e12  # dense bf16, H100 and H200


@dataclass(frozen=True)
class Row:
    issue: str
    what: str
    kind: str  # "update" | "score" | "train"
    model: str = ""  # a trainer.memory.KNOWN_CONFIGS name, or a transformers config class for families to come
    tokens: int = 0
    recompute: str | None = None
    limit_s: int = 240
    smoke_tokens: int = 0
    grouped_gemm: bool = False  # MoE rows: Megatron's grouped expert GEMM instead of sequential experts
    fused_routing: bool = False  # MoE rows: build.moe_fused_routing (megatron_opd.moe, the Triton router)
    cuda_graphs: bool = False  # scoring rows: teacher.cuda_graphs (the forward replayed as a captured CUDA graph)
    op_counts: bool = False  # MoE rows: operators and host syncs of one MoE layer and its attention, beside the time


ISSUE_57_MODELS = (("Qwen3MoeConfig", "Qwen3-30B-A3B-shaped MoE"),
                   ("DeepseekV3Config", "DeepSeek-V2-Lite-sized DeepSeek-V3-architecture"))  # fmt: skip


def issue_57_rows() -> tuple[Row, ...]:
    """#57 before and after in one call, both shapes: scoring with Megatron's MoE layer, with
    ``build.moe_fused_routing``, and with ``teacher.cuda_graphs`` too; then the updates (full recompute) with each
    layer, the Qwen3-30B-A3B one last (its bf16 parameters and gradients, about 114 GiB, are the largest)."""
    rows = []
    for kind, variants in (
        ("score", ((False, False), (True, False), (True, True))),
        ("update", ((False, False), (True, False))),
    ):
        for model, name in ISSUE_57_MODELS if kind == "score" else ISSUE_57_MODELS[::-1]:
            for fused, graphs in variants:
                what = (
                    f"{name} {'teacher, scoring' if kind == 'score' else 'student, update'}, grouped GEMM, "
                    + ("fused routing" if fused else "Megatron's MoE layer")
                    + (", CUDA graphs" if graphs else "")
                )
                rows.append(Row("#57", what, kind, model, 4096, "full" if kind == "update" else None, limit_s=300,
                                smoke_tokens=64, grouped_gemm=True, fused_routing=fused, cuda_graphs=graphs,
                                op_counts=True))  # fmt: skip
    return tuple(rows)


ISSUE_57_ROWS = issue_57_rows()


ROWS = (
    Row(
        "#35",
        "Qwen3-30B-A3B-shaped MoE teacher, scoring, sequential experts",
        "score",
        "Qwen3MoeConfig",
        4096,
        smoke_tokens=64,
    ),
    Row(
        "#35",
        "Qwen3-30B-A3B-shaped MoE teacher, scoring, grouped GEMM",
        "score",
        "Qwen3MoeConfig",
        4096,
        smoke_tokens=64,
        grouped_gemm=True,
    ),
    Row(
        "#36",
        "DeepSeek-V2-Lite-sized DeepSeek-V3-architecture teacher, scoring, sequential experts",
        "score",
        "DeepseekV3Config",
        4096,
        smoke_tokens=64,
    ),
    Row(
        "#36",
        "DeepSeek-V2-Lite-sized DeepSeek-V3-architecture teacher, scoring, grouped GEMM",
        "score",
        "DeepseekV3Config",
        4096,
        smoke_tokens=64,
        grouped_gemm=True,
    ),
    Row(
        "#36",
        "DeepSeek-V2-Lite-sized DeepSeek-V3-architecture student, update, grouped GEMM",
        "update",
        "DeepseekV3Config",
        4096,
        "full",
        smoke_tokens=64,
        grouped_gemm=True,
    ),
    *ISSUE_57_ROWS,
    Row(
        "#53",
        "gpt-oss-20B-shaped MoE teacher, scoring, sequential experts",
        "score",
        "gpt-oss-20b",
        4096,
        smoke_tokens=64,
    ),
    Row(
        "#53",
        "gpt-oss-20B-shaped MoE teacher, scoring, grouped GEMM",
        "score",
        "gpt-oss-20b",
        4096,
        smoke_tokens=64,
        grouped_gemm=True,
    ),
    Row("#39", "Qwen3-1.7B update, CP=1, full recompute", "update", "Qwen3-1.7B", 32768, "full", smoke_tokens=256),
    Row("#39", "Qwen3-1.7B update, CP=1, full recompute", "update", "Qwen3-1.7B", 65536, "full", smoke_tokens=512),
    Row("#40", "Qwen3-1.7B update, bf16, no TE", "update", "Qwen3-1.7B", 4096, smoke_tokens=128),
    Row("#40", "trainer run on the GPU defaults (3 steps, tiny fixture)", "train", limit_s=180),
    Row(
        "#54",
        "Qwen3-Next-80B-A3B-shaped hybrid MoE teacher (16 of its 48 layers), scoring, grouped GEMM",
        "score",
        "Qwen3NextConfig",
        4096,
        smoke_tokens=64,
        grouped_gemm=True,
    ),
    Row(
        "#54",
        "Qwen3.5-shaped hybrid student (transformers' default text tower, 9.0B), update",
        "update",
        "Qwen3_5TextConfig",
        4096,
        "full",
        smoke_tokens=64,
    ),
)


HYBRID_SIZES = {
    "Qwen3NextConfig": dict(num_hidden_layers=16),
    "Qwen3_5TextConfig": dict(),
}
"""Gated DeltaNet hybrids (issue #54): transformers' defaults are the published shapes (Qwen3-Next-80B-A3B: 48 layers,
512 experts top-10, 3.0B active; Qwen3.5's dense text tower: 32 layers of 4,096, about 9B). The 80B teacher keeps 16
layers (4 of them attention, as in the full model's 3:1 pattern; about 27B parameters, 54 GB in bf16) to fit one
141 GB GPU beside its activations: the scoring rate per layer and the MFU of active parameters are what it measures.
The DeltaNet layers run fla's kernels where fla is importable on the device (``pip download --no-deps
flash-linear-attention fla-core`` into ``.whl`` beside Megatron-Core), else the PyTorch forms; the row's note says
which (``build.gated_delta_net_kernel=auto``)."""
HYBRID_FAMILIES = {"Qwen3NextConfig": "qwen3_next", "Qwen3_5TextConfig": "qwen3_5"}

DEEPSEEK_V2_LITE_SIZE = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    moe_intermediate_size=1408,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rope_theta=10000.0,
    rope_scaling=dict(
        type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        mscale=0.707, mscale_all_dim=0.707,
    ),
    tie_word_embeddings=False,
)  # fmt: skip
"""DeepSeek-V2-Lite's published shape (15.7B parameters, 2.4B active) in the DeepSeek-V3 architecture (sigmoid,
bias-corrected routing; V2-Lite itself routes by softmax): the issue's GPU row."""


def architecture(row: Row, smoke: bool):
    """The row's architecture; raises ``UnsupportedArchitectureError`` while its family does not build."""
    import transformers

    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.tiny_models import tiny_hf_config
    from megatron_opd.trainer.memory import hf_config

    if row.model == "DeepseekV3Config":
        full = transformers.DeepseekV3Config(**DEEPSEEK_V2_LITE_SIZE)
        config = tiny_hf_config("deepseek_v3", q_lora_rank=None) if smoke else full  # V2-Lite has no query latent
        return architecture_from_hf_config(config.to_dict(), row.model)
    if row.model in HYBRID_SIZES:
        config = tiny_hf_config(HYBRID_FAMILIES[row.model]) if smoke else None
        config = config or getattr(transformers, row.model)(**HYBRID_SIZES[row.model])
        return architecture_from_hf_config(config.to_dict(), row.model)
    if row.model.endswith("Config"):  # a family to come: transformers' defaults are the model's published shape
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000)
        if "Moe" in row.model:
            small.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        layers = {}
        if "Qwen3Moe" in row.model:  # Qwen3-30B-A3B's config.json (transformers' defaults are a 24-layer model)
            layers = dict(num_hidden_layers=48, head_dim=128, intermediate_size=6144, max_position_embeddings=40960)
            layers.update(norm_topk_prob=True)
        config = getattr(transformers, row.model)(**(small if smoke else layers))
        return architecture_from_hf_config(config.to_dict(), row.model)
    full = hf_config(row.model)  # a KNOWN_CONFIGS name: the published config.json's sizes
    if smoke:  # that family's tiny model (gpt-oss: sinks, windows, biased clamped-SwiGLU experts)
        return architecture_from_hf_config(tiny_hf_config(full.model_type).to_dict(), f"tiny {full.model_type}")
    return architecture_from_hf_config(full.to_dict(), row.model)


def active_parameters(model, arch) -> int:
    """Parameters a token runs through: a Mixture-of-Experts layer's routed experts count top-k / experts each
    (shared experts, router and the rest in full); every parameter of a dense model."""
    total = 0
    for name, param in model.named_parameters():
        routed = arch.moe is not None and ".experts." in name
        total += param.numel() * arch.moe.top_k / arch.moe.num_experts if routed else param.numel()
    return int(total)


def measure(row: Row, smoke: bool, reps: int) -> dict:
    """One update or scoring row in this process: seconds per repetition after a warm-up, MFU (against active
    parameters), peak memory."""
    import torch
    from bench_phases_gpu import _score_step, _update_step

    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig, build_model

    device = "cpu" if smoke else "cuda"
    arch = architecture(row, smoke)
    initialize_distributed(ParallelConfig(), device, seed=0)
    build = ModelBuildConfig(
        dtype="fp32" if smoke else "bf16", attention="sdpa", recompute_granularity=row.recompute,
        moe_grouped_gemm=row.grouped_gemm, moe_fused_routing=row.fused_routing,
    )  # fmt: skip
    (model,) = build_model(arch, ParallelConfig(), build, trainable=row.kind == "update")
    n = active_parameters(model, arch)
    s = row.smoke_tokens if smoke else row.tokens
    tokens = torch.randint(0, min(arch.vocab_size, 1000), (1, s), device=device)
    positions = torch.arange(s, device=device).unsqueeze(0)
    make = _update_step if row.kind == "update" else _score_step
    extra = {}
    if row.cuda_graphs:
        once, extra = graphed_score_step(model, tokens, arch.vocab_size)
    else:
        once = make(model, "fused" if row.kind == "update" else "teacher", tokens, positions, arch.vocab_size)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    once()  # warm-up (and the gradient buffers, which a trainer keeps too)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    sync()
    seconds = (time.perf_counter() - start) / reps
    flops = (6 if row.kind == "update" else 2) * n * s / seconds
    kernel = {}
    if row.op_counts:
        try:
            counts = layer_counts(model, arch, backward=row.kind == "update")
        except Exception as err:  # the row's time stands without them
            counts = f"operator counts failed: {type(err).__name__}: {str(err)[:120]}"
        kernel["note"] = "; ".join(filter(None, [extra.get("note"), counts]))
    if arch.linear_attention is not None:
        from megatron_opd.models.gated_delta_kernels import uses_fla

        kernel["note"] = "DeltaNet: " + ("fla kernels" if uses_fla("auto", tokens.device) else "PyTorch forms")
    return {
        **kernel,
        "tokens": s,
        "ms": seconds * 1e3,
        "tokens_per_s": s / seconds,
        "mfu": None if smoke else flops / PEAK_FLOPS,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "active_params": n,
    }


def graphed_score_step(model, tokens, vocab_size: int):
    """``_score_step`` with ``teacher.cuda_graphs``: one bucket of the row's shape, captured on the first call (on CPU
    the same bucketed path with the eager runner); and the largest gap of its top-k log-probabilities to the eager
    teacher's on the row's tokens (the same weights), for the note."""
    import torch
    from bench_phases_gpu import TOPK

    from megatron_opd.teacher.graphs import BucketedForward, cuda_graph_runner, eager_runner
    from megatron_opd.teacher.inprocess import InProcessTeacher

    cuda = tokens.device.type == "cuda"
    graphs = BucketedForward((tokens.shape[1],), tokens.shape[0], cuda_graph_runner() if cuda else eager_runner)
    kwargs = dict(vocab_size=vocab_size, mode="topk", topk=TOPK, device=tokens.device)
    graphed = InProcessTeacher([model], graphs=graphs, **kwargs)
    eager = InProcessTeacher([model], **kwargs).score(tokens).result()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    graphed.score(tokens).result()  # two warm-up forwards and the capture
    sync()
    captured = time.perf_counter() - start
    replayed = graphed.score(tokens).result()
    gap = float((replayed.topk_logprobs - eager.topk_logprobs).abs().max())
    same = float((replayed.topk_ids == eager.topk_ids).float().mean())
    how = f"captured in {captured:.1f} s; replay" if cuda else "CPU: no capture, the bucketed path's eager runner"
    note = f"{how} vs eager: top-k log-prob gap {gap:.1e}, ids equal {same:.1%}"
    return (lambda: graphed.score(tokens).result()), {"note": note}


def layer_counts(model, arch, backward: bool) -> str:
    """aten operators one MoE layer and its attention launch on this row's device and dtype (forward, and backward
    for an update), and the MoE layer's host syncs, at ``moe_profile.TOKENS`` tokens (Triton kernels, e.g. the
    fused router, are launched outside aten and not counted)."""
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_opd.testing.moe_profile import TOKENS, profile

    while hasattr(model, "module"):  # Float16Module
        model = model.module
    layer = next(lyr for lyr in model.decoder.layers if isinstance(lyr.mlp, MoELayer))
    weight = next(layer.parameters())
    gen = torch.Generator(device=weight.device).manual_seed(0)
    hidden = torch.randn(TOKENS // 2, 2, arch.hidden_size, generator=gen, device=weight.device, dtype=weight.dtype)
    rotary = model.rotary_pos_emb(TOKENS // 2) if getattr(model, "rotary_pos_emb", None) is not None else None
    moe = profile(layer.mlp, hidden.clone().requires_grad_())
    attention = profile(
        layer.self_attention, hidden.clone().requires_grad_(), attention_mask=None, rotary_pos_emb=rotary
    )

    def ops(p) -> str:
        return f"{sum(p.forward.values())}/{sum(p.backward.values())}" if backward else f"{sum(p.forward.values())}"

    per = "fwd/bwd" if backward else "fwd"
    return f"ops per layer ({per}, {TOKENS} tokens): MoE {ops(moe)}, attention {ops(attention)}; MoE host syncs {len(moe.syncs)}"


def train(row: Row, smoke: bool, limit_s: float) -> dict:
    """Three steps of ``megatron_opd.train`` on the tiny fixture (device=auto: on a GPU bf16 and the distributed
    optimizer), through torchrun as a user runs it; the last step's time and loss from ``metrics.jsonl``."""
    from megatron_opd.testing.distill_fixture import make_distill_fixture

    work = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    fixture = make_distill_fixture(work / "fixture")
    overrides = fixture.overrides(
        work / "run",
        **{"train.steps": 3, "data.eval_files": "[]", "export_hf": False, "logging.tensorboard": False},
        **({"device": "cpu"} if smoke else {}),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "megatron_opd.train", *overrides]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: {(out.stdout + out.stderr)[-1500:]}")
    steps = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "tokens_per_s" in s]
    last = steps[-1]
    precision = "fp32, plain optimizer" if smoke else "bf16, distributed optimizer (defaults)"
    return {
        "steps": len(steps),
        "ms": last["response_length"] * 4 / last["tokens_per_s"] * 1e3,  # the fixture's 4 prompts per step
        "loss": last["loss"],
        "precision": precision,
    }


def run_row(index: int, smoke: bool, reps: int, limit_s: float) -> dict:
    """The row's result (in this process); ``skipped`` where its model family does not build yet."""
    from megatron_opd.model_files import UnsupportedArchitectureError

    row = ROWS[index]
    if row.kind == "train":
        return train(row, smoke, limit_s)
    try:
        architecture(row, smoke)
    except UnsupportedArchitectureError as err:
        model_type = str(err).split("model_type=")[-1].split()[0] if "model_type=" in str(err) else row.model
        return {"skipped": f"skipped: model_type {model_type} does not build yet (its family is issue {row.issue})"}
    if row.grouped_gemm:
        import torch

        from megatron_opd.distributed.device import has_transformer_engine
        from megatron_opd.models.builder import grouped_gemm_unavailable

        te = has_transformer_engine() and not smoke
        dtype = torch.float32 if smoke else torch.bfloat16
        reason = grouped_gemm_unavailable(te, "cpu" if smoke else "cuda", dtype)
        if reason:
            return {"skipped": f"skipped: grouped GEMM unavailable: {reason}"}
    return measure(row, smoke, reps)


def table(results: list[tuple[Row, dict]], smoke: bool) -> str:
    lines = [
        "| issue | row | tokens | ms | tokens/s | MFU | peak GiB | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row, r in results:
        note = r.get("skipped") or r.get("error") or r.get("note") or ""
        if row.kind == "train" and "ms" in r:
            note = f"{r['precision']}; {r['steps']} steps, last loss {r['loss']:.4f}"
        tokens = r.get("tokens", row.smoke_tokens if smoke else row.tokens) or "-"
        cells = [
            row.issue,
            row.what + (f" ({row.recompute} recompute)" if row.recompute and "recompute" not in row.what else ""),
            f"{tokens:,}" if isinstance(tokens, int) else tokens,
            f"{r['ms']:.1f}" if "ms" in r else "-",
            f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
            f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
            f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-",
            note.replace("|", "/").replace("\n", " "),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the same rows at tiny shapes on CPU (fp32)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all rows (the device call's limit)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per row after one warm-up")
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--issues", help="only these issues' rows, comma-separated (e.g. '#36,#40')")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # internal: run one row, print its result
    args = parser.parse_args()
    if args.row is not None:
        print("RESULT " + json.dumps(run_row(args.row, args.cpu_smoke, args.reps, ROWS[args.row].limit_s)))
        return
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu/check.py needs a CUDA GPU (or --cpu-smoke)")
    deadline = time.monotonic() + args.budget
    results = []
    wanted = {f"#{i.strip().lstrip('#')}" for i in args.issues.split(",")} if args.issues else None
    for i, row in enumerate(ROWS):
        if wanted is not None and row.issue not in wanted:
            continue
        left = deadline - time.monotonic()
        cmd = [sys.executable, __file__, "--row", str(i), "--reps", str(args.reps)] + ["--cpu-smoke"] * args.cpu_smoke
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        if args.cpu_smoke:
            env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        if left < 20:
            results.append((row, {"error": "not run: the budget was spent"}))
            continue
        started = time.monotonic()
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=min(row.limit_s + 60, left))
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
                oom = "out of memory" if "OutOfMemoryError" in out.stderr else ""
                result = {"error": oom or f"exit {out.returncode}: {' / '.join(tail)[-300:]}"}
            else:
                result = json.loads(lines[-1].removeprefix("RESULT "))
        except subprocess.TimeoutExpired:
            result = {"error": f"stopped after {time.monotonic() - started:.0f} s"}
        print(f"{row.issue} {row.what}: {result} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
        results.append((row, result))
    device = next((r["device"] for _, r in results if "device" in r), "cpu" if args.cpu_smoke else "GPU")
    text = f"GPU check ({'CPU smoke, tiny shapes' if args.cpu_smoke else device}; torch {torch.__version__})\n\n"
    text += table(results, args.cpu_smoke) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps([(asdict(r), res) for r, res in results], indent=1))


if __name__ == "__main__":
    main()
