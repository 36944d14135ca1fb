"""A Mixture-of-Experts layer without host syncs and with fewer operators (``build.moe_fused_routing``).

Megatron-Core's local MoE path (no TransformerEngine) builds dense ``[tokens, experts]`` probability and routing
maps, permutes tokens with ``masked_select`` and copies the tokens per expert to the host: three host syncs and about
thirty operators per layer and forward, which leave a GPU idle between tiny kernels (issue #57). Here the router
keeps each token's top-k experts as ``[tokens, k]`` indices (:mod:`.routing`), the tokens are permuted by one
stable sort (:mod:`.permutation`), and :class:`.layer.FusedMoELayer` runs them through the same experts, the same
numbers, with no sync. The gather into expert order, the experts' SwiGLU times the routing probability and the
combine (with the shared expert and its gate) are custom operators (:mod:`.ops`), one Triton kernel each on CUDA:
a Qwen3-MoE layer launches 9 operators forward where Megatron's launched 29.
"""
