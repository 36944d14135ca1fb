"""Per-sequence weights: reward-weighted distillation transforms and TCAD teacher-confidence weights."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.sequence_weights import import_function, reward_weights, teacher_confidence_weights


def test_reward_transforms():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    groups = [0, 0, 1, 1]
    cfg = LossConfig(weighting="reward", reward_fn="m:f", weight_temperature=0.5)
    assert torch.equal(
        reward_weights(LossConfig(**{**cfg.__dict__, "reward_transform": "identity"}), rewards, groups), rewards
    )
    exp = reward_weights(LossConfig(**{**cfg.__dict__, "reward_transform": "exp"}), rewards, groups)
    torch.testing.assert_close(exp, torch.exp(rewards / 0.5))
    soft = reward_weights(cfg, rewards, groups)
    e = math.exp(1.0 / 0.5)
    torch.testing.assert_close(soft, torch.tensor([2 * e / (e + 1), 2 / (e + 1), 1.0, 1.0]))
    # Weights average to 1 within each prompt's group.
    torch.testing.assert_close(soft.view(2, 2).mean(dim=1), torch.ones(2))


def test_teacher_confidence_is_softmax_of_mean_logprob_per_group():
    logprobs = torch.tensor([[-1.0, -3.0, 0.0], [-0.5, -0.5, -9.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weights = teacher_confidence_weights(logprobs, mask, [0, 0, 1], temperature=2.0)
    means = torch.tensor([-2.0, -0.5])  # masked positions (the -9) never count
    expected = 2 * torch.softmax(means / 2.0, dim=0)
    torch.testing.assert_close(weights[:2], expected)
    torch.testing.assert_close(weights[2], torch.tensor(1.0))


def test_import_function_errors_name_the_field():
    assert import_function("math:sqrt", "loss.reward_fn") is math.sqrt
    with pytest.raises(ValueError, match="loss.reward_fn='math' must look like module:function"):
        import_function("math", "loss.reward_fn")
    with pytest.raises(ValueError, match="eval.scorer='nope_module:f': cannot import nope_module"):
        import_function("nope_module:f", "eval.scorer")
    with pytest.raises(ValueError, match="math has no function nope"):
        import_function("math:nope", "eval.scorer")
