"""Worker side, after a weight update: prepare the new expert weights for vLLM's CPU fused-MoE kernel.

vLLM's unquantized fused-MoE method prepares the expert weights for its kernel once, when the model is loaded: on
CPU the experts class pads the intermediate size and prepacks ``w13``/``w2`` into its grouped-GEMM layout
(``process_weights_after_loading`` of ``fused_moe/experts/cpu_moe.py``). On a weight update vLLM 0.32 copies the
reloaded weights into the kernel's storage and skips that step (``_setup_kernel``'s ``is_weight_update``), so the
kernel multiplies checkpoint-layout weights as if prepacked: a Qwen3-MoE model reloaded with its own unchanged
experts samples with 0.007-0.04 mean log-prob error (``tests/test_moe_router.py`` pins it). Running the experts'
own preparation again, on the values the update loaded, gives what a fresh load gives. Kernels that prepare nothing
there (vLLM's GPU experts) are left alone.
"""

from __future__ import annotations

import torch

CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def cpu_fused_expert_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(layer, its fused-experts object) for every MoE layer of ``model`` whose kernel is vLLM's CPU one."""
    out = []
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__ == CPU_EXPERTS_MODULE:
            out.append((layer, experts))
    return out


@torch.no_grad()
def prepare_cpu_experts(model: torch.nn.Module) -> int:
    """Prepare the reloaded expert weights of every CPU fused-MoE layer (see the module docstring); returns how many
    layers were."""
    layers = cpu_fused_expert_layers(model)
    for layer, experts in layers:
        experts.process_weights_after_loading(layer)
    return len(layers)
