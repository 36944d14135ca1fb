"""Upcycle a dense Qwen3 checkpoint into a Qwen3-MoE one: every expert a copy of the layer's MLP, a random router.

    python tools/upcycle_moe.py DENSE_DIR OUT_DIR [--experts 4] [--top-k 2]

Sparse upcycling (Komatsuzaki et al., 2022): attention, norms and embeddings are copied, each of the ``--experts``
experts of a layer is that layer's MLP, and the router is drawn small (normal, ``--router-std``). With the top-k
probabilities renormalised (``norm_topk_prob``) the new model computes exactly the dense one's logits, whatever the
router says; training then moves the experts apart. The quick start's ``--moe`` starts its MoE student so.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

_NOT_COPIED = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def upcycle_to_moe(
    dense_dir: str | Path,
    out_dir: str | Path,
    experts: int = 4,
    top_k: int = 2,
    router_std: float = 0.02,
    seed: int = 0,
) -> Path:
    """Write the Qwen3-MoE upcycling of the Qwen3 model at ``dense_dir`` (a Hugging Face folder) to ``out_dir``."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    if dense.config.model_type != "qwen3":
        raise ValueError(f"{dense_dir}: upcycling reads a qwen3 model, got model_type={dense.config.model_type!r}")
    fields = {k: v for k, v in dense.config.to_dict().items() if k not in ("model_type", "architectures", "dtype")}
    config = Qwen3MoeConfig(**{**fields, "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                               "moe_intermediate_size": dense.config.intermediate_size, "decoder_sparse_step": 1,
                               "mlp_only_layers": []})  # fmt: skip
    moe = AutoModelForCausalLM.from_config(config).float()
    weights = dense.state_dict()
    generator = torch.Generator().manual_seed(seed)
    upcycled = {name: weights[name] for name in moe.state_dict() if name in weights}
    for layer in range(config.num_hidden_layers):
        mlp = f"model.layers.{layer}.mlp."
        gate, up, down = (weights[f"{mlp}{p}_proj.weight"] for p in ("gate", "up", "down"))
        upcycled[f"{mlp}experts.gate_up_proj"] = torch.cat([gate, up]).expand(experts, -1, -1).clone()
        upcycled[f"{mlp}experts.down_proj"] = down.expand(experts, -1, -1).clone()
        upcycled[f"{mlp}gate.weight"] = torch.randn(experts, config.hidden_size, generator=generator) * router_std
    moe.load_state_dict(upcycled, strict=True)
    moe.generation_config = dense.generation_config
    out = Path(out_dir)
    moe.save_pretrained(out, safe_serialization=True)
    for f in Path(dense_dir).iterdir():  # the tokenizer's files
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.startswith("model-"):
            shutil.copy2(f, out / f.name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dense_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--router-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = upcycle_to_moe(args.dense_dir, args.out_dir, args.experts, args.top_k, args.router_std, args.seed)
    print(f"wrote {out}: {args.experts} experts (top-{args.top_k}) per layer upcycled from {args.dense_dir}")


if __name__ == "__main__":
    main()
