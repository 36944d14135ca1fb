"""Load a Hugging Face checkpoint into this rank's Megatron-Core model chunks.

Each rank reads only the tensors of its own pipeline stages and keeps only its tensor-parallel
slice, one tensor at a time, so a rank's peak memory is its shard plus one full tensor. FP8 block-quantised
tensors are dequantised to the model's dtype as they are read; multi-token-prediction layers are skipped
(:mod:`megatron_opd.models.mtp`, one log line).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.hf_io import CheckpointError, HFCheckpointReader
from megatron_opd.models.mtp import skipped_mtp_message
from megatron_opd.models.name_mapping import (
    ExpertSplit,
    expand_rules,
    global_expert_names,
    hf_shapes,
    hf_to_megatron,
    local_layer_name,
    named_tensors,
    shard,
)

logger = logging.getLogger(__name__)


def chunk_layer_range(chunk) -> range:
    """Global indices of the transformer layers held by one model chunk."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_local = len(chunk.decoder.layers) if hasattr(chunk, "decoder") else 0
    offset = get_transformer_layer_offset(chunk.config, vp_stage=getattr(chunk, "vp_stage", None))
    return range(offset, offset + num_local)


@torch.no_grad()
def load_hf_weights(
    chunks: list,
    arch: ModelArchitecture,
    hf_dir: str | os.PathLike,
    *,
    tp_rank: int,
    tp_size: int,
    expert_tp_rank: int | None = None,
    expert_tp_size: int | None = None,
    te: bool | None = None,
) -> None:
    """Copy the Hugging Face weights in ``hf_dir`` into ``chunks`` (this rank's model chunks).

    Mixture-of-Experts layers: only this rank's experts are read (each expert module knows its global indices),
    split over ``expert_tp_size`` ranks (default: the tensor-parallel ones). Raises ``CheckpointError`` naming the
    tensor when it is missing or has the wrong shape, and when a model parameter is left without a weight.
    ``te=None`` detects the TransformerEngine layer spec from the parameter names (its norms are fused into the
    linear layers).
    """
    model_dtype = next((p.dtype for c in chunks for p in c.parameters()), torch.float32)
    reader = HFCheckpointReader(hf_dir, dequantize_dtype=model_dtype)
    skipped = skipped_mtp_message(reader, arch.num_layers)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info(skipped)
    for chunk in chunks:
        layers = chunk_layer_range(chunk)
        # Rules name experts by global index; a rank's experts are numbered from 0 in the module.
        renamed = global_expert_names(chunk)
        params = {renamed.get(n, n): p for n, p in chunk.named_parameters()}
        targets = {renamed.get(n, n): t for n, t in named_tensors(chunk).items()}  # buffers too
        if te is None:
            te = any(name.endswith("layer_norm_weight") for name in params)
        padded_vocab = chunk.vocab_size
        loaded: set[str] = set()
        for rule, layer in expand_rules(arch, layers):
            name = local_layer_name(rule.megatron_name(layer, te=te), layers.start)
            target = targets.get(name)
            hf_names = rule.hf_names(layer)
            if target is None and name == "embedding.word_embeddings.weight" and arch.tie_word_embeddings:
                # Tied embeddings on a last stage without the embedding: the output layer holds the copy.
                target = targets.get("output_layer.weight")
                name = "output_layer.weight"
            if target is None:
                continue  # held by another pipeline stage (or, for an expert, another expert-parallel rank)
            shapes = hf_shapes(rule, arch)
            hf_tensors = [reader.get(n, s) for n, s in zip(hf_names, shapes)]
            full = hf_to_megatron(rule, hf_tensors, arch, padded_vocab)
            if rule.experts is ExpertSplit.PER_EXPERT and expert_tp_size is not None:
                local = shard(rule, full, expert_tp_rank, expert_tp_size)
            else:
                local = shard(rule, full, tp_rank, tp_size)
            if tuple(local.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"parameter {name} expects shape {tuple(target.shape)} on this rank but the checkpoint tensors "
                    f"{list(hf_names)} give {tuple(local.shape)}"
                )
            target.copy_(local.to(target.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"no checkpoint weight was loaded into model parameters {missing}")
