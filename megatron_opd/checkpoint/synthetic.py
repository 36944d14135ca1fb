"""Large random Hugging Face checkpoints for memory tests and conversion benchmarks.

Written directly with safetensors, shard by shard (never through transformers), so making a
several-GB model needs one shard of memory. The config is a plain Llama ``config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_opd.dtypes import dtype_name
from megatron_opd.models.families import llama
from megatron_opd.models.hf_io import HFCheckpointWriter


@dataclass(frozen=True)
class SyntheticLlama:
    """Shape of a synthetic Llama model (defaults: ~2.6 GB in float32, largest tensor 33.5 MB)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    vocab_size: int = 8000
    tie_word_embeddings: bool = False

    def config(self, dtype: torch.dtype) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": llama.FAMILY.model_types[0],
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": dtype_name(dtype),
            **asdict(self),
        }

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in the order transformers saves them."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        d = h // self.num_attention_heads
        kv = self.num_key_value_heads * d
        out = [("model.embed_tokens.weight", (v, h))]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (h, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, h)),
                (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.mlp.gate_proj.weight", (f, h)),
                (f"{p}.mlp.up_proj.weight", (f, h)),
                (f"{p}.mlp.down_proj.weight", (h, f)),
            ]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (v, h)))
        return out

    def nbytes(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(torch.Size(shape).numel() * size for _, shape in self.tensors())


def write_synthetic_llama(
    out_dir: str | os.PathLike,
    shape: SyntheticLlama | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 256 * 2**20,
    seed: int = 0,
) -> Path:
    """Write ``config.json`` and random safetensors shards of at most ``max_shard_bytes``; return the folder."""
    shape = shape or SyntheticLlama()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w") as f:
        json.dump(shape.config(dtype), f, indent=2)
    generator = torch.Generator().manual_seed(seed)
    writer = HFCheckpointWriter(out, max_shard_bytes=max_shard_bytes)
    for name, tensor_shape in shape.tensors():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(tensor_shape, generator=generator)
        else:
            tensor = 0.02 * torch.randn(tensor_shape, generator=generator)
        writer.add(name, tensor.to(dtype))
    writer.close()
    return out
