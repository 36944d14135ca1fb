"""The trainer's own log-probabilities of token sequences: the reference a rollout engine's numbers are checked
against (weight-sync tests, benchmarks)."""

from __future__ import annotations

import torch


def trainer_logprobs(chunks: list, sequences: list[list[int]], vocab_size: int) -> list[torch.Tensor] | None:
    """log p(token_i | tokens_<i), i >= 1, of each sequence from the student's own forward in float64 after the
    gather; every rank must call it (a collective over TP and PP); None except on the gathering rank."""
    from megatron_opd.checkpoint.verify import megatron_logits

    out = []
    for seq in sequences:
        tokens = torch.tensor([seq])
        logits = megatron_logits(chunks, tokens, vocab_size)
        if logits is not None:
            logprobs = torch.log_softmax(logits[0].double(), dim=-1)
            out.append(logprobs[torch.arange(len(seq) - 1), tokens[0, 1:]])
    return out or None
