"""The distillation trainer's configuration: one dataclass per section, every field with a default and a doc line.

Each section lives beside the package it configures (``teacher.config``, ``data.config``, ``rollout.config``,
``losses.config``, ``scheduler.config``, ``checkpoint.config``, ``distributed.parallel``, ``models.builder``); the
trainer's own sections, the multi-teacher map and :class:`TrainConfig` with its checks between sections are here,
and every section is importable from here.

``python -m megatron_opd.train --help`` prints every key. Values come from ``--config FILE.yaml`` and then
``section.key=value`` overrides; unknown keys are errors naming the valid ones.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from megatron_opd.checkpoint.config import CheckpointConfig
from megatron_opd.data.config import DataConfig
from megatron_opd.distributed.parallel import ParallelConfig
from megatron_opd.losses.config import LossConfig
from megatron_opd.models.builder import ModelBuildConfig
from megatron_opd.models.lora import LoRAConfig
from megatron_opd.rollout.config import RolloutConfig
from megatron_opd.scheduler.config import SchedulerConfig
from megatron_opd.teacher.config import TeacherConfig

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelBuildConfig",
    "NamedTeacherConfig",
    "OptimConfig",
    "ParallelConfig",
    "RolloutConfig",
    "SchedulerConfig",
    "StudentConfig",
    "TeacherConfig",
    "TeacherLossConfig",
    "TrainConfig",
    "TrainLoopConfig",
]


@dataclass
class StudentConfig:
    """The model being trained."""

    path: str = ""
    """Hugging Face folder (config.json + safetensors) or a dist_ckpt folder written by tools/checkpoint."""
    tokenizer: str | None = None
    """Folder with the tokenizer files; default: ``path`` (or ``path/hf_config`` for a dist_ckpt)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (``models/lora.py``): only they train, the base weights stay frozen; off by default."""


@dataclass
class TeacherLossConfig:
    """One teacher's overrides of ``loss.*`` (``teachers.NAME.loss.*``); unset keys take the global ``loss.*``."""

    kind: Literal["forward_kl", "reverse_kl", "jsd"] | None = None
    """``loss.kind`` for this teacher's samples (a divergence; SFT has no teacher)."""
    mode: Literal["dense", "topk", "sampled"] | None = None
    """``loss.mode`` for this teacher's samples."""
    topk: int | None = None
    """``loss.topk`` for this teacher's samples."""
    tail: Literal["bucket", "renorm", "ignore"] | None = None
    """``loss.tail`` for this teacher's samples."""
    cross_tokenizer: Literal["off", "sampled", "aligned"] | None = None
    """``loss.cross_tokenizer``: whether this teacher has another tokenizer than the student, and its loss."""
    weight: float = 1.0
    """This teacher's tokens count this many times in the step's loss (1: as any other token)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.weight < math.inf:
            raise ValueError(f"loss.weight must be a finite number > 0, got {self.weight}")


@dataclass
class NamedTeacherConfig(TeacherConfig):
    """One of several teachers (``teachers.NAME.*``): every ``teacher.*`` key, and its overrides of ``loss.*``."""

    loss: TeacherLossConfig = field(default_factory=TeacherLossConfig)
    """Overrides of the global ``loss.*`` for the samples this teacher scores, each merged config validated."""

    def teacher(self) -> TeacherConfig:
        """The ``teacher.*`` section this entry stands for."""
        return TeacherConfig(**{f.name: getattr(self, f.name) for f in fields(TeacherConfig)})


@dataclass
class TrainLoopConfig:
    """Steps and batch sizes."""

    steps: int = 100
    """Optimizer steps to run (a resumed run continues up to this many)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step, over all data-parallel ranks (each sampled ``rollout.n`` times)."""
    micro_batch_size: int = 8
    """Sequences (prompts x rollout.n) per forward/backward micro-batch on one data-parallel rank."""
    max_seq_len: int | None = None
    """Longest prompt + response; default: the student's max_position_embeddings. Longer prompts are skipped."""
    packing: bool = True
    """Concatenate a micro-batch's sequences with no padding (THD: attention within each, RoPE restarting) for the
    student update; false pads each micro-batch to its longest sequence. Needs build.attention=sdpa or TE."""
    micro_batch_tokens: int | None = None
    """With packing and pipeline parallelism: tokens per packed micro-batch (each filled with whole sequences, then
    padded to it: stages exchange one shape); None: micro_batch_size x the step's longest sequence. At least the
    longest sample (``train.max_seq_len`` or the student's context), refused at start-up otherwise."""
    collapse_check: Literal["stop", "warn", "off"] = "stop"
    """Watch for responses that collapse while the per-token divergence does not improve
    (``megatron_opd.trainer.collapse``): stop the run with an error naming the likely cause, only warn, or off."""
    collapse_length_ratio: float = 0.7
    """Responses count as collapsed when their mean length over the last ``collapse_window`` steps is below this share
    of the first window's (and the divergence has not improved: ``collapse_min_improvement``)."""
    collapse_min_improvement: float = 0.1
    """The per-token divergence counts as improved once it has fallen by this share of its first window's value; a
    collapse of the response length without that improvement is flagged."""
    collapse_window: int = 10
    """Steps averaged for each side of the comparison (the first window is the reference), in the collapse check and
    in the drift check (``drift_check``)."""
    collapse_patience: int = 20
    """Steps in a row the collapse must hold before the run stops (it warns at the first)."""
    drift_check: Literal["stop", "warn", "off"] = "stop"
    """Watch for a student that moves away from its teacher (``megatron_opd.trainer.collapse``): the per-token
    divergence rising past ``drift_divergence_ratio`` times its first window's, or top-1 agreement falling more than
    ``drift_agreement_drop`` below it; stop the run with an error naming the likely cause, only warn, or off."""
    drift_divergence_ratio: float = 1.5
    """The per-token divergence counts as moving away once its mean over the last ``collapse_window`` steps is above
    this many times the first window's (by its size: a sampled estimate can be negative)."""
    drift_agreement_drop: float = 0.04
    """Top-1 agreement with the teacher (where logged) counts as moving away once its mean over the last
    ``collapse_window`` steps is more than this below the first window's."""
    drift_patience: int = 13
    """Steps in a row the drift must hold before the run stops (it warns at the first); keep it above
    ``collapse_window``, so that one outlier step, which stays in the window that many steps, cannot stop a run."""
    freeze_router: bool = False
    """Mixture-of-Experts students: keep every router's weights as loaded (no gradient, no optimizer state), so that
    distillation moves the experts and the rest but not which experts a token goes to (NeMo-RL's
    ``freeze_moe_router``); refused for a dense student and with ``build.moe_router_bias_update_rate > 0`` (the
    expert bias is part of the routing too)."""
    device_memory_gib: float | None = None
    """Memory of one device for the start-up memory check (GiB); None: ask the device (on CPU: none, the check only
    logs its estimate). Set it to check a layout for another GPU from a dry run."""
    skip_memory_check: bool = False
    """Start even when the estimated peak of a device (student, in-process teacher, colocated vLLM;
    ``trainer/memory.py``) exceeds its memory; the estimate is still logged."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_size", "collapse_window", "collapse_patience",
                     "drift_patience"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.collapse_check not in ("stop", "warn", "off"):
            raise ValueError(f"train.collapse_check must be stop, warn or off, got {self.collapse_check!r}")
        if not 0.0 < self.collapse_length_ratio < 1.0:
            raise ValueError(
                f"train.collapse_length_ratio must be in (0, 1), got {self.collapse_length_ratio}: it is the share of "
                "the starting response length below which responses count as collapsed"
            )
        if not 0.0 <= self.collapse_min_improvement < 1.0:
            raise ValueError(f"train.collapse_min_improvement must be in [0, 1), got {self.collapse_min_improvement}")
        if self.drift_check not in ("stop", "warn", "off"):
            raise ValueError(f"train.drift_check must be stop, warn or off, got {self.drift_check!r}")
        if not self.drift_divergence_ratio > 1.0:
            raise ValueError(
                f"train.drift_divergence_ratio must be > 1, got {self.drift_divergence_ratio}: it is how many times "
                "the starting per-token divergence the run may reach before it counts as moving away from its teacher"
            )
        if not 0.0 < self.drift_agreement_drop <= 1.0:
            raise ValueError(f"train.drift_agreement_drop must be in (0, 1], got {self.drift_agreement_drop}")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ValueError(
                f"train.device_memory_gib must be > 0 (or null: ask the device), got {self.device_memory_gib}"
            )
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"train.micro_batch_tokens must be >= 1 (or null), got {self.micro_batch_tokens}")


@dataclass
class OptimConfig:
    """Megatron-Core optimizer and learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay from ``lr`` to ``min_lr`` over the steps after warm-up."""
    lr_decay_steps: int | None = None
    """The step at which the decay reaches ``min_lr`` (Megatron-LM's ``--lr-decay-iters``); None: ``train.steps``.
    Set it to shorten a run while keeping a longer run's schedule."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    bf16: bool | None = None
    """bf16 parameters with fp32 main parameters; None: on when the accelerator is a GPU/NPU, off on CPU."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer state over data-parallel ranks; None: on with bf16 on GPU/NPU, off on CPU."""
    overlap_grad_reduce: bool = True
    """Reduce gradients over data-parallel ranks bucket by bucket while the backward pass runs (Megatron's
    ``overlap_grad_reduce``; with pipeline parallelism each model chunk's reduction starts when its last
    micro-batch's backward is done). False: one reduction after the backward pass."""
    overlap_param_gather: bool | None = None
    """Distributed optimizer: all-gather the updated parameters bucket by bucket during the next forward pass
    (Megatron's ``overlap_param_gather``) instead of right after the step; every reader of the weights (weight
    sync, sampler, evaluation, checkpoint) finishes the gather first. None: on with the distributed optimizer and
    ``overlap_grad_reduce``."""

    lag_lr_target: float | None = None
    """The staleness-aware step size, in nats per token (0 or None: off): a stale batch's step uses
    ``lr x min(1, lag_lr_target / lag)``, with ``lag`` its ``staleness/policy_lag`` (mean |log p_trainer -
    log p_sampler| per sampled token, read in the same step's loss pass), logged as ``staleness/lr_scale``. It changes
    the step size, not the objective; fresh batches keep the schedule's rate (``trainer/lag_lr.py``,
    ``docs/training.md``)."""

    def __post_init__(self) -> None:
        # Checked here so a bad value names its key (torch's own errors do not) before anything is built.
        if self.lag_lr_target is not None and not 0 <= self.lag_lr_target < math.inf:
            raise ValueError(
                f"optim.lag_lr_target must be a finite number of nats per token >= 0 (e.g. 0.1; 0 or null: off), "
                f"got {self.lag_lr_target}"
            )
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr must be a finite number > 0 (e.g. 1e-5), got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"optim.min_lr must be in [0, optim.lr={self.lr:g}] (where the decay ends), got {self.min_lr}"
            )
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0 (0: no warm-up), got {self.lr_warmup_steps}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"optim.lr_decay_steps={self.lr_decay_steps} must be > optim.lr_warmup_steps={self.lr_warmup_steps} "
                "(the decay starts after the warm-up); unset it to decay over train.steps"
            )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1) (e.g. 0.9, 0.999), got {getattr(self, name)}")
        if not 0 < self.adam_eps < math.inf:
            raise ValueError(f"optim.adam_eps must be a finite number > 0 (e.g. 1e-8), got {self.adam_eps}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optim.weight_decay must be a finite number >= 0 (0: off), got {self.weight_decay}")
        if not 0 <= self.clip_grad < math.inf:
            raise ValueError(f"optim.clip_grad must be a finite number >= 0 (0: no clipping), got {self.clip_grad}")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError(
                "optim.overlap_param_gather=true needs optim.overlap_grad_reduce=true (Megatron gathers parameters in "
                "the gradient buckets); set optim.overlap_grad_reduce=true or optim.overlap_param_gather=false"
            )
        if self.overlap_param_gather and self.use_distributed_optimizer is False:
            raise ValueError(
                "optim.overlap_param_gather=true needs the distributed optimizer (the plain one updates whole "
                "parameters on every rank: nothing to gather); set optim.use_distributed_optimizer=true or unset "
                "optim.overlap_param_gather"
            )


@dataclass
class EvalConfig:
    """Periodic evaluation on ``data.eval_files``."""

    every: int = 0
    """Evaluate every this many steps (0: only before the first and after the last step)."""
    max_prompts: int = 64
    """Evaluate on at most this many eval prompts."""
    temperature: float = 0.0
    """Sampling temperature of the evaluation rollouts (0: greedy)."""
    scorer: str | None = None
    """``module:function`` scoring (prompt, response, record) -> float in [0, 1]; its mean is the accuracy."""
    teacher_responses: bool = True
    """Also measure the divergence on a fixed set of teacher-generated (greedy) responses."""

    def __post_init__(self) -> None:
        if self.max_prompts < 1:
            raise ValueError(
                f"eval.max_prompts must be >= 1, got {self.max_prompts}; to run without evaluation, set "
                "data.eval_files to an empty value"
            )
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0 (0: before the first and after the last step), got {self.every}")


@dataclass
class LoggingConfig:
    """Console, TensorBoard and W&B metrics."""

    log_every: int = 1
    """Print a metrics line every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard events to ``output_dir/tensorboard``."""
    wandb_project: str | None = None
    """Also log to this W&B project (needs ``pip install wandb``)."""
    progress_bar: bool = True
    """tqdm progress bar on rank 0."""


@dataclass
class TrainConfig:
    """On-policy distillation: the student samples, the teacher scores every token, the student learns."""

    student: StudentConfig = field(default_factory=StudentConfig)
    """The model being trained."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The frozen scorer."""
    teachers: dict[str, NamedTeacherConfig] = field(default_factory=dict)
    """Several teachers by name instead of ``teacher.*``: each record's ``data.teacher_key`` field names the one that
    scores its samples (``teachers.NAME.*``: every ``teacher.*`` key and ``loss.*`` overrides; docs/training.md)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    """Steps and batch sizes."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Objective."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Ordering of rollout, teacher and update."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics output."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout of the student (and of the in-process teacher)."""
    build: ModelBuildConfig = field(default_factory=lambda: ModelBuildConfig(dtype="auto"))
    """Model builder options (of the student and the in-process teacher)."""
    output_dir: str = "runs/opd"
    """Metrics, checkpoints (by default) and the final Hugging Face export (``output_dir/hf``)."""
    seed: int = 1234
    """Seeds initialisation, data order and sampling."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    """Accelerator (auto: CUDA, then Ascend NPU, then CPU with gloo)."""
    export_hf: bool = True
    """Export the final student to ``output_dir/hf`` (loadable by transformers and vLLM)."""

    def _validate_teacher_graphs(self) -> None:
        """``teacher.cuda_graphs``: the layouts whose teacher forward has one shape per bucket, on CUDA."""
        p = self.parallel
        refusals = {
            f"teacher.backend={self.teacher.backend} (a teacher server takes --cuda-graphs)": (
                self.teacher.backend != "inprocess"
            ),
            f"device={self.device}": self.device not in ("auto", "cuda"),
            "train.packing=true (packed rows have varying cu_seqlens)": self.train.packing,
            f"pipeline_model_parallel_size={p.pipeline_model_parallel_size}": p.pipeline_model_parallel_size > 1,
            f"context_parallel_size={p.context_parallel_size}": p.context_parallel_size > 1,
            f"expert_model_parallel_size={p.expert_model_parallel_size} (token counts per rank vary)": (
                p.expert_model_parallel_size > 1
            ),
            "teacher.offload=true (the weights move between captures and replays)": self.teacher.offload,
            f"teacher.cuda_graph_lengths={self.teacher.cuda_graph_lengths} not all multiples of "
            f"tensor_model_parallel_size={p.tensor_model_parallel_size} (sequence parallelism splits them)": any(
                n % p.tensor_model_parallel_size for n in self.teacher.cuda_graph_lengths
            ),
        }
        refused = [name for name, on in refusals.items() if on]
        if refused:
            raise ValueError(
                f"teacher.cuda_graphs=true cannot run with {', '.join(refused)}: it captures one forward per padded "
                "shape on a CUDA device; set teacher.cuda_graphs=false or change those settings"
            )

    def _validate_remote_teacher(self) -> None:
        from megatron_opd.teacher.transport import split_addresses

        backend, t = self.teacher.backend, self.teacher
        if not t.address:
            example = "host:port of the teacher server" if backend == "server" else "http://host:port of vLLM's server"
            raise ValueError(f"teacher.address is required with teacher.backend={backend}: {example} "
                             "(replicas: comma-separated)")  # fmt: skip
        if backend == "server":
            split_addresses(t.address)
        if t.transfer == "hidden":
            if backend != "server":
                raise ValueError(
                    "teacher.transfer=hidden needs teacher.backend=server: a vLLM server returns log-probabilities, "
                    "not hidden states; use teacher.transfer=topk with loss.mode=topk"
                )
            if self.loss.mode != "dense":
                raise ValueError(
                    "teacher.transfer=hidden serves loss.mode=dense (the whole distribution); with loss.mode=topk "
                    "keep teacher.transfer=topk, which sends far fewer bytes"
                )
            if not t.path:
                raise ValueError(
                    "teacher.transfer=hidden needs teacher.path: the trainer loads the teacher's output layer from it "
                    "(the Hugging Face or dist_ckpt folder of the model the server runs)"
                )
        from megatron_opd.teacher.capabilities import refusal

        why = refusal(backend, t.transfer, mode=self.loss.mode, support=self.loss.support, temperature=t.temperature)
        if why is not None:  # from the back end's declared capabilities (teacher/capabilities.py)
            raise ValueError(why)
        if backend != "vllm":
            return
        if not (t.tokenizer or t.path):
            raise ValueError(
                "teacher.backend=vllm needs the teacher's tokenizer files for the vocabulary check (vLLM publishes "
                "no vocabulary): set teacher.tokenizer (or teacher.path) to the folder of the model the server runs"
            )

    def _validate_staleness_correction(self) -> None:
        loss, rollout = self.loss, self.rollout
        if not loss.staleness_clip >= 1.0:
            raise ValueError(f"loss.staleness_clip={loss.staleness_clip} must be >= 1 (fresh batches have weight 1)")
        truncated = rollout.temperature not in (0.0, 1.0) or rollout.top_k or rollout.top_p != 1.0
        if truncated and loss.sampled_credit == "to_go":
            raise ValueError(
                "loss.sampled_credit=to_go weighs each token by the log-ratios of the later tokens of its sample, whose "
                "truncated draws (rollout.temperature / top_k / top_p) a per-token ratio does not correct: sample at "
                "temperature 1 without top_k/top_p, or set loss.sampled_credit=token"
            )
        for key, value in (("staleness_correction", loss.staleness_correction),
                           ("rollout_correction", loss.rollout_correction)):  # fmt: skip
            if value == "off":
                continue
            if loss.kind == "sft" or loss.cross_tokenizer != "off" or loss.fused_output == "on":
                raise ValueError(
                    f"loss.{key}={value} weights the distillation loss by the student's own token ratios: it needs "
                    f"loss.kind != sft, loss.cross_tokenizer=off and loss.fused_output != on; set loss.{key}=off or "
                    "change those"
                )
            if truncated and rollout.backend == "vllm" and rollout.address:
                raise ValueError(
                    f"loss.{key}={value} with truncated sampling (rollout.temperature {rollout.temperature}, top_k "
                    f"{rollout.top_k}, top_p {rollout.top_p}) needs the log-probabilities of the distribution the "
                    "sampler drew from, which vLLM servers (rollout.address) report only when started with "
                    "--logprobs-mode processed_logprobs, and then without the model's own: drop rollout.address (the "
                    "trainer's own vLLM engine records both), use rollout.backend=builtin, sample at temperature 1 "
                    f"without top_k/top_p, or set loss.{key}=off"
                )
            if truncated and rollout.backend == "vllm" and rollout.max_new_tokens < 2:
                raise ValueError(
                    f"loss.{key}={value} with truncated vLLM rollouts scores each sample once more in the engine, "
                    "which needs one position of the context free: the prompts may fill all but "
                    f"rollout.max_new_tokens={rollout.max_new_tokens} of it; set rollout.max_new_tokens >= 2"
                )
            if rollout.temperature == 0.0:
                raise ValueError(
                    f"loss.{key}={value}: rollout.temperature=0 is greedy decoding, which has no sampling "
                    f"distribution to weigh by; sample (temperature > 0) or set loss.{key}=off"
                )

    def _validate_context_parallel(self) -> None:
        """What context parallelism (the sequence split over CP ranks, ``models.context_parallel``) cannot run."""
        from megatron_opd.models.builder import check_context_parallel

        cp = self.parallel.context_parallel_size
        check_context_parallel(self.build, cp)
        if self.train.packing:
            raise ValueError(
                f"train.packing=true with parallel.context_parallel_size={cp}: packed sequences are not split over "
                "context-parallel ranks (no per-sequence split of cu_seqlens yet); set train.packing=false"
            )
        if self.rollout.backend == "builtin":
            raise ValueError(
                f"rollout.backend=builtin with parallel.context_parallel_size={cp}: the built-in sampler's decode "
                "steps cannot split the sequence; set rollout.backend=vllm"
            )
        if self.teachers:
            raise ValueError(
                f"teachers.* with parallel.context_parallel_size={cp}: a step routed over several teachers does not "
                "split its micro-batches over context-parallel ranks yet; use one teacher.* or "
                "parallel.context_parallel_size=1"
            )

    def _validate_shared_expert_overlap(self) -> None:
        """``build.moe_shared_expert_overlap``: the dispatcher it needs, and no LoRA on the shared experts at TP > 1
        (overlapped, their linear layers leave the sequence-parallel all-gather to the dispatcher; an adapter's
        hook would gather its input again). The student's shared experts: ``setup.check_inputs``."""
        from megatron_opd.models.builder import check_shared_expert_overlap

        check_shared_expert_overlap(self.build, self.parallel)
        lora, tp = self.student.lora, self.parallel.tensor_model_parallel_size
        mlp_targets = sorted({"linear_fc1", "linear_fc2"} & set(lora.target_modules))
        if self.build.moe_shared_expert_overlap and lora.enabled and tp > 1 and mlp_targets:
            raise ValueError(
                f"build.moe_shared_expert_overlap=true with student.lora.target_modules={mlp_targets} at "
                f"tensor_model_parallel_size={tp}: overlapped shared experts take their inputs already gathered over "
                "tensor-parallel ranks, which the adapters would gather again; set build.moe_shared_expert_overlap="
                "false or leave linear_fc1/linear_fc2 out of the adapters"
            )

    def _validate_expert_parallel(self) -> None:
        """What runs at expert parallelism: the built-in sampler, in-process teachers, training, evaluation, each
        keeping the expert-parallel ranks in step (``distributed.lockstep``)."""
        ep = self.parallel.expert_model_parallel_size
        if self.build.token_dispatcher(ep) == "allgather":
            raise ValueError(
                f"build.moe_token_dispatcher=allgather with parallel.expert_model_parallel_size={ep}: the allgather "
                "dispatcher needs the same number of tokens on every expert-parallel rank at every forward, but "
                "data-parallel ranks hold prompts of their own lengths; set build.moe_token_dispatcher=alltoall "
                "(or auto, the default)"
            )
        router_losses = self.build.moe_aux_loss_coeff > 0 or self.build.moe_z_loss_coeff > 0
        if router_losses and self.build.recompute == "full":
            raise ValueError(
                f"build.moe_aux_loss_coeff / build.moe_z_loss_coeff with build.recompute_granularity=full at "
                f"parallel.expert_model_parallel_size={ep}: a recomputed layer forms its router losses in the "
                "backward, where the lockstep's dummy micro-batches cannot be left out of them; use "
                "recompute_granularity=selective (or null), or no router loss"
            )
        if self.build.moe_router_bias_update_rate > 0 and self.build.recompute == "full":
            raise ValueError(
                f"build.moe_router_bias_update_rate={self.build.moe_router_bias_update_rate} with "
                f"build.recompute_granularity=full at parallel.expert_model_parallel_size={ep}: a recomputed layer "
                "counts its tokens per expert in the backward, where the lockstep's dummy micro-batches cannot be "
                "left out of the expert-bias update; use recompute_granularity=selective (or null), or rate 0"
            )

    def _validate_teacher(self) -> None:
        """The checks of ``teacher.*`` against ``loss.*`` (run for each teacher's view with ``teachers.*``)."""
        if self.teacher.transfer == "hidden" and self.teacher.backend == "inprocess":
            raise ValueError(
                "teacher.transfer=hidden applies to teacher.backend=server (an in-process teacher already hands "
                "the loss its hidden states); remove teacher.transfer"
            )
        if self.teacher.prompt_template is not None:
            from megatron_opd.data.teacher_prompt import template_fields

            if self.loss.kind == "sft":
                raise ValueError(
                    "teacher.prompt_template is the teacher's prompt; loss.kind=sft has no teacher: unset it"
                )
            template_fields(self.teacher.prompt_template)  # a malformed template, named before anything is read
        cross = self.loss.cross_tokenizer
        if cross != "off":
            if self.teacher.backend == "server" and not (self.teacher.tokenizer or self.teacher.path):
                raise ValueError(
                    f"loss.cross_tokenizer={cross} with teacher.backend=server needs the teacher's tokenizer files "
                    "(the trainer re-tokenizes for it; the server's summary cannot encode text): set "
                    "teacher.tokenizer (or teacher.path) to the folder of the model the server runs"
                )
            if self.rollout.tool_fn:
                raise ValueError(
                    f"loss.cross_tokenizer={cross} cannot align tool outputs yet: unset rollout.tool_fn or "
                    "loss.cross_tokenizer"
                )
        if self.teacher.cuda_graphs:
            self._validate_teacher_graphs()
        if self.loss.kind != "sft" and self.teacher.backend in ("server", "vllm"):
            self._validate_remote_teacher()
        elif self.loss.kind != "sft" and not self.teacher.path:
            raise ValueError("teacher.path is required for distillation (loss.kind != sft)")

    def teacher_views(self) -> dict[str, TrainConfig]:
        """With ``teachers.*``: per name, this config in the one-teacher form of that teacher (its ``teacher.*`` and
        the global ``loss.*`` with its overrides), which every one-teacher path takes (vocabulary check, back end,
        objective). Sections other than ``teacher``/``loss`` are shared with this config."""
        views = {}
        for name, spec in self.teachers.items():
            overrides = {f.name: getattr(spec.loss, f.name) for f in fields(TeacherLossConfig) if f.name != "weight"}
            try:
                loss = replace(self.loss, **{k: v for k, v in overrides.items() if v is not None})
            except ValueError as err:
                raise ValueError(f"teachers.{name}.loss merged over loss.*: {err}") from None
            views[name] = replace(self, teacher=spec.teacher(), loss=loss, teachers={})
        return views

    def _validate_teachers(self) -> None:
        names = sorted(self.teachers)
        if self.teacher != TeacherConfig():
            raise ValueError(
                f"teacher.* and teachers.* ({', '.join(names)}) are both set: teacher.* is the one-teacher form; move "
                "its keys under teachers.NAME.*"
            )
        if self.loss.kind == "sft":
            raise ValueError("loss.kind=sft trains on the records' responses with no teacher: remove teachers.*")
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(f"teachers.{name}: a teacher's name may hold letters, digits, _ and - only "
                                 "(it names metrics teacher/NAME/...)")  # fmt: skip
        if self.data.default_teacher is not None and self.data.default_teacher not in self.teachers:
            raise ValueError(f"data.default_teacher={self.data.default_teacher} is none of teachers.*: {names}")
        inprocess = [n for n in names if self.teachers[n].backend == "inprocess"]
        if len(inprocess) > 1:
            raise ValueError(
                f"teachers {inprocess} are all backend=inprocess: at most one teacher shares the student's ranks; "
                "serve the others (teachers.NAME.backend=server or vllm)"
            )
        if self.loss.weighting == "teacher_confidence":
            raise ValueError(
                "loss.weighting=teacher_confidence is not supported with teachers.* yet: use none or reward"
            )
        if self.parallel.pipeline_model_parallel_size > 1 and not self.train.packing:
            raise ValueError(
                "teachers.* with pipeline parallelism needs train.packing=true (a micro-batch holds one teacher's "
                "samples, so micro-batches are filled to one token budget rather than a count of samples)"
            )
        for name, view in self.teacher_views().items():
            try:
                view._validate_teacher()
                view._validate_staleness_correction()
            except ValueError as err:
                raise ValueError(f"teachers.{name}: {err} (teacher.* / loss.* here: teachers.{name}.*)") from None

    def _validate_routing_replay(self) -> None:
        """What ``rollout.routing_replay`` cannot run: SFT and tool turns, a dense student, a vLLM that returns no
        routes for the student's family (read from its ``config.json``, before any model)."""
        import json
        from pathlib import Path

        from megatron_opd.models.families import BY_MODEL_TYPE
        from megatron_opd.models.families.moe import MoEFamily

        if self.loss.kind == "sft" or self.rollout.tool_fn:
            what = "loss.kind=sft trains on records, not rollouts" if self.loss.kind == "sft" else (
                "rollout.tool_fn inserts tool tokens no sampler routed")  # fmt: skip
            raise ValueError(f"rollout.routing_replay=true: {what}; set rollout.routing_replay=false")
        path = Path(self.student.path) / "config.json"
        if not path.is_file():
            return
        model_type = json.loads(path.read_text()).get("model_type")
        family = BY_MODEL_TYPE.get(model_type)
        if not isinstance(family, MoEFamily):
            raise ValueError(
                f"rollout.routing_replay=true needs a Mixture-of-Experts student; student.path is {model_type!r}, "
                "which has no router: set rollout.routing_replay=false"
            )
        if self.rollout.backend == "vllm" and family.vllm_no_routes:
            raise ValueError(
                f"rollout.routing_replay=true with rollout.backend=vllm is not supported for {model_type}: "
                f"{family.vllm_no_routes}; use rollout.backend=builtin (it records its own routes) or "
                "rollout.routing_replay=false"
            )

    def _validate_lora(self) -> None:
        """What a LoRA student (``student.lora.rank > 0``) cannot run yet, refused before any model is built."""
        import json
        from pathlib import Path

        from megatron_opd.distributed.device import has_transformer_engine

        rank = self.student.lora.rank
        te = self.build.use_transformer_engine
        refused = [
            (te is True or (te is None and has_transformer_engine()), "TransformerEngine layers (build."
             "use_transformer_engine, by default on where TE runs: TE fuses the norm into linear_qkv; adapters wrap "
             "Megatron's own layers)", "build.use_transformer_engine=false"),
        ]  # fmt: skip
        for bad, what, fix in refused:
            if bad:
                raise ValueError(
                    f"student.lora.rank={rank} (a LoRA student) with {what}: set {fix}, or student.lora.rank=0"
                )
        if self.student.lora.dropout > 0 and self.parallel.tensor_model_parallel_size > 1:
            raise ValueError(
                f"student.lora.dropout={self.student.lora.dropout} at tensor_model_parallel_size > 1: the adapter's "
                "dropout masks are not drawn alike on every TP rank yet; set student.lora.dropout=0"
            )
        config = Path(self.student.path) / "config.json"
        if config.is_file() and "kv_lora_rank" in json.loads(config.read_text()):
            raise ValueError(
                f"student.lora.rank={rank}: the student ({self.student.path}) has multi-latent attention, whose "
                "projections take no adapters yet; set student.lora.rank=0"
            )

    def validate(self) -> None:
        """Checks that need the whole config (run by the entry point, after overrides); fills derived defaults."""
        if self.checkpoint.dir is None:
            self.checkpoint.dir = f"{self.output_dir.rstrip('/')}/checkpoints"
        if not self.student.path:
            raise ValueError("student.path is required: a Hugging Face or dist_ckpt folder of the student")
        if self.teachers:
            self._validate_teachers()
        else:
            self._validate_teacher()
            if self.data.default_teacher is not None or self.loss.teacher_balance != "tokens":
                raise ValueError(
                    "data.default_teacher and loss.teacher_balance=per_teacher apply to several teachers (teachers.*); "
                    "unset them for the one-teacher form teacher.*"
                )
        dtype = self.build.dtype
        if dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(
                f"build.dtype={dtype}: the trainer builds the student (and the in-process teacher) in fp32 or bf16 "
                "(auto: bf16 where optim.bf16 resolves true); set build.dtype to auto, fp32 or bf16"
            )
        if dtype != "auto" and self.optim.bf16 is not None and self.optim.bf16 != (dtype == "bf16"):
            raise ValueError(
                f"build.dtype={dtype} contradicts optim.bf16={str(self.optim.bf16).lower()}: the student's parameters "
                "are the optimizer's; set one of them (or build.dtype=auto to follow optim.bf16)"
            )
        if not self.data.train_files:
            raise ValueError("data.train_files is required: one path or a list of JSONL/Parquet files")
        if self.optim.lr_warmup_steps >= self.train.steps:
            raise ValueError(
                f"optim.lr_warmup_steps={self.optim.lr_warmup_steps} must be < train.steps={self.train.steps}: the "
                "learning rate would never reach optim.lr; lower the warm-up or raise train.steps"
            )
        if self.train.packing and self.build.attention == "local" and self.build.use_transformer_engine is not True:
            raise ValueError(
                "train.packing=true needs build.attention=sdpa (Megatron's local attention cannot separate packed "
                "sequences) or TransformerEngine; set train.packing=false to keep build.attention=local"
            )
        rate = self.build.moe_router_bias_update_rate
        if self.train.freeze_router and rate > 0:
            raise ValueError(
                f"train.freeze_router=true with build.moe_router_bias_update_rate={rate}: the expert bias update would "
                "still move every expert's bias after each step, and with it which experts a token goes to; set "
                "build.moe_router_bias_update_rate=0 to freeze the routing, or train.freeze_router=false"
            )
        self._validate_shared_expert_overlap()
        if self.parallel.context_parallel_size > 1:
            self._validate_context_parallel()
        if self.parallel.expert_model_parallel_size > 1:
            self._validate_expert_parallel()
        if self.train.micro_batch_tokens is not None:
            tp = self.parallel.tensor_model_parallel_size
            if self.train.micro_batch_tokens % tp:
                raise ValueError(
                    f"train.micro_batch_tokens={self.train.micro_batch_tokens} must divide by "
                    f"tensor_model_parallel_size={tp} (sequence parallelism splits it); round it up"
                )
        if self.scheduler.mode != "zero_step_off" and self.rollout.backend != "vllm" and self.loss.kind != "sft":
            raise ValueError(
                f"scheduler.mode={self.scheduler.mode} samples while the trainer trains, which needs rollouts outside "
                "the trainer's ranks: set rollout.backend=vllm, or scheduler.mode=zero_step_off with the built-in sampler"
            )
        if not self.teachers:
            self._validate_staleness_correction()
        if self.optim.lag_lr_target and self.loss.kind == "sft":
            raise ValueError(
                f"optim.lag_lr_target={self.optim.lag_lr_target} shortens the steps of stale rollouts by their policy "
                "lag, but loss.kind=sft trains on the records' responses (no rollouts, no lag); unset "
                "optim.lag_lr_target"
            )
        if self.scheduler.sync_delay < 0 or (
            self.scheduler.sync_delay
            and (self.scheduler.mode != "zero_step_off" or self.rollout.backend != "builtin" or self.loss.kind == "sft")
        ):
            raise ValueError(
                f"scheduler.sync_delay={self.scheduler.sync_delay} (a debug delay of the weight sync) applies to "
                "distillation with scheduler.mode=zero_step_off and rollout.backend=builtin, as a number >= 0; set "
                "scheduler.sync_delay=0 or use those settings"
            )
        if self.rollout.routing_replay:
            self._validate_routing_replay()
        if self.student.lora.enabled:
            self._validate_lora()
        pp = self.parallel.pipeline_model_parallel_size
        if self.rollout.backend == "builtin" and self.loss.kind != "sft" and pp > 1:
            raise ValueError(
                f"the built-in sampler (rollout.backend=builtin) needs pipeline_model_parallel_size=1 (got {pp}); "
                "use rollout.backend=vllm to sample from a pipeline-parallel student"
            )
        if self.rollout.vllm_sleep and self.scheduler.mode != "zero_step_off":
            raise ValueError(
                f"rollout.vllm_sleep frees the engine's memory while the trainer trains, but scheduler.mode="
                f"{self.scheduler.mode} keeps a rollout running then: use scheduler.mode=zero_step_off or "
                "rollout.vllm_sleep=false"
            )
