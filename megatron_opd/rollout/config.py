"""``rollout.*``: how the student samples its responses (a section of ``trainer.config.TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RolloutConfig:
    """How the student samples its responses."""

    backend: Literal["builtin", "vllm"] = "builtin"
    """``builtin``: the tensor-parallel sampler on the student's own GPTModel (KV cache, no vocabulary gather).
    ``vllm``: a vLLM engine in a process started by rank 0, weights synced after every step (needs vLLM)."""
    n: int = 1
    """Samples per prompt."""
    max_new_tokens: int = 64
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0: off)."""
    top_k: int = 0
    """Sample among the k most probable tokens (0: off)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop ids, beside the tokenizer's EOS and every EOS id of generation_config.json."""
    weight_sync: Literal["transfer_api", "reload"] = "transfer_api"
    """``backend=vllm``: vLLM's weight-transfer API (gloo engine on CPU), or ``reload``: collective_rpc +
    reload_weights (used automatically where vLLM lacks that API; set it to run the fallback anyway)."""
    weight_transfer_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``backend=vllm``, ``weight_sync=transfer_api``: vLLM's NCCL engine (GPU) or our gloo engine (CPU; also
    GPU, through host memory); auto: NCCL when the student is on CUDA. Servers must be started with the same."""
    sync_bucket_mb: float = 512.0
    """``backend=vllm``: size of the packed buckets the weights travel in (MiB); the sender holds one at a time."""
    address: str = ""
    """``backend=vllm``: ``host:port[,host:port]`` of separate vLLM servers (``python -m
    megatron_opd.rollout.vllm_server``) instead of an engine process started by rank 0."""
    server_wait_s: float = 60.0
    """``backend=vllm`` with ``address``: seconds to wait for a server to answer, at the start (servers still
    loading) and whenever every server is down; servers that do not answer are left out until they are back."""
    sync_address: str = "127.0.0.1"
    """``backend=vllm``: address of this job's rank 0 that the vLLM workers join for weight syncs."""
    sync_timeout_s: float = 600.0
    """``backend=vllm``: seconds a sync, or the engine's start, may take before it is an error."""
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``backend=vllm``: dtype of vLLM's weights and of the sync (auto: the student's parameter dtype)."""
    vllm_cpu_kv_cache_gib: int = 1
    """``backend=vllm`` on CPU: KV cache size of the engine (GiB)."""
    vllm_gpu_memory_utilization: float = 0.3
    """``backend=vllm`` on GPU: fraction of the GPU vLLM may take (colocated with training)."""
    vllm_sleep: bool = False
    """``backend=vllm`` on GPU: the engine sleeps (frees weights and KV cache) while the trainer trains."""
    vllm_threads: int = 1
    """``backend=vllm`` on CPU: torch threads of the engine process."""
    tool_fn: str | None = None
    """Multi-turn tool rollouts: ``module:function(call_text) -> str`` answering a tool call (e.g.
    ``megatron_opd.tasks.calculator:calculate``); its tokens get response mask 0 and are never trained on."""
    tool_stop: str = "</calc>"
    """With ``tool_fn``: the text that ends a tool call (the model's turn is cut right after it)."""
    max_turns: int = 4
    """With ``tool_fn``: model turns per sample (a call in the last turn gets no answer)."""
    routing_replay: bool = False
    """Mixture-of-Experts students: the sampler records the experts it routed each token to, per MoE layer, and the
    trainer's forward routes each token to those (weighted by its own router's scores); logs ``moe/route_mismatch``,
    the share of (token, layer) routings where the trainer's own choice differs. The teacher routes on its own."""
    startup_check: bool = True
    """``backend=vllm``: after the first weight sync, score a fixed sequence in the engine (and in every server) and
    in the trainer, and refuse to start when they differ by more than ``max_logprob_diff`` (``rollout.fidelity``)."""
    max_logprob_diff: float | None = None
    """Largest mean |log p_trainer - log p_sampler| per sampled token before a step is refused (the run stops before
    the update; asynchronous modes check batches of staleness 0 only). Default: 1e-3 when trainer and sampler are
    fp32, 0.1 otherwise (see ``rollout.fidelity.MAX_LOGPROB_DIFF_DEFAULTS``); ``inf`` logs without stopping."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if self.max_logprob_diff is not None and not self.max_logprob_diff > 0:
            raise ValueError(
                f"rollout.max_logprob_diff must be > 0 (inf: never stop), got {self.max_logprob_diff}; leave it unset "
                "for the per-dtype default"
            )
        if not self.sync_bucket_mb > 0:
            raise ValueError(f"rollout.sync_bucket_mb must be > 0, got {self.sync_bucket_mb}")
        if not self.sync_timeout_s > 0:
            raise ValueError(f"rollout.sync_timeout_s must be > 0, got {self.sync_timeout_s}")
        if self.max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {self.max_turns}")
        if self.address and self.backend != "vllm":
            raise ValueError("rollout.address names vLLM servers: set rollout.backend=vllm (or drop rollout.address)")
        if self.tool_fn is not None and not self.tool_stop:
            raise ValueError("rollout.tool_stop must be the non-empty text that ends a tool call (e.g. </calc>)")
