"""vLLM weight-transfer back end over gloo: the CPU stand-in for vLLM's NCCL engine, registered in vLLM's factories.

NCCL and CUDA IPC do not exist on CPU, so vLLM's own engines cannot run in our tests. This back end speaks the same
protocol (``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` ->
``finish_weight_update``) over :mod:`megatron_opd.weight_sync.transport`. The worker loads each bucket with
``model.load_weights`` inside vLLM's layerwise reload (``initialize_layerwise_reload`` /
``finalize_layerwise_reload``), exactly as vLLM's NCCL engine does, so CPU kernels that repack weights see the new
values (writing parameters directly is a silent no-op there); then layers sharing a parameter (a tied ``lm_head``)
are re-processed, which the layerwise reload does not do (:mod:`megatron_opd.weight_sync.tied`). A partial update
(a LoRA student's adapted layers) leaves the other layers as they are (:mod:`megatron_opd.weight_sync.partial`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)

from megatron_opd.weight_sync.attention_sinks import keep_sinks, load_sinks
from megatron_opd.weight_sync.buckets import DEFAULT_BUCKET_BYTES
from megatron_opd.weight_sync.fused_experts import prepare_cpu_experts
from megatron_opd.weight_sync.partial import check_complete_layers, unsent_layers_quiet
from megatron_opd.weight_sync.tied import refresh_shared_layers
from megatron_opd.weight_sync.transport import (
    GlooInitInfo,
    GlooSender,
    GlooUpdateInfo,
    open_gloo_group,
    receive_buckets,
    worker_rank,
)

BACKEND = "megatron_opd_gloo"
"""The name this back end is registered under in vLLM's engine factories (``WeightTransferConfig(backend=...)``)."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: receives packed buckets over gloo and loads them through vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.partial = False  # the update under way sends only the layers that changed

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.bucket_bytes = init_info.bucket_bytes
        rank = worker_rank(self.parallel_config, init_info.rank_offset)
        self.group = open_gloo_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.partial = False
        self._sinks: dict = {}

    def finish_weight_update(self) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.partial:
            check_complete_layers(self.model)
        with unsent_layers_quiet(self.partial):
            finalize_layerwise_reload(self.model, self.model_config)
        refresh_shared_layers(self.model)  # a tied lm_head's packed kernel (megatron_opd.weight_sync.tied)
        prepare_cpu_experts(self.model)  # fused-MoE experts on CPU (megatron_opd.weight_sync.fused_experts)
        load_sinks(self.model, self._sinks, get_tensor_model_parallel_rank())  # gpt-oss (weight_sync.attention_sinks)
        self._sinks = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(): nothing to wait for on a gloo receive.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        self.partial = update_info.partial
        buckets = receive_buckets(self.group, update_info, self.bucket_bytes)
        try:
            for pairs in buckets:
                self.model.load_weights(keep_sinks(pairs, self._sinks))
        except BaseException:
            buckets.close()
            raise

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. ``world_size`` counts the sender and every vLLM worker; ``rank`` is the trainer
    rank (0 sends, every other rank only takes part in the weight source's gathers)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(GlooSender, TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side, built by ``WeightTransferTrainerFactory.trainer_init`` on every trainer rank."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
        )
        if engine.is_sender:
            engine.connect(init_info.master_address, init_info.master_port, init_info.world_size)
        return engine
