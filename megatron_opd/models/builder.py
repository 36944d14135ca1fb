"""Build Megatron-Core ``GPTModel`` chunks for any registered model family (``models/families/``).

The same builder makes the student (trainable) and the teacher (frozen, forward-only). Logits stay
vocab-sharded (``parallel_output=True``): the losses work on each rank's ``[tokens, V/TP]`` slice.
With virtual pipeline parallelism a rank holds several chunks, so every builder returns a list. What differs
per family (config fields, layer specs, the chunk itself) comes from the family's declarations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_opd.distributed.device import has_transformer_engine
from megatron_opd.distributed.parallel import ParallelConfig
from megatron_opd.dtypes import parse_dtype
from megatron_opd.models import rope
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.families import family_named
from megatron_opd.models.families.base import SpecOptions, llama3_inv_freq

__all__ = [
    "ModelBuildConfig",
    "build_chunks",
    "build_model",
    "build_model_chunk",
    "check_shared_expert_overlap",
    "grouped_gemm_unavailable",
    "layer_spec",
    "llama3_inv_freq",
    "transformer_config",
    "use_te_spec",
    "validate_layout",
]

logger = logging.getLogger(__name__)


@dataclass
class ModelBuildConfig:
    """Knobs of the model builder that are not part of the checkpoint's architecture."""

    dtype: str = "fp32"
    """Parameter dtype: fp32, bf16 or fp16. The trainer builds the student and the in-process teacher at it; there
    it defaults to ``auto``, the precision plan's (bf16 where ``optim.bf16`` resolves true: on a GPU/NPU by default;
    fp32 on CPU), and a set value decides ``optim.bf16``'s default (bf16 trains in bf16, fp32 in fp32)."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding multiple per tensor-parallel rank (Megatron's ``make_vocab_size_divisible_by``)."""
    use_transformer_engine: bool | None = None
    """TransformerEngine layer spec: None picks it when TE is importable on a CUDA machine."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention when TransformerEngine does not run: ``sdpa`` (torch's flash / memory-efficient kernels,
    memory linear in the sequence length, packed sequences) or ``local`` (Megatron's ``DotProductAttention``, which
    keeps every ``s x s`` score matrix; for comparison)."""
    norm: Literal["torch", "triton"] = "torch"
    """RMSNorm of the local spec: ``torch`` (``torch.nn.RMSNorm``) or ``triton`` (``kernels.rmsnorm_triton`` on CUDA:
    5.3x faster forward+backward for Qwen3's QK-norm rows, but no gain measured in a whole H100 update, which
    is bound by kernel launches; ``benchmarks/RESULTS.md``). CPU runs always use torch."""
    gated_delta_net_kernel: Literal["auto", "torch", "fla"] = "auto"
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): ``auto`` runs fla's (flash-linear-attention, optional) fused
    Triton kernels on CUDA where fla is installed, else megatron-opd's PyTorch chunked and recurrent forms; ``torch``
    always those; ``fla`` always fla's (refused where fla is not installed). ``models.gated_delta_kernels``."""
    recompute_granularity: Literal["selective", "full"] | None = None
    """Activation recomputation in the backward: ``selective`` (core attention only: cheap, needs little with
    ``attention=sdpa``), ``full`` (whole layers: the least memory, about a third more compute); None: off."""
    recompute_num_layers: int = 1
    """With ``full``: layers recomputed as one block (Megatron's ``uniform`` method); more saves more memory."""
    recompute_activations: bool = False
    """Alias of ``recompute_granularity=full`` (older configs)."""
    moe_token_dispatcher: Literal["auto", "allgather", "alltoall"] = "auto"
    """Mixture-of-Experts models: how tokens reach the experts of other expert-parallel ranks. ``allgather``
    gathers every token on every rank (simple; best at small EP); ``alltoall`` sends each token only where its
    experts are (less traffic at larger EP). Results are identical. ``allgather`` needs the same token count on
    every EP rank at every forward, so the trainer at EP > 1 (ranks with prompts of their own) needs ``alltoall``.
    ``auto``: ``alltoall`` at expert parallelism > 1, ``allgather`` at EP = 1 (:meth:`token_dispatcher`)."""
    moe_grouped_gemm: bool = True
    """Mixture-of-Experts models: run a layer's experts as grouped GEMMs (TransformerEngine's ``TEGroupedMLP``, else
    megatron-opd's ``GroupedExperts`` on ``torch._grouped_mm``: 6.6x the sequential experts' scoring rate for a
    Qwen3-30B-A3B on an H100) instead of one GEMM per expert (``false``). The same parameters and results; where no
    grouped kernel runs (an old torch), the experts run one by one and the start-up log says why."""
    moe_fused_routing: bool = False
    """Mixture-of-Experts models: route on each token's top-k expert indices and permute tokens by one sort
    (``megatron_opd.moe``) instead of Megatron-Core's dense routing maps and ``masked_select``: the same results, no
    host sync and fewer operators per layer (``benchmarks/RESULTS.md``). Applies where Megatron's all-gather
    or all-to-all dispatcher would run (the all-to-all at TP=1: one host read, its split sizes) with grouped experts
    and a plain top-k router; other layers (router losses in training, routing replay, overlapped shared experts)
    run Megatron's forward. Off until GPU rows show the gain."""
    moe_shared_expert_overlap: bool = False
    """Mixture-of-Experts models with shared experts (Qwen2-MoE, DeepSeek-V3, GLM-4.5, ...) under the ``alltoall``
    dispatcher (``auto`` at expert parallelism > 1): compute the shared experts on a side CUDA stream while the
    routed tokens travel to and from the other expert-parallel ranks (Megatron-Core's ``moe_shared_expert_overlap``)
    instead of before the router. The same parameters and results (the input gradient sums its two parts in another
    order); worth it where the all-to-all is slow against the shared expert's GEMMs. Refused with the ``allgather``
    dispatcher and for a student without shared experts; a model without them (a teacher) ignores it. Megatron's
    other overlaps (``overlap_moe_expert_parallel_comm``, ``delay_wgrad_compute``) are not offered: ``docs/models.md``."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-Experts students: weight of the Switch load-balancing loss per MoE layer (Megatron's ``aux_loss``;
    e.g. 1e-3 as in Qwen3-MoE's pre-training, 0: none). Megatron adds its gradient in the router's backward, not
    to the distillation loss; its value is logged per step (``moe/load_balancing_loss``)."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-Experts students: weight of the router z-loss (mean squared log-sum-exp of the router logits, which
    keeps them small; e.g. 1e-3; 0: none), applied and logged (``moe/z_loss``) as the auxiliary loss is."""
    moe_router_bias_update_rate: float = 0.0
    """Students whose router has an expert bias (DeepSeek-V3 architecture): auxiliary-loss-free balancing, Megatron's
    option. After each step every expert's bias moves by this much towards a balanced load (up when the expert got
    fewer tokens than the mean, down when more; DeepSeek-V3's pre-training used 1e-3); it is checkpointed, synced to
    vLLM and exported with the weights. 0: the bias stays as loaded (a frozen teacher's always does)."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP (0 for distillation: it would perturb student log-probs)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""

    def __post_init__(self) -> None:
        if self.norm not in ("torch", "triton"):
            raise ValueError(f"build.norm must be 'torch' or 'triton', got {self.norm!r}")
        if self.attention not in ("sdpa", "local"):
            raise ValueError(f"build.attention must be 'sdpa' or 'local', got {self.attention!r}")
        from megatron_opd.models.gated_delta_kernels import check_kernel

        check_kernel(self.gated_delta_net_kernel)
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(
                f"build.recompute_granularity must be 'selective', 'full' or null (off), got {self.recompute_granularity!r}"
            )
        if self.recompute_activations and self.recompute_granularity == "selective":
            raise ValueError(
                "build.recompute_activations=true means recompute_granularity=full, but build.recompute_granularity="
                "selective was also set; keep one of them"
            )
        if self.moe_token_dispatcher not in ("auto", "allgather", "alltoall"):
            raise ValueError(
                f"build.moe_token_dispatcher must be 'auto', 'allgather' or 'alltoall', got {self.moe_token_dispatcher!r}"
            )
        if self.moe_shared_expert_overlap and self.moe_token_dispatcher == "allgather":
            raise ValueError(
                "build.moe_shared_expert_overlap=true with build.moe_token_dispatcher=allgather: Megatron-Core overlaps "
                "the shared experts with the alltoall dispatcher's communication only; set "
                "build.moe_token_dispatcher=alltoall (or auto at expert parallelism > 1)"
            )
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"build.{name} must be a number >= 0 (0: off), got {value!r}")
        if self.recompute_num_layers < 1:
            raise ValueError(f"build.recompute_num_layers must be >= 1, got {self.recompute_num_layers}")

    def token_dispatcher(self, expert_model_parallel_size: int) -> str:
        """The MoE token dispatcher in effect at this EP size: the one place ``auto`` is resolved (a set value is
        kept; ``TrainConfig.validate`` refuses ``allgather`` at EP > 1)."""
        if self.moe_token_dispatcher != "auto":
            return self.moe_token_dispatcher
        return "alltoall" if expert_model_parallel_size > 1 else "allgather"

    @property
    def recompute(self) -> str | None:
        """The recompute granularity in effect (``recompute_activations`` is ``full``)."""
        return "full" if self.recompute_activations else self.recompute_granularity


def validate_layout(arch: ModelArchitecture, parallel: ParallelConfig) -> None:
    """Raise a ValueError naming the field when ``parallel`` cannot split ``arch``."""
    arch.validate_tensor_parallel(parallel.tensor_model_parallel_size)
    if arch.moe is not None:
        validate_expert_layout(arch, parallel)
    if arch.mla is not None and parallel.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={parallel.context_parallel_size}: context parallelism is not wired for "
            f"multi-latent attention ({arch.family} models; its rotary key and latent are not split over "
            "context-parallel ranks); set parallel.context_parallel_size=1"
        )
    if arch.linear_attention is not None and parallel.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={parallel.context_parallel_size}: context parallelism is not built for Gated "
            f"DeltaNet layers ({arch.family} models; the recurrent state would have to pass between context-parallel "
            "ranks); set parallel.context_parallel_size=1"
        )
    family_named(arch.family).check_layout(arch, parallel)  # before the stage split: its reason is the model's
    parallel.stage_layers(arch.num_layers)  # raises when the layers do not split over the stages


def check_shared_expert_overlap(
    build: ModelBuildConfig, parallel: ParallelConfig, arch: ModelArchitecture | None = None, where: str = "the model"
) -> None:
    """Raise a ValueError naming the field when ``build.moe_shared_expert_overlap`` cannot apply: at this layout's
    token dispatcher, or (given ``arch``, the student's) to a model without shared experts. ``transformer_config``
    leaves it off for a model without them (a teacher)."""
    if not build.moe_shared_expert_overlap:
        return
    dispatcher = build.token_dispatcher(parallel.expert_model_parallel_size)
    if dispatcher != "alltoall":
        raise ValueError(
            f"build.moe_shared_expert_overlap=true with the {dispatcher} token dispatcher (build.moe_token_dispatcher="
            f"{build.moe_token_dispatcher} at parallel.expert_model_parallel_size="
            f"{parallel.expert_model_parallel_size}): Megatron-Core overlaps the shared experts with the alltoall "
            "dispatcher's communication only; set build.moe_token_dispatcher=alltoall"
        )
    if arch is not None and (arch.moe is None or not arch.moe.shared_expert_ffn_hidden_size):
        raise ValueError(
            f"build.moe_shared_expert_overlap=true, but {where} ({arch.family}) has no shared expert to overlap with "
            "the token dispatch; set build.moe_shared_expert_overlap=false"
        )


def validate_expert_layout(arch: ModelArchitecture, parallel: ParallelConfig) -> None:
    """Raise a ValueError naming the field when ``parallel`` cannot split ``arch``'s experts (MoE models)."""
    moe, ep, etp = arch.moe, parallel.expert_model_parallel_size, parallel.etp_size
    experts_key, ffn_key, shared_key = moe.config_keys  # the checkpoint's own config.json keys
    if moe.num_experts % ep:
        raise ValueError(
            f"parallel.expert_model_parallel_size={ep} does not divide the {moe.num_experts} experts "
            f"({experts_key}={moe.num_experts}) of this {arch.family} model; choose an expert-parallel size that "
            f"divides {moe.num_experts}"
        )
    for name, width in ((ffn_key, moe.expert_ffn_hidden_size),):
        if width % etp:
            raise ValueError(
                f"expert tensor-parallel size {etp} (parallel.expert_tensor_parallel_size, else the TP size) does not "
                f"divide {name}={width} of this {arch.family} model; set parallel.expert_tensor_parallel_size to a "
                f"divisor of {width}"
            )
    if moe.linear_biases and etp != 1:  # Megatron adds a row-parallel expert's bias on every expert-TP rank
        raise ValueError(
            f"expert tensor-parallel size {etp} (parallel.expert_tensor_parallel_size, else the TP size): the experts "
            f"of this {arch.family} model have biases, which Megatron-Core supports at expert TP 1 only; set "
            "parallel.expert_tensor_parallel_size=1 (opd-convert --etp 1)"
        )
    shared = moe.shared_expert_ffn_hidden_size
    if shared and shared % parallel.tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size={parallel.tensor_model_parallel_size} does not divide "
            f"the shared expert's width {shared} (config.json {shared_key}) of this {arch.family} model; choose a TP "
            "size that divides it"
        )
    if parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"this {arch.family} model has Mixture-of-Experts layers, which Megatron-Core runs with tensor "
            f"parallelism (tensor_model_parallel_size={parallel.tensor_model_parallel_size}) only under sequence "
            "parallelism: set parallel.sequence_parallel=true"
        )


def transformer_config(arch: ModelArchitecture, parallel: ParallelConfig, build: ModelBuildConfig):
    """The Megatron-Core ``TransformerConfig`` equivalent to ``arch`` under ``parallel``."""
    validate_layout(arch, parallel)
    family = family_named(arch.family)
    family.check_build(arch, build)
    dtype = parse_dtype(build.dtype)
    vp = parallel.virtual_pipeline_model_parallel_size
    kwargs = dict(
        **family.transformer_config_fields(arch),
        hidden_dropout=build.hidden_dropout,
        attention_dropout=build.attention_dropout,
        attention_softmax_in_fp32=True,
        # Fusions need TransformerEngine/apex or compile for seconds per process; results are identical.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if arch.moe is not None:  # a dense model (an MoE student's teacher) ignores the expert sizes; Megatron refuses them
        kwargs.update(
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            moe_token_dispatcher_type=build.token_dispatcher(parallel.expert_model_parallel_size),
            # Megatron's flag picks TEGroupedMLP; without TE the local spec carries GroupedExperts (families/base.py).
            moe_grouped_gemm=build.moe_grouped_gemm and use_te_spec(build, parallel),
        )
        if build.moe_shared_expert_overlap and arch.moe.shared_expert_ffn_hidden_size:
            check_shared_expert_overlap(build, parallel)
            kwargs["moe_shared_expert_overlap"] = True
        if build.moe_aux_loss_coeff > 0:  # Megatron's own path: the router attaches it to its output's backward
            kwargs.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(build.moe_aux_loss_coeff))
        if build.moe_z_loss_coeff > 0:
            kwargs["moe_z_loss_coeff"] = float(build.moe_z_loss_coeff)
        if kwargs.get("moe_router_enable_expert_bias"):  # routers without the bias (another family's teacher) ignore it
            kwargs["moe_router_bias_update_rate"] = float(build.moe_router_bias_update_rate)
    if parallel.pipeline_model_parallel_size == 2 and vp and vp > 1:
        # Upstream bug: with two pipeline ranks the previous and next stage are the same peer and the
        # batched p2p exchange silently mixes up tensors in the interleaved schedule (Megatron-LM #1450).
        kwargs["batch_p2p_comm"] = False
    if build.recompute == "full":
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=build.recompute_num_layers
        )
    elif build.recompute == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    config = family.transformer_config_class()(**kwargs)
    rope.set_attention_factor(config, rope.attention_factor(arch.rope))
    return config


def use_te_spec(build: ModelBuildConfig, parallel: ParallelConfig | None = None) -> bool:
    """Whether to use TransformerEngine layers (fused norms, TE linear layers). With context parallelism, never:
    TE's context-parallel attention is not verified here; megatron-opd's (``models.context_parallel``) runs in the
    local spec."""
    cp = 1 if parallel is None else parallel.context_parallel_size
    check_context_parallel(build, cp)
    if build.use_transformer_engine is None:
        return has_transformer_engine() and cp == 1
    if build.use_transformer_engine and not has_transformer_engine():
        raise RuntimeError("use_transformer_engine=True but TransformerEngine is not usable here (needs CUDA + TE)")
    return build.use_transformer_engine


def check_context_parallel(build: ModelBuildConfig, context_parallel_size: int) -> None:
    """Refuse context parallelism with a core attention that cannot split the sequence."""
    if context_parallel_size == 1:
        return
    if build.use_transformer_engine:
        raise ValueError(
            "parallel.context_parallel_size > 1 with build.use_transformer_engine=true: TransformerEngine's "
            "context-parallel attention is not verified with megatron-opd's batch split; unset "
            "build.use_transformer_engine (context parallelism then runs on build.attention=sdpa)"
        )
    if build.attention != "sdpa":
        raise ValueError(
            f"parallel.context_parallel_size > 1 needs build.attention=sdpa (got {build.attention!r}: Megatron's "
            "local attention cannot split the sequence)"
        )


def check_window_context_parallel(arch: ModelArchitecture, context_parallel_size: int, longest: int, where: str):
    """Refuse a sliding window that can hide keys at CP > 1 (``longest``: the longest sequence the run can give the
    model). Context-parallel attention gathers every key; a window that bites would run through explicit masks over
    the gathered sequence, which the trainer does not use. A window at least as long as every sequence hides nothing:
    it runs as full causal attention, as at CP=1."""
    window = arch.sliding_window
    if context_parallel_size == 1 or window is None or window >= longest:
        return
    raise ValueError(
        f"{where}: a sliding window of {window} tokens (config.json sliding_window) hides keys in sequences of up to "
        f"{longest} tokens, and parallel.context_parallel_size={context_parallel_size} does not run sliding-window "
        f"attention; set train.max_seq_len <= {window} (the window then hides nothing), or "
        "parallel.context_parallel_size=1"
    )


def grouped_gemm_unavailable(te: bool, device_type: str, dtype: torch.dtype) -> str | None:
    """Why a grouped expert GEMM cannot run here, or None where it can: with TransformerEngine Megatron's
    ``TEGroupedMLP``; without, megatron-opd's :class:`~megatron_opd.models.grouped_experts.GroupedExperts`
    (``torch._grouped_mm``; Megatron-Core's own grouped paths without TransformerEngine are gone in 0.19)."""
    if te:
        return None
    from megatron_opd.models.grouped_experts import grouped_mm_unavailable

    return grouped_mm_unavailable(device_type, dtype)


def experts_kernel(grouped: bool, te: bool) -> str:
    """Which expert GEMMs an MoE model runs, for the start-up line."""
    if not grouped:
        return "one after another (Megatron's SequentialMLP)"
    return "as one grouped GEMM (TransformerEngine's TEGroupedMLP)" if te else "as grouped GEMMs (torch._grouped_mm)"


def layer_spec(
    arch: ModelArchitecture,
    te: bool,
    config,
    vp_stage: int | None,
    attention: str = "sdpa",
    norm: str = "torch",
    moe_grouped_gemm: bool = False,
    gated_delta_net_kernel: str = "auto",
):
    """Megatron-Core spec of one chunk's decoder: the family's spec for each of the chunk's layers (Megatron
    numbers a chunk's layers from its offset) and its final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    family = family_named(arch.family)
    options = SpecOptions(
        te=te,
        attention=attention,
        norm=norm,
        moe_grouped_gemm=moe_grouped_gemm,
        gated_delta_net_kernel=gated_delta_net_kernel,
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    specs = family.layer_specs(arch, layers, options)
    if len(specs) != len(layers):
        raise ValueError(f"family {family.name} gave {len(specs)} layer specs for the {len(layers)} layers {layers}")
    return TransformerBlockSubmodules(layer_specs=list(specs), layer_norm=family.final_norm(options))


def build_model_chunk(
    arch: ModelArchitecture,
    config,
    *,
    te: bool,
    vp_stage: int | None,
    pre_process: bool,
    post_process: bool,
    padded_vocab_size: int,
    attention: str = "sdpa",
    norm: str = "torch",
    moe_grouped_gemm: bool = False,
    gated_delta_net_kernel: str = "auto",
):
    """One ``GPTModel`` chunk: the layers of one (virtual) pipeline stage, built by the family's hook."""
    return family_named(arch.family).build_chunk(
        arch,
        config,
        layer_spec(arch, te, config, vp_stage, attention, norm, moe_grouped_gemm, gated_delta_net_kernel),
        vocab_size=padded_vocab_size,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def build_model(
    arch: ModelArchitecture,
    parallel: ParallelConfig,
    build: ModelBuildConfig | None = None,
    *,
    trainable: bool = True,
) -> list:
    """This rank's model chunks (one per virtual pipeline stage) under Megatron's initialised groups.

    ``trainable=False`` builds a teacher: parameters frozen, eval mode, no gradient buffers.
    """
    from megatron.core import parallel_state

    build = build or ModelBuildConfig()
    if parallel_state.get_tensor_model_parallel_world_size() != parallel.tensor_model_parallel_size or (
        parallel_state.get_pipeline_model_parallel_world_size() != parallel.pipeline_model_parallel_size
    ):
        raise RuntimeError(
            "Megatron's parallel groups do not match the requested layout: call "
            "megatron_opd.distributed.initialize_model_parallel(parallel) first"
        )
    chunks = build_chunks(arch, parallel, build, transformer_config(arch, parallel, build))
    for chunk in chunks:
        # As Megatron's own get_model: Megatron's layers are created on the GPU, our norms and buffers on the CPU.
        if torch.cuda.is_available() and any(p.device.type == "cpu" for p in chunk.parameters()):
            chunk.cuda(torch.cuda.current_device())
        if not trainable:
            chunk.requires_grad_(False)
            chunk.eval()
    if arch.moe is not None and build.moe_fused_routing:  # after the move: it re-homes the experts' weights
        from megatron_opd.moe.layer import use_fused_moe_layers

        use_fused_moe_layers(chunks)
    return chunks


def build_chunks(arch: ModelArchitecture, parallel: ParallelConfig, build: ModelBuildConfig, config) -> list:
    """One ``GPTModel`` per virtual pipeline stage of this rank, under Megatron's initialised groups.

    Parameters go where torch's default device says (the checkpoint converter builds on ``meta``).
    """
    from megatron.core import parallel_state

    te = use_te_spec(build, parallel)
    grouped = arch.moe is not None and build.moe_grouped_gemm
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if grouped and (reason := grouped_gemm_unavailable(te, device_type, parse_dtype(build.dtype))):
        logger.warning("build.moe_grouped_gemm: no grouped expert GEMM here (%s); experts run one by one", reason)
        grouped = False
    if arch.moe is not None:
        logger.info(
            "MoE layers %s: %d experts, top-%d, experts run %s, %s token dispatcher",
            list(arch.moe.layers),
            arch.moe.num_experts,
            arch.moe.top_k,
            experts_kernel(grouped, te),
            build.token_dispatcher(parallel.expert_model_parallel_size),
        )
    padded_vocab = arch.padded_vocab_size(parallel.tensor_model_parallel_size, build.make_vocab_size_divisible_by)
    vp_size = parallel.vp_size
    chunks = []
    for vp_stage in range(vp_size):
        stage = vp_stage if vp_size > 1 else None
        chunks.append(
            build_model_chunk(
                arch,
                config,
                te=te,
                vp_stage=stage,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                padded_vocab_size=padded_vocab,
                attention=build.attention,
                norm=build.norm,
                moe_grouped_gemm=grouped,
                gated_delta_net_kernel=build.gated_delta_net_kernel,
            )
        )
    return chunks
