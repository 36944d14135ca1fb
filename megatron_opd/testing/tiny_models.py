"""Tiny random checkpoints of every registered model family, made with transformers' own classes.

No model can be downloaded in tests or the quick start, so these build real Hugging Face
checkpoints (``save_pretrained``: config.json + safetensors) from transformers' config classes.
Head dim is 32 or more (vLLM's CPU attention needs that) and attention is grouped-query.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_opd.models.families import FAMILIES as _REGISTRY
from megatron_opd.models.families import family_named

FAMILIES = tuple(_REGISTRY)
"""Every registered family's name: each has a tiny test model."""


def tiny_hf_config(family: str, **overrides: Any):
    """A transformers config of ``family`` small enough to run in a test (~0.3M parameters): the common sizes
    below, then the family's ``tiny_config``, then ``overrides``."""
    from transformers import AutoConfig

    declared = family_named(family)
    common: dict[str, Any] = dict(
        vocab_size=1000,  # not a multiple of 128*TP: exercises vocabulary padding
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(declared.tiny_config)
    common.update(overrides)
    # A family reading several model types (Qwen3.5's dense and MoE text towers) builds any of them.
    model_type = common.pop("model_type", declared.model_types[0])
    return AutoConfig.for_model(model_type, **common)


def make_tiny_hf_model(family: str, out_dir: str | os.PathLike, seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialised tiny ``family`` model to ``out_dir`` and return the folder."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    # Random init leaves norms at 1 and biases at 0 (DeepSeek's expert bias buffer too); perturb them so a mapping
    # mistake cannot hide.
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(
                ("bias", "layer_scalar", "router.scale", "per_expert_scale")
            ):  # Gemma 4: ones too
                param.add_(torch.randn_like(param) * 0.1)
            elif param.is_floating_point() and not param.any():  # left at zero (ERNIE 4.5's router)
                param.normal_(0.0, 0.1)
            elif name.endswith("router.proj.weight"):  # Gemma 4: logits of a unit-RMS input / sqrt(hidden), ~0.02
                param.mul_(10.0)  # apart at init: near-ties within float32 noise; spread them as trained routers are
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


_CORPUS = (
    "On-policy distillation trains a small student on its own samples while a large teacher scores every token. "
    "The student samples a rollout, the teacher returns log-probabilities, and the loss is a divergence per token. "
    "Tensor parallelism splits every matrix; pipeline parallelism splits the layers; the vocabulary stays sharded. "
    "Forward KL covers the teacher's modes; reverse KL seeks them; the Jensen-Shannon divergence sits in between. "
)


def make_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1000, exact: bool = False) -> Path:
    """Train a byte-level BPE tokenizer locally and save it as a ``PreTrainedTokenizerFast``.

    Byte-level BPE can encode any text, so the tiny model never sees an unknown token. The corpus is small, so the
    tokenizer has fewer tokens than ``vocab_size`` (a model's padded embedding rows); ``exact=True`` pads it with
    ``<|extra_i|>`` tokens to exactly ``vocab_size``, for a server whose client checks every top-k id against the
    tokenizer. Below 259 tokens (the 256 bytes and three special tokens) the alphabet is then the corpus's own
    characters, and other characters are dropped.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=alphabet if not exact or vocab_size >= len(alphabet) + len(special) else [],
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=special[0], pad_token=special[0])
    if exact:
        fast.add_special_tokens(
            {"additional_special_tokens": [f"<|extra_{i}|>" for i in range(vocab_size - len(fast))]}
        )
        if len(fast) != vocab_size:
            raise ValueError(f"made a tokenizer of {len(fast)} tokens, not {vocab_size}")
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def routing_margin(hf_dir: str | os.PathLike, tokens: torch.Tensor) -> float:
    """The smallest gap, over ``tokens`` (``[..., s]``) and every MoE layer of the model at ``hf_dir``, between the
    k-th and (k+1)-th largest router logit (float64, transformers' own hidden states); ``inf`` for a dense model.

    An equality test of an MoE model checks arithmetic only where this margin is far above the float32 noise of
    the router's input: at a near-tie, summation order alone may route a token to another expert."""
    from transformers import AutoModelForCausalLM

    from megatron_opd.models.hf_config import load_architecture

    arch = load_architecture(hf_dir)
    if arch.moe is None:
        return float("inf")
    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    gaps = []

    def hook(module, inputs):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
        if arch.routing is not None:  # DeepSeek's router: sigmoid or softmax scores, expert bias, groups
            gaps.append(deepseek_routing_margin(module, x, arch.moe.top_k, arch.routing))
            return
        choice = x @ module.weight.double().T  # the top-k of the logits is the top-k of their softmax
        if arch.moe.expert_bias:  # the experts are picked on the scores plus the bias (MiniMax-M2, ERNIE 4.5)
            scores = torch.sigmoid(choice) if arch.moe.score_function == "sigmoid" else torch.softmax(choice, -1)
            choice = scores + biases[module].double().reshape(-1)
        top = torch.topk(choice, arch.moe.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).min())

    # The router is the layer's one [experts, hidden] matrix (module names differ from checkpoint names in
    # transformers 5: Mixtral's block_sparse_moe is its mlp).
    shape = (arch.moe.num_experts, arch.hidden_size)
    routers = [
        module
        for i in arch.moe.layers
        for name, module in model.model.layers[i].named_modules()
        if getattr(module, "weight", None) is not None
        and tuple(module.weight.shape) == shape
        and not name.startswith("linear_attn")  # Gated DeltaNet's [value heads, hidden] projections
    ]
    assert len(routers) == len(arch.moe.layers), f"found {len(routers)} routers in {len(arch.moe.layers)} MoE layers"
    # Each MoE layer's e_score_correction_bias, wherever transformers keeps it (a buffer of the MoE block, a parameter).
    biases = {}
    if arch.moe.expert_bias and arch.routing is None:
        for i, router in zip(arch.moe.layers, routers):
            layer = model.model.layers[i]
            tensors = [*layer.named_parameters(), *layer.named_buffers()]
            biases[router] = next(t for n, t in tensors if n.endswith("e_score_correction_bias"))
    handles = [router.register_forward_pre_hook(hook) for router in routers]
    with torch.no_grad():
        model(input_ids=tokens.reshape(-1, tokens.shape[-1]))
    for handle in handles:
        handle.remove()
    return float(min(gaps))


def deepseek_routing_margin(router, hidden: torch.Tensor, top_k: int, routing) -> float:
    """The smallest gap, over ``hidden``'s tokens (float64), between the last group or expert DeepSeek's ``router``
    picks and the first it passes over: sigmoid scores plus the expert bias, groups ranked by the sum of their top-2
    (DeepSeek-V3, GLM-4.5); or softmax scores, groups ranked by their best (DeepSeek-V2); experts by their (biased)
    scores within the chosen groups."""
    logits = hidden @ router.weight.double().T
    if routing.score_function == "sigmoid":
        biased = torch.sigmoid(logits)
    else:
        biased = torch.softmax(logits, dim=-1)
    if routing.expert_bias:
        biased = biased + router.e_score_correction_bias.double()
    groups = biased.view(len(biased), routing.n_group, -1)
    group_scores = groups.topk(2 if routing.score_function == "sigmoid" else 1, dim=-1).values.sum(-1)
    ranked_groups = group_scores.sort(dim=-1, descending=True).values
    gap = torch.full((len(biased),), float("inf"), dtype=torch.float64)
    if routing.n_group > routing.topk_group:
        gap = ranked_groups[:, routing.topk_group - 1] - ranked_groups[:, routing.topk_group]
    chosen = group_scores.topk(routing.topk_group, dim=-1).indices
    in_chosen = groups.gather(1, chosen[..., None].expand(-1, -1, groups.shape[-1])).flatten(1)
    ranked = in_chosen.sort(dim=-1, descending=True).values
    if top_k < ranked.shape[-1]:  # else every expert of the chosen groups is picked
        gap = torch.minimum(gap, ranked[:, top_k - 1] - ranked[:, top_k])
    return float(gap.min())
