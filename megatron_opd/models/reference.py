"""Reference logits from transformers' own forward, to check Megatron models and converted checkpoints against."""

from __future__ import annotations

import os

import torch


def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """Reference logits ``[b, s, V]`` from transformers' own forward in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()
