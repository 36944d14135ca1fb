"""Start torch.distributed from torchrun's environment and lay out Megatron-Core's parallel groups.

This is set-up code: it is the one place that calls ``parallel_state.initialize_model_parallel``.
Library code below it takes process groups as arguments.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_opd.distributed.device import Accelerator, detect_accelerator

logger = logging.getLogger(__name__)


@dataclass
class ParallelConfig:
    """How one model is split across processes."""

    tensor_model_parallel_size: int = 1
    """Ranks that split every weight matrix (and the vocabulary) of a layer."""
    pipeline_model_parallel_size: int = 1
    """Ranks that each hold a contiguous slice of the layers."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank for the interleaved schedule (None: not interleaved)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first pipeline stage when the layers do not split evenly (DeepSeek-V3's 61); the other stages
    share the rest equally. None: an even split (Megatron's option of the same name)."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last pipeline stage when the layers do not split evenly (e.g. fewer beside the output layer).
    None: an even split."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in the non-tensor-parallel regions (needs TP > 1)."""
    context_parallel_size: int = 1
    """Ranks that split the sequence inside attention."""
    expert_model_parallel_size: int = 1
    """Mixture-of-Experts models: ranks that split each MoE layer's experts (each holds experts / EP of them and
    receives their tokens); taken from the data-parallel ranks (times TP / ETP), so it must divide
    world / (PP * expert_tensor_parallel_size). Dense layers are unaffected."""
    expert_tensor_parallel_size: int | None = None
    """Mixture-of-Experts models: ranks that split each expert's matrices; null: the tensor-parallel size
    (Megatron's default). 1 with TP > 1 keeps experts whole and uses those ranks for more expert parallelism."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_model_parallel_size < 1:
            raise ValueError(f"parallel.expert_model_parallel_size must be >= 1, got {self.expert_model_parallel_size}")
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp < 1:
            raise ValueError(f"parallel.expert_tensor_parallel_size must be >= 1 or null (= TP), got {etp}")
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None and vp < 1:
            raise ValueError(f"parallel.virtual_pipeline_model_parallel_size must be >= 1 or null, got {vp}")
        if vp is not None and vp > 1 and self.pipeline_model_parallel_size < 2:
            raise ValueError(
                "parallel.virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size >= 2"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is not None and (value < 1 or self.pipeline_model_parallel_size < 2):
                raise ValueError(
                    f"parallel.{name}={value}: needs a positive number of layers and pipeline_model_parallel_size >= 2 "
                    "(null: an even split)"
                )

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size in effect (the tensor-parallel size unless set)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def vp_size(self) -> int:
        """Model chunks per pipeline rank (1 when not interleaved)."""
        return self.virtual_pipeline_model_parallel_size or 1

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage (all its virtual chunks): the set first and last stages', the rest split
        equally over the others (Megatron's rule); a ValueError naming the fields when they do not split."""
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        pp, vp = self.pipeline_model_parallel_size, self.vp_size
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if first is None and last is None and num_layers % (pp * vp):
            raise ValueError(
                f"num_hidden_layers={num_layers} is not divisible by pipeline_model_parallel_size * "
                f"virtual_pipeline_model_parallel_size = {pp * vp}; choose sizes whose product divides the layer count "
                "(or set parallel.num_layers_in_first/last_pipeline_stage)"
            )
        if (
            rest < 0
            or (middle == 0 and rest)
            or (middle and rest % (middle * vp))
            or (first or 0) % vp
            or (last or 0) % vp
        ):
            raise ValueError(
                f"num_hidden_layers={num_layers} does not split as parallel.num_layers_in_first_pipeline_stage="
                f"{first}, num_layers_in_last_pipeline_stage={last} and {middle} stage(s) between of equal layers "
                f"(pipeline_model_parallel_size={pp}, each stage's layers divisible by virtual size {vp}); choose "
                "others"
            )
        between = [rest // middle] * middle if middle else []
        return ([first] if first is not None else []) + between + ([last] if last is not None else [])

    def stage_layer_indices(self, num_layers: int) -> list[tuple[int, ...]]:
        """Global indices of each pipeline stage's layers, all its virtual chunks: chunk ``v`` of every stage in turn
        (stage 0's, stage 1's, ...) before chunk ``v + 1``, each stage's chunks equal (Megatron's layer offsets)."""
        counts, vp = self.stage_layers(num_layers), self.vp_size
        stages: list[list[int]] = [[] for _ in counts]
        start = 0
        for _ in range(vp):
            for stage, count in enumerate(counts):
                stages[stage].extend(range(start, start + count // vp))
                start += count // vp
        return [tuple(layers) for layers in stages]


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (single- or multi-node) tells each process about itself."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (single-process defaults)."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )


def init_process_group(device: str | None = None, timeout_s: float = 600.0) -> Accelerator:
    """Initialise ``torch.distributed`` for this process (idempotent) and bind its device."""
    accel = detect_accelerator(device)
    launch = LaunchEnv.from_environ()
    accel.set_device(launch.local_rank)
    if accel.type == "cpu":
        from megatron_opd.distributed.cpu_compat import apply_cpu_patches

        apply_cpu_patches()
    elif accel.type == "npu":
        # MindSpeed adapts Megatron-Core to Ascend (fused kernels, HCCL); it must patch before models are built.
        import importlib.util

        if importlib.util.find_spec("mindspeed") is not None:
            import mindspeed.megatron_adaptor  # noqa: F401
        else:
            logger.warning("torch_npu found but MindSpeed is not installed; Megatron-Core runs unadapted on NPU")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(
            backend=accel.backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return accel


def initialize_model_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """(Re)build Megatron-Core's TP/PP/VP/DP groups for ``parallel`` and seed the model-parallel RNG.

    The data-parallel size is whatever is left: ``world_size / (TP * PP * CP)``.
    """
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % parallel.model_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by TP*PP*CP = {parallel.tensor_model_parallel_size}"
            f"*{parallel.pipeline_model_parallel_size}*{parallel.context_parallel_size}; "
            "launch a multiple of that many processes or change parallel.*_size"
        )
    expert_ranks = parallel.expert_model_parallel_size * parallel.etp_size * parallel.pipeline_model_parallel_size
    if world % expert_ranks:
        raise ValueError(
            f"world size {world} is not divisible by EP*ETP*PP = {parallel.expert_model_parallel_size}"
            f"*{parallel.etp_size}*{parallel.pipeline_model_parallel_size}; change parallel.expert_model_parallel_size "
            "or parallel.expert_tensor_parallel_size (or launch a multiple of that many processes)"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    vp = parallel.virtual_pipeline_model_parallel_size
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
    )
    seed_rng(seed)
    logger.info(
        "model parallel: TP=%d PP=%d VP=%s CP=%d DP=%d EP=%d ETP=%d",
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        vp,
        parallel.context_parallel_size,
        parallel_state.get_data_parallel_world_size(),
        parallel.expert_model_parallel_size,
        parallel.etp_size,
    )


def seed_rng(seed: int) -> None:
    """Seed every random stream of this rank: the default generator and Megatron's tracker (tensor-parallel
    streams offset by the rank). Needs the parallel groups."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)


def initialize_distributed(parallel: ParallelConfig, device: str | None = None, seed: int = 1234) -> Accelerator:
    """Everything a torchrun entry point needs: process group, device, CPU patches, Megatron groups."""
    accel = init_process_group(device)
    initialize_model_parallel(parallel, seed=seed)
    return accel


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the process group (end of a job or a test)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
