"""A recipe's memory per device: its teacher servers (or vLLM teacher), the trainer's stages and one vLLM rollout
server, on the model of memory of :mod:`megatron_opd.trainer.memory` (what ``python -m megatron_opd.launch
--memory`` prints)."""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_opd.distributed.parallel import ParallelConfig
from megatron_opd.launch.layout import Recipe
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.builder import ModelBuildConfig
from megatron_opd.models.fp8 import QUANTIZATION_CONFIG, quantization_of
from megatron_opd.models.hf_config import architecture_from_hf_config
from megatron_opd.trainer.memory import (
    GIB,
    DeviceMemory,
    ParamShard,
    forward_rows,
    hf_config,
    model_shards,
    stage_params,
    student_rows,
)

VLLM_OVERHEAD_BYTES = 3 * GIB
"""vLLM's non-KV working memory assumed by the estimate (CUDA graphs, sampler, activations)."""


def student_memory(recipe: Recipe) -> list[DeviceMemory]:
    """One row per pipeline stage of the trainer (bf16; the distributed optimizer unless switched off)."""
    cfg, launch = recipe.train, recipe.launch
    dp = len(launch.trainer.nodes) * launch.gpus_per_node // cfg.parallel.model_parallel_size
    return student_rows(cfg, dp, bf16=True, distributed=cfg.optim.use_distributed_optimizer is not False)


def teacher_memory(recipe: Recipe) -> list[DeviceMemory]:
    """One row per pipeline stage of a teacher-server replica (TP x PP, and EP data-parallel copies of the dense part
    sharing the experts)."""
    cfg, layout = recipe.train, recipe.launch.teacher
    multiple = ModelBuildConfig().make_vocab_size_divisible_by  # the server builds with the default
    seq = (
        cfg.train.max_seq_len
        or architecture_from_hf_config(hf_config(cfg.teacher.path).to_dict()).max_position_embeddings
    )
    tokens = min(layout.micro_batch_size * seq, layout.max_batch_tokens)
    replicas = len(layout.nodes) * recipe.launch.gpus_per_node // (layout.tp * layout.pp * layout.ep)
    ep = f" EP={layout.ep}" if layout.ep > 1 else ""
    layout_name = f"TP={layout.tp} PP={layout.pp}{ep} x{replicas}"
    stages = ParallelConfig(
        pipeline_model_parallel_size=layout.pp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
    ).stage_layers(architecture_from_hf_config(hf_config(cfg.teacher.path).to_dict()).num_layers)
    return forward_rows("teacher server", layout_name, cfg.teacher.path, layout.tp, layout.pp, multiple, tokens, 2,
                         layout.ep, stage_layers=stages)  # fmt: skip


def _quantization(config) -> dict:
    """A transformers config's ``quantization_config`` as a dict (empty when none)."""
    quant = getattr(config, QUANTIZATION_CONFIG, None) or {}
    return quant if isinstance(quant, dict) else quant.to_dict()


def fp8_block(config) -> tuple[int, int] | None:
    """The FP8 block size a model's config declares (``models/fp8.py`` reads and checks it); None when it is not
    FP8 block-quantised."""
    quant = _quantization(config)
    if quant.get("quant_method") != "fp8":
        return None
    return quantization_of({QUANTIZATION_CONFIG: quant}, "the teacher's config.json").block_size


def fp8_quantised(config, shard: ParamShard) -> bool:
    """Whether vLLM holds ``shard`` in FP8: the config declares FP8 and the tensor is a layer's linear weight (2-D)
    other than the router's, as DeepSeek-V3's checkpoint stores them (embedding, output layer, norms and routers stay
    bf16)."""
    if fp8_block(config) is None:
        return False
    skipped = _quantization(config).get("modules_to_not_convert") or []
    name = shard.name.removesuffix(".weight")
    return (
        len(shard.shape) == 2
        and shard.name.startswith("model.layers.")
        and not shard.name.endswith("mlp.gate.weight")
        and not any(name == m or name.startswith(f"{m}.") for m in skipped)
    )


def _vllm_weight_bytes(config, shards: list[ParamShard]) -> float:
    """Bytes of one GPU's weights in vLLM: 1 per FP8 element plus its blocks' fp32 scales, else 2 (bf16)."""
    total = 0.0
    for shard in shards:
        if fp8_quantised(config, shard):
            rows, cols = fp8_block(config)
            blocks = math.ceil(shard.shape[0] / rows) * math.ceil(shard.shape[1] / cols)
            total += shard.per_rank * (1 + 4 * blocks / shard.numel)
        else:
            total += 2 * shard.per_rank
    return total


def kv_bytes_per_token(arch: ModelArchitecture, tp: int, layers: int) -> int:
    """vLLM's bf16 KV cache per token on one GPU for ``layers`` layers: keys and values of the GPU's KV heads, or
    for multi-latent attention the compressed latent and the rotary key (``kv_lora_rank + qk_rope_head_dim``), which
    every TP rank holds whole."""
    if arch.mla is not None:
        return layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * 2
    return 2 * layers * max(arch.num_key_value_heads // tp, 1) * arch.head_dim * 2


VLLM_REPLICATED = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")
"""Multi-latent attention's down-projections, which vLLM holds whole on every TP rank (``ReplicatedLinear``; Megatron
splits them)."""


def vllm_teacher_memory(recipe: Recipe) -> list[DeviceMemory]:
    """One row per pipeline stage of a vLLM teacher server (``teacher.backend=vllm``): its weights as the checkpoint
    stores them (FP8 where the config says so) and the KV cache the rest of its budget holds."""
    cfg, launch, layout = recipe.train, recipe.launch, recipe.launch.teacher
    config = hf_config(cfg.teacher.path)
    arch, shards = model_shards(cfg.teacher.path, layout.tp, layout.pp, vocab_multiple=None)
    shards = [replace(s, per_rank=s.numel) if s.name.endswith(VLLM_REPLICATED) else s for s in shards]
    budget = layout.gpu_memory_utilization * launch.gpu_memory_gib * GIB
    replicas = len(layout.nodes) * launch.gpus_per_node // (layout.tp * layout.pp)
    fp8 = any(fp8_quantised(config, shard) for shard in shards)
    rows = []
    for stage in range(layout.pp):
        mine = [shard for shard in shards if shard.stage == stage]
        weights = _vllm_weight_bytes(config, mine)
        kv_cache = max(budget - weights - VLLM_OVERHEAD_BYTES, 0.0)
        per_token = kv_bytes_per_token(arch, layout.tp, arch.num_layers // layout.pp)
        rows.append(
            DeviceMemory(
                "vllm teacher",
                f"TP={layout.tp} PP={layout.pp} x{replicas}, stage {stage}",
                sum(shard.per_rank for shard in mine),
                weights=weights,
                activations=kv_cache,
                note=f"{'FP8 block-quantised' if fp8 else 'bf16'} weights; KV cache holds "
                f"{kv_cache / per_token / 1e3:.0f}k tokens",
            )
        )
    return rows


def vllm_memory(recipe: Recipe) -> DeviceMemory:
    """One GPU of a vLLM server: weights, and the KV cache the rest of its budget holds."""
    cfg, launch = recipe.train, recipe.launch
    tp = launch.rollout.tensor_parallel_size
    arch, shards = model_shards(cfg.student.path, tp, 1, vocab_multiple=None)
    (params,) = stage_params(shards, 1)
    budget = launch.rollout.gpu_memory_utilization * launch.gpu_memory_gib * GIB
    kv_cache = max(budget - 2 * params - VLLM_OVERHEAD_BYTES, 0.0)
    kv_per_token = kv_bytes_per_token(arch, tp, arch.num_layers)
    servers = len(launch.rollout.nodes) * launch.gpus_per_node // tp
    sequences = -(-cfg.train.prompts_per_step * cfg.rollout.n // servers)
    seq = cfg.train.max_seq_len or arch.max_position_embeddings
    note = (
        f"KV cache holds {kv_cache / kv_per_token / 1e3:.0f}k tokens; {sequences} sequences per server x {seq} "
        f"= {sequences * seq / 1e3:.0f}k at most"
    )
    return DeviceMemory(
        "vllm server", f"TP={tp}, x{servers} servers", params, weights=2 * params, activations=kv_cache, note=note
    )


def recipe_memory(recipe: Recipe) -> list[DeviceMemory]:
    """Every job's per-device rows: teacher stages (a teacher server's or a vLLM teacher's), student stages, one vLLM
    GPU."""
    teacher = vllm_teacher_memory(recipe) if recipe.train.teacher.backend == "vllm" else teacher_memory(recipe)
    return [*teacher, *student_memory(recipe), vllm_memory(recipe)]
