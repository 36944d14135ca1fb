"""Sparse upcycling (Komatsuzaki et al., 2022): a dense checkpoint made a Mixture-of-Experts one whose every expert
is a copy of its layer's MLP and whose router is drawn small. With the top-k probabilities renormalised, the new model
computes exactly the dense one's logits whatever the router says; training then moves the experts apart.

Family-agnostic: the MoE family that declares the dense ``model_type`` in ``upcycles_from`` gives the new
``config.json`` (``upcycle_config``) and its experts' checkpoint names (``expert_names``); the dense MLP's tensors
are found through the dense family's weight rules. ``tools/upcycle_moe.py`` is its command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

_WRITTEN = ("config.json", "model.safetensors", "model.safetensors.index.json")


def upcycle_family(model_type: str):
    """The MoE family that upcycles ``model_type`` checkpoints; ValueError naming the ones that can be."""
    from megatron_opd.models.families import FAMILIES

    for family in FAMILIES.values():
        if model_type in getattr(family, "upcycles_from", ()):
            return family
    known = sorted(t for f in FAMILIES.values() for t in getattr(f, "upcycles_from", ()))
    raise ValueError(f"no Mixture-of-Experts family upcycles model_type={model_type!r}; upcycling reads {known}")


def upcycle_to_moe(
    dense_dir: str | Path,
    out_dir: str | Path,
    experts: int = 4,
    top_k: int = 2,
    router_std: float = 0.02,
    seed: int = 0,
) -> Path:
    """Write the upcycling of the Hugging Face model at ``dense_dir`` (``experts`` per layer, top-``top_k``) to
    ``out_dir``, with the dense folder's tokenizer and generation files."""
    from safetensors.torch import load_file, save_file

    from megatron_opd.models.hf_config import load_architecture
    from megatron_opd.models.name_mapping import expand_rules

    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    dense_dir, out = Path(dense_dir), Path(out_dir)
    config = json.loads((dense_dir / "config.json").read_text())
    family = upcycle_family(config.get("model_type"))
    arch = load_architecture(dense_dir)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(dense_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    mlp = {rule.megatron_name(layer): rule.hf_names(layer) for rule, layer in expand_rules(arch) if layer is not None}
    names, generator = family.expert_names, torch.Generator().manual_seed(seed)
    for layer in range(arch.num_layers):
        gate, up = (weights.pop(n) for n in mlp[f"decoder.layers.{layer}.mlp.linear_fc1.weight"])
        (down,) = (weights.pop(n) for n in mlp[f"decoder.layers.{layer}.mlp.linear_fc2.weight"])
        for expert in range(experts):
            for pattern, tensor in ((names.gate, gate), (names.up, up), (names.down, down)):
                weights[pattern.format(layer=layer, expert=expert)] = tensor.clone()
        router = torch.randn(experts, arch.hidden_size, generator=generator) * router_std
        weights[names.router.format(layer=layer)] = router.to(gate.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(family.upcycle_config(config, experts, top_k), indent=2))
    for f in dense_dir.iterdir():  # the tokenizer's and generation files
        if f.is_file() and f.name not in _WRITTEN and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    return out
