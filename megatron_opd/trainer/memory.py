"""Memory per device of the trainer and the models beside it, from the models' parameters counted on the meta device:
the trainer's start-up check here, a recipe's whole table (teacher and vLLM servers) in ``launch/recipe_memory.py``.

Placement: the Hugging Face model is built on the meta device (no memory) and each tensor is placed by the one
name mapping (:mod:`megatron_opd.models.name_mapping`): split over the TP ranks unless its rule is replicated
(norms), an embedding or output layer padded to Megatron's vocabulary; layers evenly over the PP stages, the
embedding on the first stage, the final norm and the output layer on the last (a tied output layer is a second
copy of the embedding there when PP > 1, as in Megatron).

Bytes per parameter on a device:

- teacher server (forward only): 2 (bf16 weights);
- student: 2 (bf16 weights) + 4 (fp32 gradient buffer) + 12 / DP·CP (fp32 master copy and Adam's two moments,
  sharded by the distributed optimizer over Megatron's data-parallel group, which includes the context-parallel
  ranks), an expert's 12 / EDP instead (sharded over the expert data-parallel group, EDP = world / (ETP·EP·PP));
  in fp32 (CPU) 4 + 4 + 8 (no master copy);
- in-process teacher (the trainer's start-up check): 2 or 4 (its weights, at the student's dtype and layout);
- vLLM server: 2 (bf16 weights); what ``gpu_memory_utilization`` leaves is KV cache.

Activations: what each layer of our local spec saves for its backward (torch ``RMSNorm``, Megatron's linears,
``SDPAttention``, SwiGLU), counted per token and layer in elements (x 2 bytes in bf16, 4 in fp32; the few fp32
statistics of a bf16 run, norms' 1/rms and attention's log-sum-exp, are counted at the same width). Attention
assumes a flash-style SDPA kernel (CPU flash, GPU flash / cuDNN / memory-efficient): it keeps its q, k, v, output
and log-sum-exp, nothing ``s x s``; Megatron's unfused ``DotProductAttention`` is not modelled.

- two norms: input, normalised input and output (the next linear's input), and 1/rms: ``2·(3h + 1)/s``;
- attention: the QKV output (one storage, V a view of it: ``(Nq + 2·Nkv)·D``), the RoPE'd q and k copies SDPA
  saves (``Nq·D + Nkv·D``), its output (the projection's input) and log-sum-exp (``Nq·D + Nq``), all ``/t``; RoPE's
  cos and sin, once for q and once for k (``4·D``, per token, not per head); with QK-norm (Qwen3) the q copy it
  normalises, its normalised q and k and their 1/rms (``2·Nq·D + Nq + Nkv·D + Nkv``, ``/t``);
- SwiGLU MLP: the fc1 output (gate and up, ``2F``), silu's output, the product (fc2's input) and one more ``F``:
  ``5F/t``.

``A`` is their sum; s = t under sequence parallelism, else 1. Under context parallelism a rank holds S/CP positions
(tokens below are its own) and attention saves more (``models.context_parallel``): K and V gathered over the
whole sequence (``2·CP·Nkv·D``), its two query chunks zero-padded to square causal calls (q, output and
log-sum-exp at up to ``CP + 1`` times the local rows) and a contiguous copy of the output (``Nq·D``). With full
recomputation (``build.recompute_granularity=full``, blocks of N = ``recompute_num_layers`` layers) a block keeps
only its input (``h/s``) and one block's ``N·A`` is alive while it recomputes, in backward, after the loss's logits
are gone: the larger of the two counts. The last stage adds the final norm (``(3h + 1)/s``). Measured against the
peak of live tensor bytes of one update on CPU: 0.92-0.98x (``tests/test_memory_check.py``), 1.01-1.14x at CP=2.

- student: A x layers of the stage x tokens of a micro-batch x micro-batches in flight (PP − stage under 1F1B),
  plus on the last stage the logits, tokens × Vp/t × 8 bytes (bf16 logits, their bf16 gradient, an fp32 copy; 16
  in fp32), where tokens are one loss chunk's with the fused output layer (``loss.fused_output``), else the
  micro-batch's;
- teacher: one layer's A for one micro-batch (forward only: freed layer by layer) plus on the last stage
  tokens × Vp/t × 6 bytes (bf16 logits and the fp32 log-softmax its top-k is taken from);
- vLLM: KV cache of 2·L·(Nkv/t)·D·2 bytes per token; capacity = utilization × memory − weights − 3 GiB (CUDA
  graphs, sampler and activations; vLLM measures the real figure at start-up).

Legend: h hidden, F ffn hidden, D head dim, Nq / Nkv query / key-value heads, L layers, Vp padded vocabulary,
t / PP / DP / CP tensor / pipeline / data- / context-parallel sizes, ETP / EP / EDP the experts' tensor / expert /
data-parallel sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megatron_opd.model_files import HF_CONFIG_DIR
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families import FAMILIES
from megatron_opd.models.hf_config import architecture_from_hf_config
from megatron_opd.models.name_mapping import ExpertSplit, Split, WeightRule, expand_rules, hf_shapes

GIB = 1 << 30

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    name: dict(fields) for family in FAMILIES.values() for name, fields in family.memory_configs.items()
}
"""``config.json`` sizes of the recipes' models, used when a model folder is not on this machine (keyed by the
folder's name): the estimate then runs anywhere. Each family declares its own (``ModelFamily.memory_configs``)."""


def hf_config(path: str):
    """The ``transformers`` config of the model at ``path`` (a Hugging Face folder or a dist_ckpt's ``hf_config/``),
    else ``KNOWN_CONFIGS`` by the folder's name."""
    from transformers import AutoConfig

    for folder in (Path(path), Path(path) / HF_CONFIG_DIR):
        if (folder / "config.json").is_file():
            return AutoConfig.from_pretrained(folder)
    fields = dict(KNOWN_CONFIGS.get(Path(path).name) or {})
    if not fields:
        raise ValueError(f"{path} has no config.json here and is not one of {sorted(KNOWN_CONFIGS)}")
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def meta_model(config) -> torch.nn.Module:
    """The Hugging Face model skeleton on the meta device (shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@dataclass(frozen=True)
class ParamShard:
    """Where one Hugging Face tensor lives under a TP x PP layout."""

    name: str
    stage: int
    """Pipeline stage holding it."""
    numel: int
    """Elements of the whole tensor."""
    split: bool
    """Split over the TP ranks of its stage (else every rank holds all of it)."""
    per_rank: int
    """Elements on one TP rank of its stage (vocabulary padding included)."""
    shape: tuple[int, ...] = ()
    """The tensor's checkpoint shape (where FP8 block quantisation applies: 2-D weights)."""
    expert: bool = False
    """A routed expert's tensor (split over the EP ranks; its optimizer state over the expert data-parallel group)."""


def _per_rank(rule: WeightRule, name: str, numel: int, arch: ModelArchitecture, tp: int, vocab_multiple) -> int:
    if rule.split is Split.REPLICATED:
        return numel
    if rule.split is Split.VOCAB and vocab_multiple:
        # a row's width from the tensor (Gemma 4's per-layer input table is layers x its width wide, not hidden)
        return arch.padded_vocab_size(tp, vocab_multiple) // tp * (numel // arch.vocab_size)
    if numel % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} does not divide {name} ({numel} elements)")
    return numel // tp


def shard_parameters(
    model: torch.nn.Module,
    tp: int,
    pp: int,
    vocab_multiple: int | None = 128,
    ep: int = 1,
    etp: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> list[ParamShard]:
    """Every parameter of ``model`` placed under TP=``tp``, PP=``pp`` (and for Mixture-of-Experts models EP=``ep``
    ranks each holding experts / EP of the experts, each expert split over ``etp`` ranks, default ``tp``) by the
    name mapping's rules, the vocabulary padded to a multiple of ``vocab_multiple x tp`` rows (None: unpadded, as
    in vLLM), ``stage_layers`` layers on each stage (None: an even split); raises when the rules do not account for
    every parameter (the mapping would not load this model).
    Sizes come from the rules' checkpoint shapes: transformers' modules may fuse tensors the checkpoint keeps
    apart (transformers 5 holds a layer's experts as one tensor)."""
    arch = architecture_from_hf_config(model.config.to_dict())
    arch.validate_tensor_parallel(tp)
    stage_of = layer_stages(arch.num_layers, pp, stage_layers)
    etp = etp or tp
    shards = []
    for rule, layer in expand_rules(arch):
        if rule.buffer:  # DeepSeek-V3's expert bias: a buffer (E floats a layer), not a parameter
            continue
        if layer is not None:
            stage = stage_of[layer]
        else:
            stage = 0 if rule.megatron.startswith("embedding") else pp - 1
        for name, shape in zip(rule.hf_names(layer), hf_shapes(rule, arch)):
            numel = math.prod(shape)
            split = rule.split is not Split.REPLICATED
            if rule.experts is ExpertSplit.PER_EXPERT:  # one expert of E on E/EP ranks' worth: numel / EP a rank
                per_rank = _per_rank(rule, name, numel, arch, etp, vocab_multiple) // ep
            else:
                per_rank = _per_rank(rule, name, numel, arch, tp, vocab_multiple)
            expert = rule.experts is ExpertSplit.PER_EXPERT
            shards.append(ParamShard(name, stage, numel, split, per_rank, tuple(shape), expert))
    total = sum(p.numel() for p in model.parameters())
    placed = sum(s.numel for s in shards)
    if placed != total:
        unplaced = sorted(set(dict(model.named_parameters())) - {s.name for s in shards})
        raise ValueError(
            f"no name-mapping rule places {unplaced[:5]} ({len(unplaced)} tensors): the rules place {placed:,} of "
            f"the model's {total:,} parameters"
        )
    if arch.tie_word_embeddings and pp > 1:
        embedding = shards[0]
        shards.append(replace(embedding, stage=pp - 1))
    return shards


def layer_stages(num_layers: int, pp: int, stage_layers: Sequence[int] | None = None) -> list[int]:
    """The pipeline stage of every layer: ``stage_layers`` layers on each stage, in order (None: an even split)."""
    if stage_layers is None:
        if num_layers % pp:
            raise ValueError(f"pipeline_model_parallel_size={pp} does not divide the {num_layers} layers")
        stage_layers = [num_layers // pp] * pp
    if len(stage_layers) != pp or sum(stage_layers) != num_layers:
        raise ValueError(f"stage layers {list(stage_layers)} do not place {num_layers} layers on {pp} stages")
    return [stage for stage, count in enumerate(stage_layers) for _ in range(count)]


def stage_params(shards: list[ParamShard], pp: int, experts: bool | None = None) -> list[int]:
    """Elements on one device of each pipeline stage: all, or only the routed experts' (``experts=True``) or only the
    rest (``False``), which the distributed optimizer shards over different groups."""
    totals = [0] * pp
    for shard in shards:
        if experts is None or shard.expert == experts:
            totals[shard.stage] += shard.per_rank
    return totals


def _mla_attention_elements(arch: ModelArchitecture, tp: int) -> float:
    """Multi-latent attention's saved tensors per token: the query and key/value latents and their normalised copies
    (replicated over TP), the up-projections' outputs, the RoPE'd q and k (every head's rotary key expanded) and a
    contiguous v, SDPA's output and log-sum-exp, RoPE's cos and sin."""
    mla, n = arch.mla, arch.num_attention_heads / tp
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    latents = 2 * mla.kv_lora_rank + 1 + mla.kv_lora_rank + mla.qk_rope_head_dim
    if mla.q_lora_rank is not None:
        latents += 2 * mla.q_lora_rank + 1
    heads = n * (qk + (mla.qk_nope_head_dim + mla.v_head_dim) + 2 * qk + mla.v_head_dim + mla.v_head_dim + 1)
    return latents + heads + 4 * mla.qk_rope_head_dim


def _mlp_elements(arch: ModelArchitecture, tp: int, s: int, etp: int, layer: int | None) -> float:
    """The layer's MLP: dense SwiGLU ``5F/t``; an MoE layer's router scores (``2E + 2k``, on this rank's tokens),
    each token's k routed copies (the permuted input and the combined output, ``2h``, and an expert's SwiGLU
    ``5·F_e/etp``, as many copies arriving from the other expert-parallel ranks as leave: balanced load) and the
    shared expert's SwiGLU. ``layer=None``: the larger of the two kinds."""
    dense = 5 * arch.ffn_hidden_size / tp
    moe = arch.moe
    if moe is None:
        return dense
    k, e = moe.top_k, moe.num_experts
    routed = (2 * e + 2 * k) / s + k * (2 * arch.hidden_size + 5 * moe.expert_ffn_hidden_size / etp)
    routed += 5 * moe.shared_expert_ffn_hidden_size / tp
    if layer is None:
        return max(routed, dense) if len(moe.layers) < arch.num_layers else routed
    return routed if layer in moe.layers else dense


def layer_activation_elements(
    arch: ModelArchitecture,
    tp: int,
    sequence_parallel: bool,
    cp: int = 1,
    layer: int | None = None,
    etp: int | None = None,
) -> float:
    """``A``: elements one layer keeps per token of this rank for its backward (see the module docstring); ``layer``
    picks a dense or an MoE MLP (None: the larger), ``etp`` the experts' tensor-parallel size (default ``tp``)."""
    h, d, s = arch.hidden_size, arch.head_dim, tp if sequence_parallel else 1
    mlp = _mlp_elements(arch, tp, s, etp or tp, layer)
    if arch.mla is not None:  # context parallelism is not modelled for multi-latent attention
        return 2 * (3 * h + 1) / s + _mla_attention_elements(arch, tp) + mlp
    nq, nkv = arch.num_attention_heads / tp, arch.num_key_value_heads / tp
    attention = (nq + 2 * nkv) * d + 4 * d
    if cp == 1:
        attention += nq * d + nkv * d + nq * d + nq
    else:
        attention += (cp + 1) * (2 * nq * d + nq) + 2 * cp * nkv * d + nq * d
    if arch.qk_norm:
        attention += 2 * nq * d + nq + nkv * d + nkv
    return 2 * (3 * h + 1) / s + attention + mlp


def layer_activation_bytes(
    arch: ModelArchitecture, tp: int, sequence_parallel: bool, width: int = 2, etp: int | None = None
) -> float:
    """The largest layer's ``A`` in bytes at ``width`` bytes an element (2: bf16)."""
    return width * layer_activation_elements(arch, tp, sequence_parallel, etp=etp)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device of a job (one row of the table)."""

    job: str
    layout: str
    params: int
    weights: float
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    """Activations, or the KV cache for a vLLM server."""
    note: str = ""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def model_shards(
    path: str,
    tp: int,
    pp: int,
    vocab_multiple: int | None,
    ep: int = 1,
    etp: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> tuple[ModelArchitecture, list[ParamShard]]:
    model = meta_model(hf_config(path))
    shards = shard_parameters(model, tp, pp, vocab_multiple, ep, etp, stage_layers)
    return architecture_from_hf_config(model.config.to_dict()), shards


def micro_batch_tokens(cfg, seq: int) -> int:
    """Tokens of one micro-batch: ``train.micro_batch_tokens`` when packed to it, else sequences x ``seq``."""
    if cfg.train.packing and cfg.train.micro_batch_tokens:
        return cfg.train.micro_batch_tokens
    return cfg.train.micro_batch_size * seq


def _logit_tokens(cfg, tokens: int, vocab: int, arch: ModelArchitecture) -> int:
    """Tokens whose logits the update holds at once: a loss chunk with the fused output layer, else all (also for
    soft-capped final logits, which the update takes whole: ``HiddenStateOutput.exact``)."""
    from megatron_opd.losses.fused_output import MAX_CHUNK_ELEMENTS
    from megatron_opd.trainer.objective import fused_output_applies

    if not fused_output_applies(cfg.loss) or arch.final_logit_softcapping is not None:
        return tokens
    return min(tokens, cfg.loss.chunk_size or max(MAX_CHUNK_ELEMENTS // vocab, 1))


def student_rows(cfg, dp: int, bf16: bool, distributed: bool) -> list[DeviceMemory]:
    """One row per pipeline stage of the trainer's student under ``cfg`` at ``dp`` data-parallel replicas (world /
    (TP·PP·CP)).

    Bytes per parameter: the weights (2 in bf16, 4 in fp32), the fp32 gradient buffer (4), and Adam's two fp32
    moments plus, in bf16, the fp32 master copy (8 or 12), which the distributed optimizer shards as Megatron does:
    over DP·CP ranks (``get_data_parallel_group(with_context_parallel=True)``), a routed expert's over the expert
    data-parallel group of world / (ETP·EP·PP) ranks. A LoRA student (``student.lora``) has gradients and optimizer
    state for its adapters only (``models.lora.adapter_elements``)."""
    from megatron_opd.models.lora import adapter_elements

    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    ep, etp = cfg.parallel.expert_model_parallel_size, cfg.parallel.etp_size
    multiple = cfg.build.make_vocab_size_divisible_by
    arch = architecture_from_hf_config(hf_config(cfg.student.path).to_dict())
    counts = cfg.parallel.stage_layers(arch.num_layers)
    arch, shards = model_shards(cfg.student.path, tp, pp, multiple, ep, etp, counts)
    seq = cfg.train.max_seq_len or arch.max_position_embeddings
    tokens = micro_batch_tokens(cfg, seq)
    shape = f"{cfg.train.micro_batch_size} x {seq}" if tokens == cfg.train.micro_batch_size * seq else str(tokens)
    micro_batches = cfg.train.prompts_per_step * cfg.rollout.n // (dp * cfg.train.micro_batch_size)
    width = 2 if bf16 else 4
    sp = tp if cfg.parallel.sequence_parallel else 1
    cp = cfg.parallel.context_parallel_size
    local = tokens / cp  # this rank's positions of the micro-batch
    sequence_parallel = cfg.parallel.sequence_parallel
    layer = layer_activation_elements(arch, tp, sequence_parallel, cp, etp=etp)  # the largest layer
    block = cfg.build.recompute_num_layers
    full = cfg.build.recompute == "full"
    vocab = arch.padded_vocab_size(tp, multiple) // tp
    world = dp * tp * pp * cp
    dense_shards, expert_shards = (dp * cp, max(world // (etp * ep * pp), 1)) if distributed else (1, 1)
    state = 12 if bf16 else 8  # bytes of optimizer state per parameter
    rows = []
    dense_params, expert_params = stage_params(shards, pp, experts=False), stage_params(shards, pp, experts=True)
    for stage, params in enumerate(stage_params(shards, pp)):
        last = stage == pp - 1
        in_flight = min(pp - stage, max(micro_batches, 1))
        per_stage = counts[stage]
        layers = range(sum(counts[:stage]), sum(counts[: stage + 1]))
        if full:  # one input per block of layers
            kept = arch.hidden_size / sp / block * per_stage * local * in_flight
        else:
            kept = sum(layer_activation_elements(arch, tp, sequence_parallel, cp, i, etp) for i in layers)
            kept *= local * in_flight
        kept += (3 * arch.hidden_size + 1) / sp * local if last else 0  # the final norm
        logits = _logit_tokens(cfg, int(local), vocab, arch) * vocab * 4 * width if last else 0  # bytes
        recomputing = min(block, per_stage) * layer * local * width if full else 0
        activations = kept * width + max(logits, recomputing)
        trained = params
        optimizer = state * (dense_params[stage] / dense_shards + expert_params[stage] / expert_shards)
        if cfg.student.lora.enabled:  # a LoRA student: gradients and optimizer state of the adapters only
            trained = adapter_elements(arch, cfg.student.lora, tp, layers)
            optimizer = state * trained / dense_shards
        rows.append(
            DeviceMemory(
                "student (trainer)",
                f"TP={tp} PP={pp} DP={dp}{f' CP={cp}' if cp > 1 else ''}{f' EP={ep}' if ep > 1 else ''}, stage {stage}",
                params,
                weights=width * (params + (trained if cfg.student.lora.enabled else 0)),
                grads=4 * trained,
                optimizer=optimizer,
                activations=activations,
                note=f"{in_flight} micro-batch(es) of {shape} tokens in flight",
            )
        )
    return rows


def forward_rows(
    job: str,
    layout: str,
    path: str,
    tp: int,
    pp: int,
    multiple: int,
    tokens: int,
    width: int,
    ep: int = 1,
    etp: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> list[DeviceMemory]:
    """A forward-only model (a teacher): its weights, one layer's activations and the last stage's logits."""
    arch, shards = model_shards(path, tp, pp, multiple, ep, etp, stage_layers)
    vocab = arch.padded_vocab_size(tp, multiple) // tp
    rows = []
    for stage, params in enumerate(stage_params(shards, pp)):
        activations = layer_activation_bytes(arch, tp, arch.moe is not None and tp > 1, width, etp) * tokens
        activations += tokens * vocab * 6 if stage == pp - 1 else 0
        rows.append(
            DeviceMemory(
                job,
                f"{layout}, stage {stage}",
                params,
                weights=width * params,
                activations=activations,
                note=f"micro-batch of {tokens} tokens",
            )
        )
    return rows


def format_table(rows: list[DeviceMemory], gpu_memory_gib: float | None) -> str:
    """A Markdown table in GiB (what ``--memory`` prints), then each row's note; no shares without a device size."""
    head = "| job | layout | params/GPU | weights | grads | optimizer | activations / KV | total | of GPU |"
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gib = [f"{x / GIB:.1f}" if x else "-" for x in (r.weights, r.grads, r.optimizer, r.activations, r.total)]
        share = f"{r.total / (gpu_memory_gib * GIB):.0%}" if gpu_memory_gib else "-"
        lines.append(f"| {r.job} | {r.layout} | {r.params / 1e9:.2f}B | {' | '.join(gib)} | {share} |")
    lines += ["", f"GiB per device of {gpu_memory_gib:g} GiB." if gpu_memory_gib else "GiB per device."]
    lines += [f"- {r.job}, {r.layout}: {r.note}" for r in rows if r.note]
    return "\n".join(lines)


# ---- the trainer's start-up check --------------------------------------------------------------------------------
class MemoryCheckError(ValueError):
    """The run's estimated peak does not fit the device's memory."""


@dataclass(frozen=True)
class GpuPeak:
    """The estimated peak of one device of a training job: the stage with the largest sum of its rows."""

    total: float
    rows: list[DeviceMemory]
    """The rows that add up to it (student stage, in-process teacher stage, colocated vLLM)."""


def trainer_memory(cfg, world_size: int, accel_type: str, device_bytes: float | None) -> list[list[DeviceMemory]]:
    """Per pipeline stage, the rows on one device of the trainer's job: the student, the in-process teacher (built
    at the student's layout and dtype) and a vLLM engine sharing the GPU (``rollout.backend=vllm`` without
    ``rollout.address``), sized by the resolved precision plan."""
    from dataclasses import replace

    from megatron_opd.distributed.device import Accelerator
    from megatron_opd.trainer.objective import objective_for
    from megatron_opd.trainer.student import precision_plan

    optim = cfg.optim
    if cfg.build.dtype not in ("auto", None) and optim.bf16 is None:
        optim = replace(optim, bf16=cfg.build.dtype == "bf16")
    plan = precision_plan(optim, Accelerator(accel_type, ""))  # type: ignore[arg-type]
    dp = max(world_size // cfg.parallel.model_parallel_size, 1)
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    stages = [[row] for row in student_rows(cfg, dp, plan.bf16, plan.use_distributed_optimizer)]
    objective = objective_for(cfg.loss)
    if objective.needs_teacher and cfg.teacher.backend == "inprocess":
        arch = architecture_from_hf_config(hf_config(cfg.student.path).to_dict())
        tokens = micro_batch_tokens(cfg, cfg.train.max_seq_len or arch.max_position_embeddings)
        width = 2 if plan.bf16 else 4
        multiple = cfg.build.make_vocab_size_divisible_by
        ep, etp = cfg.parallel.expert_model_parallel_size, cfg.parallel.etp_size
        teacher = forward_rows("teacher (in-process)", f"TP={tp} PP={pp}", cfg.teacher.path, tp, pp, multiple,
                                tokens, width, ep, etp)  # fmt: skip
        for rows, row in zip(stages, teacher):
            if cfg.teacher.offload:  # its weights leave while the student trains: count the larger phase
                student = rows[0]
                row = replace(row, weights=max(row.total - (student.activations), 0.0), activations=0.0,
                              note="teacher.offload: its weights leave the device while the student trains")  # fmt: skip
            rows.append(row)
    if cfg.rollout.backend == "vllm" and not cfg.rollout.address and accel_type != "cpu" and objective.samples:
        arch, shards = model_shards(cfg.student.path, 1, 1, None)
        (params,) = stage_params(shards, 1)
        budget = cfg.rollout.vllm_gpu_memory_utilization * device_bytes if device_bytes else 2 * params
        if cfg.rollout.vllm_sleep:
            row = DeviceMemory("vllm (colocated)", "asleep", params, weights=0.0,
                               note="rollout.vllm_sleep: weights and KV cache freed while the trainer trains")  # fmt: skip
        else:
            row = DeviceMemory("vllm (colocated)", f"{cfg.rollout.vllm_gpu_memory_utilization:.0%} of the GPU", params,
                               weights=2 * params, activations=max(budget - 2 * params, 0.0),
                               note="rollout.vllm_gpu_memory_utilization reserves this share for the engine")  # fmt: skip
        for rows in stages:
            rows.append(row)
    return stages


def _advice(cfg, peak: GpuPeak) -> list[str]:
    """What to change so the run fits, largest lever first."""
    jobs = {row.job: row for row in peak.rows}
    advice = []
    if "teacher (in-process)" in jobs:
        advice.append(
            f"run the teacher as a server in its own job and layout (teacher.backend=server; "
            f"{jobs['teacher (in-process)'].total / GIB:.1f} GiB here)"
        )
    advice.append(
        "a larger parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size (each device holds "
        "a share of the weights, gradients and optimizer)"
    )
    if cfg.build.recompute != "full":
        advice.append("build.recompute_granularity=full (each layer keeps only its input for the backward)")
    from megatron_opd.trainer.objective import objective_for

    objective = objective_for(cfg.loss)
    if not objective.fuses_output and not objective.keeps_output_layer:
        advice.append("loss.fused_output=auto (logits formed a chunk of tokens at a time, never held whole)")
    advice.append("a smaller train.micro_batch_size or train.max_seq_len")
    if "vllm (colocated)" in jobs and not cfg.rollout.vllm_sleep:
        advice.append("rollout.vllm_sleep=true or a smaller rollout.vllm_gpu_memory_utilization")
    return advice


def check_trainer_memory(cfg, world_size: int, accel_type: str, device_gib: float | None) -> tuple[GpuPeak, str]:
    """The estimated peak of the fullest device and its table; raises :class:`MemoryCheckError` naming what to
    change when it exceeds ``device_gib`` (None: nothing to compare with, only the estimate)."""
    device_bytes = device_gib * GIB if device_gib else None
    stages = trainer_memory(cfg, world_size, accel_type, device_bytes)
    peak = max((GpuPeak(sum(r.total for r in rows), rows) for rows in stages), key=lambda p: p.total)
    table = format_table([row for rows in stages for row in rows], device_gib)
    if device_bytes is not None and peak.total > device_bytes:
        parts = ", ".join(f"{r.job} {r.total / GIB:.1f}" for r in peak.rows)
        raise MemoryCheckError(
            f"the run needs an estimated {peak.total / GIB:.1f} GiB on one device ({parts} GiB) but it has "
            f"{device_gib:g} GiB (train.device_memory_gib, else the device's own figure). To fit: "
            + "; or ".join(_advice(cfg, peak))
            + ". Or set train.skip_memory_check=true to start anyway (activations are estimated, not measured).\n"
            + table
        )
    return peak, table
