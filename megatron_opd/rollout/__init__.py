"""Rollout back ends: how the student samples the responses it is trained on.

- ``BuiltinSampler``: batched, KV-cached sampling on the student's own tensor-parallel ``GPTModel``.
- ``sampling``: greedy / temperature / top-k / top-p / Gumbel-max on vocab-sharded logits.
"""

from megatron_opd.rollout.builtin import BuiltinSampler
from megatron_opd.rollout.sampling import processed_logits, sample_next, token_logprobs, top_p_threshold

__all__ = ["BuiltinSampler", "processed_logits", "sample_next", "token_logprobs", "top_p_threshold"]
