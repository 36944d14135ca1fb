"""References to check Megatron models and converted checkpoints against: transformers' logits, full tensors."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def hf_model(hf_dir: str | os.PathLike, **kwargs):
    """transformers' model of ``hf_dir`` (``from_pretrained`` ``kwargs``), on its eager attention where the config
    soft-caps attention scores (Gemma 2's ``attn_logit_softcapping``): transformers' SDPA path drops the cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if getattr(AutoConfig.from_pretrained(hf_dir), "attn_logit_softcapping", None) is not None:
        kwargs.setdefault("attn_implementation", "eager")
    return AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)


def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """Reference logits ``[b, s, V]`` from transformers' own forward in float32."""
    model = hf_model(hf_dir).float().eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def full_tensors(chunks: list, arch, group, of: str | Callable = "data", expert_group=None) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters (``of="data"``), gradients (``of="grad"``) or any tensor shaped like each
    parameter (``of``: a function of the parameter, e.g. its Adam moment), unsharded, by global Megatron name
    (layer indices across all stages; this expert-parallel rank's experts by global index): a collective over
    the tensor-parallel ``group`` (and ``expert_group``, the expert tensor-parallel one, default ``group``)."""
    from megatron_opd.distributed.gather import gather_tp_shards
    from megatron_opd.models.loading import chunk_layer_range
    from megatron_opd.models.name_mapping import global_expert_names, global_layer_name, rules_by_megatron_name, unshard

    rules = rules_by_megatron_name(arch)
    out = {}
    for chunk in chunks:
        offset = chunk_layer_range(chunk).start
        experts = global_expert_names(chunk)
        for local_name, param in chunk.named_parameters():
            name = global_layer_name(experts.get(local_name, local_name), offset)
            local = of(param) if callable(of) else getattr(param, of)
            tp_group = expert_group if local_name in experts and expert_group is not None else group
            out[name] = unshard(rules[name], gather_tp_shards(local, tp_group)).clone()
    return out
