"""Launch layer: accelerator detection, torchrun environment, Megatron-Core parallel groups."""

from megatron_opd.distributed.device import Accelerator, detect_accelerator, has_transformer_engine
from megatron_opd.distributed.parallel import (
    LaunchEnv,
    ParallelConfig,
    destroy_distributed,
    init_process_group,
    initialize_distributed,
    initialize_model_parallel,
)

__all__ = [
    "Accelerator",
    "LaunchEnv",
    "ParallelConfig",
    "destroy_distributed",
    "detect_accelerator",
    "has_transformer_engine",
    "init_process_group",
    "initialize_distributed",
    "initialize_model_parallel",
]
