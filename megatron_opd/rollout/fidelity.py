"""Is the sampler the model being trained? A start-up check and a per-step monitor that stop a wrong run.

On-policy distillation trains on the sampler's own tokens, so a sampler that is not the trainer's model (a weight
sync that missed a tensor, a tied output layer left stale, another dtype, a wrong tokenizer or stop id) makes the
student learn from another model's samples while every loss still falls. Both checks compare the sampler's
log-probability of a token with the trainer's at temperature 1, which is what vLLM and the built-in sampler record
(``Rollouts.logprobs``); with ``d = log p_trainer - log p_sampler`` over a step's trained tokens the monitor logs

- ``rollout/logprob_diff_mean``, ``_max``, ``_std``: mean, largest and standard deviation of ``|d|``;
- ``rollout/prob_ratio_mean``: mean of ``p_trainer / p_sampler`` (1 for a faithful sampler);
- ``rollout/kl_k3``: the k3 estimate ``mean(exp(d) - 1 - d)`` of KL(sampler || trainer), unbiased on the sampler's
  tokens and never negative per token;
- ``rollout/ppl_ratio``: the trainer's perplexity of the responses over the sampler's, ``exp(-mean d)``.

A stale batch (sampled by weights ``staleness`` steps older than the trained ones) was drawn from another policy
``mu``; its effect on the objective shows in the importance weights over each response's prefix,
``w_t = exp(sum_{s<t} d_s)`` (``s <= t`` for ``loss.mode=sampled``, whose estimator also samples the token at
``t``), clipped at ``loss.staleness_clip`` (``losses.importance``). They are logged every
step (``staleness/is_weight_mean``, ``_std``, ``staleness/is_truncated``: the share of tokens clipped) and applied to
the loss with ``loss.staleness_correction=prefix`` (``docs/training.md``).

The trainer's value is read in the loss pass (``trainer.objective``), no extra forward. A batch whose
``logprob_diff_mean`` exceeds ``rollout.max_logprob_diff`` stops the run before ``optimizer.step()``
(:class:`RolloutMismatchError`): in ``zero_step_off`` every batch, in the asynchronous modes only batches sampled by
the weights being trained (staleness 0), since older ones also differ by the policy's drift.

Shape legend: ``B`` samples, ``S`` positions.
"""

from __future__ import annotations

import math

import torch

MAX_LOGPROB_DIFF_DEFAULTS: dict[str, float] = {"fp32": 1e-3, "bf16": 0.1}
"""``rollout.max_logprob_diff`` when unset, by the lower of the trainer's and the sampler's precision.

fp32: healthy runs measured here stay below 2e-6 (``benchmarks/RESULTS.md``, "rollout fidelity"), the broken
tied-embedding sync gave 0.2-0.5; 1e-3 leaves a factor of 500 over the healthy values. Derived for fp32 on x86
CPUs (AVX2, AVX-512 and AMX machines alike: AMX tiles do bf16/int8 only, and neither torch nor vLLM-CPU enables a
bf16 math mode for fp32 GEMMs there): the trainer and the sampler run the same network with other kernels, so other
summation orders; a logit carries the rounding of the N terms accumulated on its way (per layer the q/k/v, score,
attention-sum, out-projection, gate/up and down products and the norms; then the output layer), each term's
error at most u = 2^-24 of the logit's magnitude Z = sum |h_i w_i|, and a log-probability at most twice a logit's
error. Worst case per token 2 N u Z; the monitored mean over a step's tokens follows independent roundings,
about 2 sqrt(N) u Z. For the quick start's student (N = 1,120, Z <= 12) that is 1.6e-3 worst case for one token
(tests/test_quickstart.py holds ``logprob_diff_max`` to it; 3.0e-4 measured on an AVX-512 EPYC) and 5e-5 for the
mean, 20x under 1e-3. The estimate grows with the model: at 8B scale (36 layers of hidden 4,096, FFN 12,288;
N ~ 1.5e6, Z ~ 30) 2 sqrt(N) u Z is ~4e-3, so measure a large fp32 model's healthy mean and set the key. bf16 (and fp16): no CUDA
build of vLLM has run against this code, so this is a conservative guess from what verl and slime users report for
healthy bf16 runs (mean |d| about 0.01-0.03): a gross mismatch still stops the run, ordinary kernel differences do
not. Measure it on your set-up (the metric is logged every step) and set the key."""


class RolloutMismatchError(RuntimeError):
    """The sampler's log-probabilities are not the trainer's; the step was not applied."""


def default_max_logprob_diff(*dtypes: str) -> float:
    """The default threshold for a run whose trainer and sampler use ``dtypes`` (torch dtype names or short names)."""
    full = all(str(d).removeprefix("torch.") in ("fp32", "float32", "float64", "fp64") for d in dtypes)
    return MAX_LOGPROB_DIFF_DEFAULTS["fp32" if full else "bf16"]


FIDELITY_SUMS = (  # the summed entries; logprob_diff_max is a maximum
    "fidelity_tokens",
    "logprob_diff_abs_sum",
    "logprob_diff_sq_sum",
    "logprob_diff_sum",
    "prob_ratio_sum",
    "kl_k3_sum",
    "is_weight_sum",
    "is_weight_sq_sum",
    "is_truncated_sum",
)


def fidelity_sums(
    trainer_lp_BS: torch.Tensor,
    sampler_lp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Sums (and the maximum) over the trained tokens of ``mask_BS`` that ``fidelity_metrics`` turns into metrics;
    ``weights``: ``losses.importance.prefix_weights`` of the batch's tokens."""
    sums = fidelity_sum_tensors(trainer_lp_BS, sampler_lp_BS, mask_BS, weights)
    return {name: float(value) for name, value in sums.items()}


def fidelity_sum_tensors(
    trainer_lp_BS: torch.Tensor,
    sampler_lp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``fidelity_sums`` as float64 scalars on the inputs' device: masked, not selected, so that the loss pass reads
    nothing to the host (a boolean selection waits for the device to count it)."""
    valid_BS = mask_BS != 0
    zero = torch.zeros((), dtype=torch.float64, device=mask_BS.device)
    if valid_BS.numel() == 0:
        return dict.fromkeys((*FIDELITY_SUMS, "logprob_diff_max"), zero)
    d = torch.where(valid_BS, trainer_lp_BS.double() - sampler_lp_BS.double(), 0.0)
    ratio = torch.where(valid_BS, torch.exp(d), 0.0)
    sums = {
        "fidelity_tokens": valid_BS.sum().double(),
        "logprob_diff_abs_sum": d.abs().sum(),
        "logprob_diff_sq_sum": (d * d).sum(),
        "logprob_diff_sum": d.sum(),
        "prob_ratio_sum": ratio.sum(),
        "kl_k3_sum": torch.where(valid_BS, ratio - 1.0 - d, 0.0).sum(),
        "logprob_diff_max": d.abs().max(),  # 0 where nothing is trained
    }
    if weights is not None:
        w = torch.where(valid_BS, weights[0].double(), 0.0)
        sums |= {"is_weight_sum": w.sum(), "is_weight_sq_sum": (w * w).sum(),
                 "is_truncated_sum": (weights[1] & valid_BS).sum().double()}  # fmt: skip
    return sums


def fidelity_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged ``rollout/*`` metrics of a step's global sums (empty when no token carried a sampler value)."""
    n = sums["fidelity_tokens"]
    if n <= 0:
        return {}
    mean_abs = sums["logprob_diff_abs_sum"] / n
    return {
        "rollout/logprob_diff_mean": mean_abs,
        "rollout/logprob_diff_max": sums["logprob_diff_max"],
        "rollout/logprob_diff_std": math.sqrt(max(sums["logprob_diff_sq_sum"] / n - mean_abs * mean_abs, 0.0)),
        "rollout/prob_ratio_mean": sums["prob_ratio_sum"] / n,
        "rollout/kl_k3": sums["kl_k3_sum"] / n,
        "rollout/ppl_ratio": math.exp(-sums["logprob_diff_sum"] / n),
    } | staleness_metrics(sums)


def staleness_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``staleness/*``: the prefix importance weights' mean, standard deviation and share truncated (empty when the
    step computed none)."""
    n = sums["fidelity_tokens"]
    if n <= 0 or not sums.get("is_weight_sum"):
        return {}
    mean = sums["is_weight_sum"] / n
    return {
        "staleness/is_weight_mean": mean,
        "staleness/is_weight_std": math.sqrt(max(sums["is_weight_sq_sum"] / n - mean * mean, 0.0)),
        "staleness/is_truncated": sums["is_truncated_sum"] / n,
    }


def policy_lag_warning(metrics: dict[str, float], staleness: int, threshold: float) -> str | None:
    """The warning for a stale batch whose policy lag (``staleness/policy_lag``: mean |d| per token, the trainer's
    drift from the weights that sampled it) exceeds ``threshold`` (0: never); None otherwise."""
    lag = metrics.get("staleness/policy_lag")
    if not threshold or staleness == 0 or lag is None or lag <= threshold:
        return None
    truncated = metrics.get("staleness/is_truncated")
    share = f", {truncated:.1%} of its tokens' prefix weights clipped" if truncated is not None else ""
    return (
        f"a batch sampled {staleness} step(s) before the weights it trains lags them by {lag:.3g} nats per token"
        f"{share} (above scheduler.warn_policy_lag={threshold:g}): stale samples teach less per step "
        "(benchmarks/RESULTS.md, scheduler quality). Consider a lower optim.lr, a scheduler.mode with less staleness "
        "or, at staleness 2, loss.staleness_correction=prefix"
    )


LIKELY_CAUSES = (
    "the weight sync (a tensor not sent or not applied by the engine: compare rollout/logprob_diff_max with the "
    "start-up check's numbers), the sampler's dtype (rollout.vllm_dtype) or kernels, a tokenizer or stop-id mismatch "
    "between the data and the sampler, or sampling settings the sampler applies to its recorded log-probabilities"
)


def check_step(metrics: dict[str, float], threshold: float, staleness: int) -> None:
    """Raise :class:`RolloutMismatchError` when a step's mean |d| exceeds ``threshold`` (only for staleness 0)."""
    value = metrics.get("rollout/logprob_diff_mean")
    if value is None or staleness != 0 or value <= threshold:  # NaN compares False: it stops the run
        return
    raise RolloutMismatchError(
        f"the sampler's log-probabilities differ from the trainer's by {value:.3g} nats per token on average "
        f"(max {metrics['rollout/logprob_diff_max']:.3g}, k3 KL {metrics['rollout/kl_k3']:.3g}), above "
        f"rollout.max_logprob_diff={threshold:g}: the samples do not come from the model being trained. Likely "
        f"causes: {LIKELY_CAUSES}. Set rollout.max_logprob_diff higher only if this level is expected"
    )


def sequence_logprobs(chunks: list, sequences: list[list[int]], vocab_size: int) -> list[torch.Tensor] | None:
    """log p(token_i | tokens_<i), i >= 1, of each sequence from the trainer's own forward (float64 after the gather).
    Collective over TP and PP; None except on the rank that gathers the logits."""
    from megatron_opd.checkpoint.verify import megatron_logits

    out = []
    for seq in sequences:
        tokens = torch.tensor([seq])
        logits = megatron_logits(chunks, tokens, vocab_size)
        if logits is not None:
            logprobs = torch.log_softmax(logits[0].double(), dim=-1)
            out.append(logprobs[torch.arange(len(seq) - 1), tokens[0, 1:]])
    return out or None


def probe_sequence(vocab_size: int, length: int = 32, seed: int = 1234) -> list[int]:
    """The start-up check's fixed sequence: ``length`` ids drawn uniformly from the vocabulary (every row of the
    embedding and output layer is equally likely to be probed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def startup_check(rollout, chunks: list, vocab_size: int, threshold: float, max_len: int) -> dict[str, float]:
    """Score one fixed sequence in the rollout engine (each server) and in the trainer; refuse to start on a mismatch.

    Collective over every rank; returns the mean |d| per engine (rank 0's numbers, on every rank)."""
    import torch.distributed as dist

    sequence = probe_sequence(vocab_size, length=max(2, min(32, max_len)))
    reference = sequence_logprobs(chunks, [sequence], vocab_size)
    box = [None]
    if reference is not None:  # the rank that gathered the logits hands them to rank 0
        box = [reference[0]]
    src = _holder_rank(reference is not None)
    dist.broadcast_object_list(box, src=src)
    result: list = [None]
    if dist.get_rank() == 0:
        try:
            engines = rollout.score([sequence])
            result = [{name: _diff(lps[0], box[0]) for name, lps in engines.items()}]
        except Exception as err:  # noqa: BLE001 - every rank must learn it
            result = [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(result, src=0)
    (outcome,) = result
    if isinstance(outcome, str):
        raise RuntimeError(f"the rollout start-up check could not score its sequence: {outcome}")
    bad = {name: d for name, d in outcome.items() if not d["mean"] <= threshold}
    if bad:
        numbers = "; ".join(f"{name}: mean {d['mean']:.3g}, max {d['max']:.3g}" for name, d in bad.items())
        raise RolloutMismatchError(
            f"rollout start-up check: the sampler's log-probabilities of a fixed {len(sequence)}-token sequence differ "
            f"from the trainer's ({numbers}; rollout.max_logprob_diff={threshold:g}) right after the first weight "
            f"sync, so rollouts would come from another model. Likely causes: {LIKELY_CAUSES}. "
            "rollout.startup_check=false skips this check"
        )
    return {name: d["mean"] for name, d in outcome.items()}


def _holder_rank(holds: bool) -> int:
    """The lowest global rank for which ``holds`` is true (a collective)."""
    import torch.distributed as dist

    from megatron_opd.distributed.device import collective_device

    rank = torch.tensor([dist.get_rank() if holds else dist.get_world_size()], device=collective_device())
    dist.all_reduce(rank, op=dist.ReduceOp.MIN)
    return int(rank.item())


def _diff(ours: list[float], reference: torch.Tensor) -> dict[str, float]:
    d = (torch.tensor(ours, dtype=torch.float64) - reference.double()).abs()
    return {"mean": float(d.mean()), "max": float(d.max())}
