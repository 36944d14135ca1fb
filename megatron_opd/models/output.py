"""Final hidden states instead of logits from a GPTModel, switched on per call (the fused output-layer loss).

Inside ``HiddenStateOutput(chunks).active()`` the last pipeline stage's output layer does not multiply: it returns
the final hidden states, full sequence, in the layout its matmul would have read (with sequence parallelism
gathered from the TP ranks; either way through Megatron's region functions, so the backward reduces the hidden-state
gradient over TP exactly as the output layer's own backward does), and remembers the weight it was handed (the
shared embedding weight when tied). The model then returns ``[b, s, H]`` where it returned ``[b, s, V/TP]``; the
fused loss (``losses.fused_output``) forms the logits chunk by chunk from the two. Outside the block the model is
untouched: the built-in sampler, the evaluation and SFT keep getting logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def output_weight_of(chunk) -> torch.Tensor:
    """The ``[V/TP, H]`` weight shard a last-stage chunk's output layer multiplies by (the shared embedding weight
    when tied)."""
    model = _unwrap(chunk)
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight  # (shared_embedding_or_output_weight returns the embedding on a first stage)


class HiddenStateOutput:
    """The per-call switch over one model's chunks; ``weight`` is the output weight of the last forward."""

    def __init__(self, chunks: list) -> None:
        self.layers = [
            model.output_layer
            for model in map(_unwrap, chunks)
            if getattr(model, "post_process", False) and getattr(model, "output_layer", None) is not None
        ]
        self.weight: torch.Tensor | None = None
        caps = {getattr(layer, "final_logit_softcapping", None) for layer in self.layers}
        self.final_logit_softcapping = next(iter(caps - {None}), None)

    @property
    def exact(self) -> bool:
        """Whether ``h @ W^T`` are the model's logits; not with soft-capped final logits (Gemma 2), whose callers
        take the output layer's logits instead (the fused loss falls back, the in-process teacher scores shards)."""
        return self.final_logit_softcapping is None

    @contextmanager
    def active(self) -> Iterator[HiddenStateOutput]:
        """Within the block the output layers return hidden states (restored on the way out, also on errors)."""
        if not self.exact:
            raise ValueError(
                f"this model's final logits are soft-capped (config.json final_logit_softcapping="
                f"{self.final_logit_softcapping}): its hidden states times the output weight are not its logits; "
                "set loss.fused_output=off (and teacher.transfer=topk)"
            )
        for layer in self.layers:
            layer.forward = lambda input_, weight=None, runtime_gather_output=None, layer=layer: self._hidden(
                layer, input_, weight
            )
        try:
            yield self
        finally:
            for layer in self.layers:
                del layer.forward  # the class's forward again

    def _hidden(self, layer, input_SBH: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        self.weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:  # the matmul's input all-gather; its backward is a reduce-scatter
            hidden_SBH = gather_from_sequence_parallel_region(input_SBH, tensor_parallel_output_grad=True)
        else:
            hidden_SBH = copy_to_tensor_model_parallel_region(input_SBH)  # backward: all-reduce over TP
        return _ContiguousGrad.apply(hidden_SBH), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. GPTModel transposes its output to ``[b, s, H]``, so
    the gradient reaching the region function is a transposed view; Megatron's all-reduce of it works on a
    ``.contiguous()`` copy and returns the unreduced original (found by ``tests/test_fused_output.py``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
