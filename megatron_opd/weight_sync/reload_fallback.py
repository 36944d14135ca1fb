"""The fallback where vLLM has no weight-transfer API: ``collective_rpc`` into a worker extension that feeds the
received buckets to vLLM's own ``reload_weights`` (checkpoint format, so it runs the layerwise reload too).

Never a direct write into parameters: on vLLM CPU that is a silent no-op (linear weights are repacked for its
kernels). The wire is the same gloo transport as the weight-transfer engine; ``rollout.vllm_weight_sync=reload``
forces this path so it is tested where the API exists. Enable it with
``worker_extension_cls="megatron_opd.weight_sync.reload_fallback.ReloadWorkerExtension"``.
"""

from __future__ import annotations

from collections.abc import Iterator

from megatron_opd.weight_sync.attention_sinks import keep_sinks, load_sinks
from megatron_opd.weight_sync.fused_experts import prepare_cpu_experts
from megatron_opd.weight_sync.partial import unsent_layers_quiet
from megatron_opd.weight_sync.tied import refresh_shared_layers
from megatron_opd.weight_sync.transport import (
    GlooInitInfo,
    GlooUpdateInfo,
    open_gloo_group,
    receive_buckets,
    worker_rank,
)


class ReloadWorkerExtension:
    """Methods mixed into every vLLM worker (``collective_rpc("opd_reload_...")``)."""

    def opd_reload_init(self, init_info: dict) -> None:
        info = GlooInitInfo(**init_info)
        self._opd_bucket_bytes = info.bucket_bytes
        rank = worker_rank(self.vllm_config.parallel_config, info.rank_offset)
        self._opd_group = open_gloo_group(info.master_address, info.master_port, rank, info.world_size, info.timeout_s)

    def opd_reload_weights(self, update_info: dict) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        info = GlooUpdateInfo(**update_info)
        buckets = receive_buckets(self._opd_group, info, self._opd_bucket_bytes)

        def weights() -> Iterator:
            for pairs in buckets:
                yield from pairs

        sinks: dict = {}
        try:  # a partial update (LoRA): vLLM's warnings about the layers left as they are silenced
            with unsent_layers_quiet(info.partial):
                self.reload_weights(weights_iterator=keep_sinks(weights(), sinks), is_checkpoint_format=True)
        except BaseException:
            buckets.close()
            raise
        model = self.model_runner.get_model()
        refresh_shared_layers(model)  # a tied lm_head (megatron_opd.weight_sync.tied)
        prepare_cpu_experts(model)  # CPU fused-MoE experts (weight_sync.fused_experts)
        load_sinks(model, sinks, get_tensor_model_parallel_rank())  # gpt-oss (weight_sync.attention_sinks)
