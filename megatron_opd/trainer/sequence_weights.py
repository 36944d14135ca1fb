"""Per-sequence loss weights: reward-weighted distillation and TCAD's teacher-confidence weighting.

- ``reward``: a user function ``module:function(prompt, response, record) -> float`` scores each sample; the
  weight is ``r`` (identity), ``exp(r / T)``, or ``n * softmax(r / T)`` over the ``n`` samples of its prompt.
- ``teacher_confidence``: the teacher's mean log-probability of each sample's response tokens, turned into
  ``n * softmax(mean / T)`` over the samples of its prompt, so the samples the teacher finds most plausible
  weigh most (TCAD). Weights average to 1 within a prompt, so the loss scale does not drift.

Shape legend: ``N`` samples, ``S`` positions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

from megatron_opd.trainer.config import LossConfig


def import_function(spec: str, field: str) -> Callable:
    """``module:function`` -> the function; a clear error naming ``field`` otherwise."""
    if ":" not in spec:
        raise ValueError(f"{field}={spec!r} must look like module:function")
    module_name, name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field}={spec!r}: cannot import {module_name} ({err})") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{field}={spec!r}: {module_name} has no function {name}")
    return fn


def group_softmax(values_N: torch.Tensor, groups: Sequence[int], temperature: float) -> torch.Tensor:
    """``n * softmax(values / T)`` within each group of samples (weights average to 1 per group)."""
    groups_N = torch.as_tensor(list(groups))
    out_N = torch.empty_like(values_N, dtype=torch.float32)
    for g in groups_N.unique():
        idx = (groups_N == g).nonzero().flatten()
        out_N[idx] = idx.numel() * torch.softmax(values_N[idx].float() / temperature, dim=0)
    return out_N


def reward_weights(cfg: LossConfig, rewards_N: torch.Tensor, groups: Sequence[int]) -> torch.Tensor:
    """Rewards -> weights with ``cfg.reward_transform``."""
    if cfg.reward_transform == "identity":
        return rewards_N.float()
    if cfg.reward_transform == "exp":
        return torch.exp(rewards_N.float() / cfg.weight_temperature)
    return group_softmax(rewards_N, groups, cfg.weight_temperature)


def teacher_confidence_weights(
    teacher_logprobs_NS: torch.Tensor, loss_mask_NS: torch.Tensor, groups: Sequence[int], temperature: float
) -> torch.Tensor:
    """TCAD: ``n * softmax(mean teacher log-prob of the response / T)`` over the samples of each prompt."""
    mask_NS = loss_mask_NS.to(teacher_logprobs_NS.dtype)
    total_N = (torch.where(mask_NS != 0, teacher_logprobs_NS, 0.0) * mask_NS).sum(dim=1)
    mean_N = total_N / mask_NS.sum(dim=1).clamp(min=1.0)
    return group_softmax(mean_N, groups, temperature)


def sequence_weights(cfg: LossConfig, scored, items, encoder, tokenizer, reward_fn: Callable | None) -> torch.Tensor:
    """``[N]`` loss weights of a scored batch for ``loss.weighting`` (ones for ``none``)."""
    rollouts, batch = scored.rollouts, scored.batch
    if cfg.weighting == "reward":
        rewards = [
            float(reward_fn(encoder.prompt_text(items[g].record), tokenizer.decode(r.tolist(), skip_special_tokens=True),
                            items[g].record))
            for g, r in zip(rollouts.prompt_index, rollouts.response_ids)
        ]  # fmt: skip
        return reward_weights(cfg, torch.tensor(rewards), rollouts.prompt_index)
    if cfg.weighting == "teacher_confidence" and scored.scores.requested_logprobs is not None:
        # Only the last pipeline stage holds the teacher's scores; it is also the only stage with a loss.
        return teacher_confidence_weights(
            scored.scores.requested_logprobs[..., 0], batch.loss_mask, rollouts.prompt_index, cfg.weight_temperature
        )
    return torch.ones(batch.num_samples)
