"""Worker side, after a weight update: refresh the kernels of layers that share a parameter with another layer.

A model with tied embeddings (Qwen3-0.6B/1.7B/4B, Qwen2.5-0.5B-3B, Llama-3.2-1B/3B) has one parameter held by two
vLLM layers, ``embed_tokens`` and ``lm_head``. A weight update sends it once, as ``model.embed_tokens.weight`` (the
model's ``load_weights`` skips ``lm_head.*`` when tied), so vLLM's layerwise reload loads and re-processes
``embed_tokens`` only, and puts ``lm_head``'s old tensors back untouched. The shared storage does hold the new
values, but a kernel that packed ``lm_head``'s weight when it was processed (vLLM's CPU GEMM dispatch: a oneDNN or
SGL handle over a copy of the weight) still computes with the old one: the sampler then draws from the new
transformer body and the *start-up* output layer. Re-running the layer's own ``process_weights_after_loading``
rebuilds that handle from the current values, exactly as a fresh load would.
"""

from __future__ import annotations

import torch


def shared_parameter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers holding (directly) a parameter that another layer also holds, e.g. a tied ``lm_head``."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(module)
    shared = {id(m): m for modules in holders.values() if len(modules) > 1 for m in modules}  # each layer once
    return list(shared.values())


@torch.no_grad()
def refresh_shared_layers(model: torch.nn.Module) -> int:
    """Re-process every layer that shares a parameter (see the module docstring); returns how many were."""
    refreshed = 0
    for layer in shared_parameter_layers(model):
        method = getattr(layer, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is not None:
            process(layer)
            refreshed += 1
    return refreshed
