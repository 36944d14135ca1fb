"""The three divergences, written once over small explicit distributions, with their exact derivatives.

Dense losses never materialise a full distribution (see ``dense.py``), but the top-k losses reduce every token to a
handful of categories (the teacher's k ids, plus a tail bucket), and those small ``[tokens, n]`` distributions are
handled here in log space. Each function returns the per-token divergence *and* its derivative with respect to the
student's log-probabilities, so the top-k backward is hand-written rather than traced.

Conventions (P = teacher, Q = student, both over the same categories):

- ``forward_kl``: KL(P || Q) = sum P (log P - log Q).
- ``reverse_kl``: KL(Q || P) = sum Q (log Q - log P).
- ``jsd``: generalized Jensen-Shannon with M = beta P + (1 - beta) Q (the GKD paper's and TRL's convention):
  JSD_beta = beta KL(P || M) + (1 - beta) KL(Q || M). JSD_beta / beta -> KL(P || Q) as beta -> 0 and
  JSD_beta / (1 - beta) -> KL(Q || P) as beta -> 1; like TRL, beta == 0 and beta == 1 select the two KLs exactly.

Terms with a zero weight (``0 log 0``) count as 0.

Shape legend: ``T`` tokens, ``N`` categories per token.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

DivergenceKind = Literal["forward_kl", "reverse_kl", "jsd"]
KINDS: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")


def resolve_kind(kind: str, beta: float) -> tuple[str, float]:
    """Validate ``kind`` and ``beta``; map ``jsd`` with beta 0 / 1 to the forward / reverse KL as TRL does."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    beta = float(beta)
    if kind == "jsd":
        if not 0.0 <= beta <= 1.0 or math.isnan(beta):
            raise ValueError(
                f"beta must be in [0, 1] for kind='jsd' (it weights the teacher in the mixture), got {beta}"
            )
        if beta == 0.0:
            return "forward_kl", beta
        if beta == 1.0:
            return "reverse_kl", beta
    return kind, beta


def _weighted_log_ratio(logw_TN: torch.Tensor, log_a_TN: torch.Tensor, log_b_TN: torch.Tensor) -> torch.Tensor:
    """``w * (log_a - log_b)`` with ``w = exp(logw)``, and 0 wherever ``w == 0``."""
    w_TN = torch.exp(logw_TN)
    term_TN = w_TN * (log_a_TN - log_b_TN)
    return torch.where(w_TN > 0, term_TN, torch.zeros_like(term_TN))


def log_mixture(logp_TN: torch.Tensor, logq_TN: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta P + (1 - beta) Q)`` for 0 < beta < 1."""
    return torch.logaddexp(logp_TN + math.log(beta), logq_TN + math.log1p(-beta))


def elementwise_divergence(
    logp_TN: torch.Tensor, logq_TN: torch.Tensor, kind: str, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-category divergence terms ``d`` (summing to the divergence) and ``Q * dd/dQ``.

    ``Q * dd/dQ`` is the derivative of ``d`` with respect to ``log Q`` with every category's ``log Q`` held
    independent; callers chain it through whatever ties the categories together (normalisation, a tail bucket).
    ``kind`` must already be resolved (see ``resolve_kind``).
    """
    if kind == "forward_kl":
        d_TN = _weighted_log_ratio(logp_TN, logp_TN, logq_TN)
        dlogq_TN = -torch.exp(logp_TN)
    elif kind == "reverse_kl":
        d_TN = _weighted_log_ratio(logq_TN, logq_TN, logp_TN)
        q_TN = torch.exp(logq_TN)
        dlogq_TN = torch.where(q_TN > 0, q_TN * (logq_TN - logp_TN + 1.0), torch.zeros_like(q_TN))
    else:
        logm_TN = log_mixture(logp_TN, logq_TN, beta)
        d_TN = beta * _weighted_log_ratio(logp_TN, logp_TN, logm_TN) + (1.0 - beta) * _weighted_log_ratio(
            logq_TN, logq_TN, logm_TN
        )
        # d/dQ of beta P log(P/M) + (1-beta) Q log(Q/M) is (1-beta) log(Q/M): the 1/M terms cancel because M is the
        # beta-mixture itself.
        dlogq_TN = (1.0 - beta) * _weighted_log_ratio(logq_TN, logq_TN, logm_TN)
    return d_TN, dlogq_TN
