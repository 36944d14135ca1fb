"""The per-micro-batch loss: a vocab-parallel divergence to the teacher (or SFT cross-entropy) on response tokens.

Runs on the last pipeline stage with this rank's ``[b, S, V/TP]`` student logits. The loss of a micro-batch is
scaled so that, after Megatron's schedule divides by the number of micro-batches and DDP averages over
data-parallel ranks, the gradient is exactly that of the reduction over the whole global batch (the
denominator is counted over all data-parallel ranks before the step).

The logits are the output layer's and are not needed after the loss (the agreement statistic takes its argmax
first), so the divergences run in place (``inplace_backward``): the fast path, which keeps the student's
exponentials in the logits' storage for backward and writes the gradient there, with no ``[tokens, V/TP]`` buffer.

The loss function turns the schedule's micro-batch dict into a typed ``LossBatch`` (``trainer.loss_batch``) and
hands it to one ``Objective`` per kind of teacher signal, chosen once from the config (``objective_for``): SFT,
dense (logits, or the in-process teacher's hidden states and output weight), top-k (with ``loss.support=union``
also the student's own top-k ids and the teacher's log-probabilities at them, see ``teacher_columns``), sampled,
and the aligned cross-tokenizer loss. Whether the output layer is fused into the loss is decided by
``make_loss_fn``, around whichever objective runs. The objective is also what the rest of the trainer asks about the
loss (``needs_teacher``, ``samples``, ``teacher_request``, ``fuses_output``) and what the evaluation measures with
(``Objective.measure``): ``loss.kind``/``mode``/``cross_tokenizer``/``support`` are read here and in the config's
cross-checks only.

Shape legend: ``B`` samples in the micro-batch, ``S`` positions, ``V`` vocab shard, ``K`` teacher top-k, ``R`` the
student's top-k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Literal

import torch

from megatron_opd.interfaces import SamplingParams
from megatron_opd.losses import (
    DivergenceOptions,
    PassStatistics,
    dense_divergence,
    reduce_loss,
    topk_divergence,
    union_divergence,
)
from megatron_opd.losses.aligned import aligned_divergence
from megatron_opd.losses.fused_output import chunk_tokens, fused_output_loss, reduction_coefficients
from megatron_opd.losses.importance import (
    TRUNCATED_FLOOR,
    prefix_weights,
    rollout_correction_weights,
    truncation_ratios,
)
from megatron_opd.losses.sampled import label_logprobs, sampled_divergence
from megatron_opd.losses.shard_ops import chunked_logsumexp, gather_at_ids, global_argmax
from megatron_opd.losses.vocab_parallel import make_vocab_shard
from megatron_opd.models.context_parallel import ContextParallelSplit
from megatron_opd.models.output import HiddenStateOutput
from megatron_opd.models.packing import pipeline_token_budget
from megatron_opd.rollout.fidelity import fidelity_sum_tensors
from megatron_opd.rollout.sampling import drawn_logprobs
from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.loss_batch import LossBatch, split_for_context_parallel


@dataclass
class TeacherStats:
    """One teacher's share of a step's sums (``teachers.*``): its samples' trained tokens and what they gave."""

    FIELDS: ClassVar[tuple[str, ...]] = ("loss", "divergence_sum", "agree_sum", "top1_tokens", "tokens")

    loss: float = 0.0
    """Its tokens' share of the step's loss."""
    divergence_sum: float = 0.0
    """Unweighted per-token divergence summed over its trained tokens."""
    agree_sum: float = 0.0
    """Its trained tokens where the student's top-1 equals the teacher's."""
    top1_tokens: float = 0.0
    """Its trained tokens where the teacher's top-1 is known (the agreement's denominator)."""
    tokens: float = 0.0
    """Its trained tokens."""


@dataclass
class StepStats:
    """Sums over one micro-batch's trained tokens (added over micro-batches and data-parallel ranks), and maxima
    (``MAX_FIELDS``: the largest over micro-batches and ranks).

    The ``fidelity_*``/``logprob_*``/``prob_ratio``/``kl_k3`` entries compare the trainer's log-probability of each
    sampled token (temperature 1, read in the loss pass) with the sampler's (``rollout.fidelity``). With several
    teachers, ``teachers`` holds each one's share (``TeacherStats``), laid out after the sums in ``as_tensor``."""

    MAX_FIELDS: ClassVar[tuple[str, ...]] = ("logprob_diff_max",)

    loss: float = 0.0
    """The micro-batch's share of the global loss (already divided by the global denominator)."""
    divergence_sum: float = 0.0
    """Unweighted per-token divergence (or cross-entropy) summed over trained tokens."""
    agree_sum: float = 0.0
    """Trained tokens where the student's top-1 equals the teacher's (SFT: the target token)."""
    top1_tokens: float = 0.0
    """Trained tokens where the teacher's top-1 is a student token: the agreement's denominator (none for the sampled
    loss across tokenizers, which reads one log-probability per group; aligned: the groups' first tokens with a
    twin)."""
    tokens: float = 0.0
    """Trained tokens."""
    nonfinite: float = 0.0
    """1 when the loss is NaN or infinite."""
    fidelity_tokens: float = 0.0
    """Trained tokens that carry the sampler's log-probability."""
    logprob_diff_abs_sum: float = 0.0
    """Sum of |log p_trainer - log p_sampler|."""
    logprob_diff_sq_sum: float = 0.0
    """Sum of (log p_trainer - log p_sampler)^2."""
    logprob_diff_sum: float = 0.0
    """Sum of log p_trainer - log p_sampler."""
    prob_ratio_sum: float = 0.0
    """Sum of p_trainer / p_sampler."""
    kl_k3_sum: float = 0.0
    """Sum of the k3 terms exp(d) - 1 - d of KL(sampler || trainer)."""
    is_weight_sum: float = 0.0
    """Sum of the prefix importance weights (``losses.importance.prefix_weights``)."""
    is_weight_sq_sum: float = 0.0
    """Sum of their squares."""
    is_truncated_sum: float = 0.0
    """Tokens whose weight was clipped at ``loss.staleness_clip``."""
    logprob_diff_max: float = 0.0
    """Largest |log p_trainer - log p_sampler| (a maximum, not a sum)."""
    teachers: dict[str, TeacherStats] = field(default_factory=dict)
    """Per teacher by name (``teachers.*``; empty with one teacher)."""

    @classmethod
    def sums(cls) -> tuple[str, ...]:
        """The float fields, in ``as_tensor`` order (the per-teacher blocks follow them)."""
        return tuple(f.name for f in fields(cls) if f.name != "teachers")

    def as_tensor(self) -> torch.Tensor:
        values = [getattr(self, name) for name in self.sums()]
        values += [getattr(t, name) for t in self.teachers.values() for name in TeacherStats.FIELDS]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, teachers: tuple[str, ...] = ()) -> StepStats:
        values = [float(x) for x in t.tolist()]
        n, k = len(cls.sums()), len(TeacherStats.FIELDS)
        blocks = {name: TeacherStats(*values[n + i * k : n + (i + 1) * k]) for i, name in enumerate(teachers)}
        return cls(*values[:n], teachers=blocks)

    @classmethod
    def max_mask(cls, teachers: int = 0) -> torch.Tensor:
        """``[fields]`` bool: which entries of ``as_tensor`` are maxima (``teachers``: per-teacher blocks after)."""
        return torch.tensor(
            [name in cls.MAX_FIELDS for name in cls.sums()] + [False] * teachers * len(TeacherStats.FIELDS)
        )

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.sums()}


class MicroBatchStats:
    """One micro-batch's ``StepStats`` as a float64 vector on the loss's device, so that the loss function reads
    nothing to the host (a device sync per micro-batch, which also stalls pipeline schedules): ``sum_stats`` adds
    the micro-batches' vectors and reads the step's totals once. Reading a field (tests) converts on demand."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    @classmethod
    def of(cls, values: dict[str, torch.Tensor], device: torch.device) -> MicroBatchStats:
        """From scalar tensors named as ``StepStats``' fields (missing ones are 0)."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(torch.stack([values.get(name, zero).double() for name in StepStats.sums()]))

    def for_teacher(self, index: int, teachers: int) -> MicroBatchStats:
        """These sums, also as teacher ``index``'s block of ``teachers`` (a micro-batch holds one teacher's samples)."""
        sums = StepStats.sums()
        block = torch.stack([self.values[sums.index(name)] for name in TeacherStats.FIELDS])
        blocks = self.values.new_zeros(teachers, len(TeacherStats.FIELDS))
        blocks[index] = block
        return MicroBatchStats(torch.cat([self.values, blocks.reshape(-1)]))

    def as_tensor(self) -> torch.Tensor:
        return self.values

    def read(self) -> StepStats:
        return StepStats.from_tensor(self.values.cpu()[: len(StepStats.sums())])

    def as_dict(self) -> dict[str, float]:
        return self.read().as_dict()

    def __getattr__(self, name: str) -> float:
        if name not in StepStats.sums():  # not a field (nor ``values`` before it is set: copy, pickle)
            raise AttributeError(name)
        return getattr(self.read(), name)


def sft_per_token(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Cross-entropy of the next token with Megatron's vocab-parallel cross entropy, padding columns excluded."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    shard = make_vocab_shard(logits_BSV.shape[-1], None, vocab_size)
    logits = logits_BSV.float()
    if shard.valid_width < logits.shape[-1]:
        logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= shard.valid_width, -1e30)
    return vocab_parallel_cross_entropy(logits, labels_BS)


NO_DENSE_SCORES = "loss.mode=dense: the micro-batch holds neither the teacher's logits nor its hidden states"


def dense_teacher_logits(batch: LossBatch, teacher_weight: torch.Tensor | None) -> torch.Tensor:
    """The dense teacher's logit shard at ``batch``'s rows: as given, or formed from its hidden states."""
    if batch.teacher_logits is not None:
        return batch.teacher_logits
    if batch.teacher_hidden is None:
        raise ValueError(NO_DENSE_SCORES)
    return teacher_logits_of(batch.teacher_hidden, teacher_weight)


def teacher_logits_of(hidden: torch.Tensor, teacher_weight: torch.Tensor | None) -> torch.Tensor:
    """The teacher's logit shard at the rows of its hidden states: ``h @ W^T`` (a chunk's worth in the fused loss,
    so the teacher's logits never exist whole either)."""
    if teacher_weight is None:
        raise ValueError("the teacher's scores are hidden states, but no teacher output weight was given")
    return hidden.to(teacher_weight.dtype) @ teacher_weight.t()


@dataclass(frozen=True)
class TeacherRequest:
    """What an objective asks of the teacher for every scored sequence."""

    mode: Literal["dense", "topk"]
    """What the teacher computes: its logits (or hidden states) over the vocabulary, or its top-k."""
    topk: int
    """The teacher's k (``topk`` mode)."""
    student_topk: int
    """The student's own ids per token the rollout records, whose teacher log-probabilities the loss reads (the
    union support; 0: none)."""
    label_logprobs: bool
    """Whether the loss reads the teacher's log-probability of each sampled token (the sampled estimators)."""
    mapped_topk: bool
    """Across tokenizers: the teacher's top-k mapped to the student's ids (``loss.cross_tokenizer=aligned``)."""

    @property
    def dense(self) -> bool:
        return self.mode == "dense"


@dataclass
class TokenLoss:
    """An objective's per-token loss and what it read on the way."""

    per_token: torch.Tensor
    target_top1: torch.Tensor
    """The target's most likely token (the teacher's top-1, SFT's label; -1 where it has none in the student's
    vocabulary), for the agreement statistic."""
    divergence: torch.Tensor | None = None
    """The divergence's estimate where the per-token loss is a surrogate for it (the sampled estimators)."""
    student_lse: torch.Tensor | None = None
    """The student's log-normaliser at ``loss.student_temperature``, where the loss's forward computed it."""


@dataclass
class TokenReads:
    """What a loss pass reads per token beside the loss (the logits' leading shape): the step statistics' inputs."""

    student_top1: torch.Tensor
    target_top1: torch.Tensor
    label_lp: torch.Tensor | None = None
    """The sampled token's log-probability at temperature 1 (the rollout-fidelity monitor; only with the sampler's)."""
    divergence: torch.Tensor | None = None
    """As ``TokenLoss.divergence``; None: the per-token loss is the divergence."""
    truncated_lp: torch.Tensor | None = None
    """The sampled token's log-probability under the sampler's truncation (``LossBatch.truncated_logprobs``)."""

    def placed(self, whole: TokenReads | None, index_C: torch.Tensor, n: int) -> TokenReads:
        """These reads of a chunk of tokens placed at ``index_C`` of ``n``-token reads (``whole``; None: zeros)."""
        values = {}
        for f in fields(self):
            value, into = getattr(self, f.name), getattr(whole, f.name) if whole is not None else None
            if value is not None:
                into = (into if into is not None else value.new_zeros(n)).index_copy_(0, index_C, value)
            values[f.name] = into
        return TokenReads(**values)

    def viewed(self, *shape: int) -> TokenReads:
        """Every read viewed as ``shape`` (flat ``[B * S]`` reads as ``[B, S]``)."""
        return TokenReads(
            **{f.name: None if (v := getattr(self, f.name)) is None else v.view(*shape) for f in fields(self)}
        )


class Objective:
    """The per-token loss for one kind of teacher signal (``objective_for`` picks it once from the config), and what
    the rest of the trainer asks of it: whether a teacher scores the batch, whether the student samples it, what the
    teacher must return (``teacher_request``), whether the output layer is fused into the loss.

    ``per_token_pass`` takes logits of any leading shape (a micro-batch ``[B, S, V]`` or a chunk of the fused output
    layer ``[C, V]``; they may be overwritten: in-place backward) and the matching ``LossBatch``, and returns the
    per-token loss and the statistics read from the logits, computed first: the student's and the target's top-1
    and, for the rollout-fidelity monitor, the label's log-probability at temperature 1. Subclasses fill
    ``divergence`` (the training loss) and ``measure`` (the evaluation's divergence); fused vs unfused output layer
    is the caller's (``make_loss_fn``) concern.
    """

    requires: ClassVar[tuple[str, ...]] = ()
    """``LossBatch`` fields this signal needs."""
    keeps_logits: ClassVar[bool] = False
    """Whether the loss leaves the logits intact (the monitor may then take its logsumexp after it)."""
    needs_teacher: ClassVar[bool] = True
    """Whether a teacher scores the batches (SFT: none)."""
    samples: ClassVar[bool] = True
    """Whether the student samples the responses it trains on; SFT trains on the records' own responses, with no
    rollout (``loss.kind=sft``: a mode of the trainer)."""
    keeps_output_layer: ClassVar[bool] = False
    """Whether the output layer must write the whole logit shard (SFT: Megatron's vocab-parallel cross entropy)."""

    def __init__(
        self,
        cfg: LossConfig,
        *,
        vocab_size: int | None = None,
        teacher_temperature: float = 1.0,
        teacher_weight: torch.Tensor | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size
        self.truncation = sampling if sampling is not None and sampling.truncates else None
        """The rollouts' sampling where it truncates (temperature, top-k, top-p): the sampled losses and the
        staleness and rollout corrections then read the trainer's truncated distribution (``per_token_pass``)."""
        self.teacher_temperature, self.teacher_weight = teacher_temperature, teacher_weight
        self.options = DivergenceOptions(
            beta=cfg.beta, tail=cfg.tail, coverage_weight=cfg.coverage_weight,
            student_temperature=cfg.student_temperature, teacher_temperature=teacher_temperature,
            chunk_size=cfg.chunk_size, vocab_size=vocab_size, validate=False,
        )  # fmt: skip
        """The divergence's settings (not in place: ``divergence`` runs it in place). No input validation: the
        in-process teacher's top-k is valid by construction, and a NaN/inf loss shows in the step statistics the
        loss function reads anyway (``StepStats.nonfinite``), on which the trainer stops the step and names it."""

    @property
    def cross_tokenizer(self) -> bool:
        """Whether the teacher scores its own tokenization of each sample (``loss.cross_tokenizer``)."""
        return self.cfg.cross_tokenizer != "off"

    @property
    def teacher_request(self) -> TeacherRequest | None:
        """What the teacher must return (None: no teacher)."""
        cfg = self.cfg
        return TeacherRequest(mode=cfg.teacher_mode, topk=cfg.teacher_topk, student_topk=cfg.union_student_topk,
                              label_logprobs="teacher_label_logprobs" in self.requires,
                              mapped_topk=cfg.cross_tokenizer == "aligned")  # fmt: skip

    @property
    def fuses_output(self) -> bool:
        """Whether the update forms its logits inside the loss (``loss.fused_output``; SFT keeps the output layer, and
        so do a cross-tokenizer loss, whose groups must not be split over chunks, the staleness correction, whose
        weights need the pass's log-probabilities before the reduction, and the sampled reward to go, which reads the
        whole sample)."""
        return (
            not self.keeps_output_layer
            and self.cfg.fused_output != "off"
            and not self.cross_tokenizer
            and self.cfg.staleness_correction == "off"
            and self.cfg.rollout_correction == "off"
            and self.cfg.sampled_credit == "token"
        )

    def check(self, batch: LossBatch) -> None:
        """Refuse a micro-batch without the fields this signal needs (a wiring error, named)."""
        missing = [name for name in self.requires if getattr(batch, name) is None]
        if missing:
            raise ValueError(
                f"{type(self).__name__} (loss.kind={self.cfg.kind}, loss.mode={self.cfg.mode}, loss.cross_tokenizer="
                f"{self.cfg.cross_tokenizer}): the micro-batch has no {', '.join(missing)}"
            )

    def divergence(self, logits_TV: torch.Tensor, batch: LossBatch, shard, label_logit) -> TokenLoss:
        """The per-token training loss, in place where the objective allows it (``label_logit``: the sampled token's
        logit, read before the loss when the monitor runs)."""
        raise NotImplementedError

    def measure(self, logits_BSV: torch.Tensor, batch: LossBatch, *, teacher_samples: bool = False) -> torch.Tensor:
        """The evaluation's per-token divergence (no gradient; the logits stay intact) on the student's own samples,
        or with ``teacher_samples`` on the teacher's."""
        raise ValueError(f"{type(self).__name__} has no held-out divergence to the teacher")

    def label_logprob(self, logits_TV, loss: TokenLoss, shard, label_logit, lse_t1) -> torch.Tensor:
        """The sampled token's log-probability at temperature 1, from its logit and a log-normaliser: the one at
        temperature 1 (``lse_t1``) or the loss pass's at ``loss.student_temperature`` = 1."""
        if lse_t1 is None and self.keeps_logits:  # the loss overwrote only a copy: one logsumexp pass
            lse_t1 = chunked_logsumexp(logits_TV.detach(), shard)
        return label_logit - (lse_t1 if lse_t1 is not None else loss.student_lse)

    def per_token_pass(self, logits_TV: torch.Tensor, batch: LossBatch) -> tuple[torch.Tensor, TokenReads]:
        cfg = self.cfg
        shard = make_vocab_shard(logits_TV.shape[-1], None, self.vocab_size)
        monitor = batch.rollout_logprobs is not None
        label_logit = lse_t1 = None
        with torch.no_grad():
            student_top1 = global_argmax(logits_TV.detach(), shard)
            if monitor:  # read before the in-place loss overwrites the logits: a gather, no vocabulary pass
                label_logit = gather_at_ids(logits_TV.detach(), batch.labels[..., None], shard)[..., 0]
                # The loss pass normalises at loss.student_temperature: at another one, one logsumexp pass at 1.
                lse_t1 = None if cfg.student_temperature == 1.0 else chunked_logsumexp(logits_TV.detach(), shard)
        truncated_lp = None
        reads_truncation = cfg.mode == "sampled" or cfg.cross_tokenizer == "aligned" or batch.drawn_logprobs is not None
        if self.truncation is not None and reads_truncation and not isinstance(self, SftObjective):
            truncated_lp = self.truncated_label_logprobs(logits_TV, batch)  # before the in-place loss
            batch = replace(batch, truncated_logprobs=truncated_lp)
        loss = self.divergence(logits_TV, batch, shard, label_logit)
        label_lp = None
        if monitor:
            with torch.no_grad():
                label_lp = self.label_logprob(logits_TV, loss, shard, label_logit, lse_t1)
        return loss.per_token, TokenReads(student_top1, loss.target_top1, label_lp, loss.divergence, truncated_lp)

    def truncated_label_logprobs(self, logits_TV: torch.Tensor, batch: LossBatch) -> torch.Tensor:
        """The trainer's log-probability of each label under the rollouts' truncation (``rollout.sampling.
        drawn_logprobs``; ``TRUNCATED_FLOOR`` where it is excluded), at the trained positions (0 elsewhere). Costs
        the sampler's processing of those rows' logits (a top-k merge, the top-p search) and a few copies of them."""
        shard = make_vocab_shard(logits_TV.shape[-1], None, self.vocab_size)
        with torch.no_grad():
            flat_TV = logits_TV.detach().reshape(-1, logits_TV.shape[-1])
            rows = (batch.loss_mask.reshape(-1) != 0).nonzero()[:, 0]  # the same on every TP rank of the group
            out = torch.zeros(flat_TV.shape[0], dtype=torch.float32, device=flat_TV.device)
            if rows.numel():
                lp = drawn_logprobs(flat_TV.index_select(0, rows), batch.labels.reshape(-1)[rows], shard,
                                    self.truncation)  # fmt: skip
                out[rows] = lp.float().clamp(min=TRUNCATED_FLOOR)
            return out.view(batch.labels.shape)


class SftObjective(Objective):
    """Cross-entropy of the sampled (target) token; no teacher, no rollout."""

    needs_teacher = False
    samples = False
    keeps_output_layer = True

    @property
    def cross_tokenizer(self) -> bool:
        return False

    @property
    def teacher_request(self) -> None:
        return None

    def divergence(self, logits_TV, batch, shard, label_logit):
        return TokenLoss(sft_per_token(logits_TV, batch.labels, self.vocab_size), target_top1=batch.labels)

    def label_logprob(self, logits_TV, loss, shard, label_logit, lse_t1):
        return -loss.per_token.detach()  # cross-entropy is minus the label's log-probability (temperature 1)


class DenseObjective(Objective):
    """The divergence over the full vocabulary to a dense teacher: its logits, or the in-process teacher's hidden
    states and output weight (formed here, for this chunk's or micro-batch's rows only), in place: the output
    layer's logits are not needed after the loss."""

    def check(self, batch: LossBatch) -> None:
        if batch.teacher_logits is None and batch.teacher_hidden is None:
            raise ValueError(NO_DENSE_SCORES)

    def divergence(self, logits_TV, batch, shard, label_logit):
        with torch.no_grad():
            teacher_logits = dense_teacher_logits(batch, self.teacher_weight)
            target_top1 = global_argmax(teacher_logits, shard)
        stats = PassStatistics()
        options = replace(self.options, inplace_backward=True, outputs=stats)
        per_token = dense_divergence(logits_TV, teacher_logits, self.cfg.kind, options=options)
        return TokenLoss(per_token, target_top1, student_lse=stats.student_lse)

    def measure(self, logits_BSV, batch, *, teacher_samples=False):
        teacher_logits = dense_teacher_logits(batch, self.teacher_weight)
        return dense_divergence(logits_BSV, teacher_logits, self.cfg.kind, options=self.options)


class TopkObjective(Objective):
    """The divergence over the teacher's top-k and a tail, in place (the output layer's logits are not needed after
    the loss); with ``loss.support=union`` over the union with the student's own top-k ids in training (``losses.
    union``), while the evaluation, whose teacher request carries no student ids, measures the teacher's top-k."""

    requires = ("teacher_topk_ids", "teacher_topk_logprobs")

    def __init__(self, cfg: LossConfig, **kwargs) -> None:
        super().__init__(cfg, **kwargs)
        self.union = cfg.support == "union"

    def check(self, batch: LossBatch) -> None:
        super().check(batch)
        if self.union and batch.student_topk_ids is None:
            raise ValueError(
                "loss.support=union: the micro-batch has no student top-k ids; pass the batch to teacher_columns "
                "and score it with TrainBatch.teacher_request_ids()"
            )

    def divergence(self, logits_TV, batch, shard, label_logit):
        stats = PassStatistics()
        options = replace(self.options, inplace_backward=True, outputs=stats)
        teacher = (batch.teacher_topk_ids, batch.teacher_topk_logprobs)
        if self.union:
            student = (batch.student_topk_ids, batch.teacher_logprobs_at_student_ids)
            per_token = union_divergence(logits_TV, *teacher, *student, self.cfg.kind, options=options)
        else:
            per_token = topk_divergence(logits_TV, *teacher, self.cfg.kind, options=options)
        return TokenLoss(per_token, batch.teacher_topk_ids[..., 0], student_lse=stats.student_lse)

    def measure(self, logits_BSV, batch, *, teacher_samples=False):
        teacher = (batch.teacher_topk_ids, batch.teacher_topk_logprobs)
        return topk_divergence(logits_BSV, *teacher, self.cfg.kind, options=self.options)


class SampledObjective(Objective):
    """The sampled reverse or forward KL at the student's own tokens (``loss.mode=sampled``; across tokenizers per
    aligned group with ``loss.cross_tokenizer=sampled``)."""

    requires = ("teacher_label_logprobs",)

    def divergence(self, logits_TV, batch, shard, label_logit):
        cfg = self.cfg
        # The teacher's top-1, where it has one in the student's vocabulary (not across tokenizers).
        top1 = batch.teacher_topk_ids
        target_top1 = top1[..., 0] if top1 is not None else torch.full_like(batch.labels, -1)
        logq = label_logprobs(logits_TV, batch.labels, vocab_size=self.vocab_size, temperature=cfg.student_temperature)
        per_token, divergence = sampled_divergence(
            logq, batch.teacher_label_logprobs, cfg.kind, batch.group_offset, batch.context_parallel,
            ratio_clip=cfg.sampled_ratio_clip, credit=cfg.sampled_credit, loss_mask_T=batch.loss_mask,
            segment_ids_T=batch.segment_ids,
        )  # fmt: skip
        if batch.truncated_logprobs is not None:  # drawn from the truncated distribution: q/pi per token
            ratio = truncation_ratios(logq, batch.truncated_logprobs)
            per_token, divergence = per_token * ratio, divergence * ratio
        lse = label_logit - logq.detach() if label_logit is not None and cfg.student_temperature == 1.0 else None
        return TokenLoss(per_token, target_top1, divergence, student_lse=lse)

    def measure(self, logits_BSV, batch, *, teacher_samples=False):
        """The sampled estimate (only the teacher's log-probability of each token is known): of ``loss.kind`` on the
        student's samples (``log q - log p`` for the reverse KL, ``r log r - r + 1`` with ``r = p/q`` for the forward
        KL), ``log p - log q`` (the forward KL) on the teacher's; each unbiased under the model that sampled."""
        logq = label_logprobs(logits_BSV, batch.labels, vocab_size=self.vocab_size)
        if teacher_samples:
            return batch.teacher_label_logprobs - logq
        _, divergence = sampled_divergence(logq, batch.teacher_label_logprobs, self.cfg.kind)
        return divergence


class AlignedObjective(Objective):
    """``loss.cross_tokenizer=aligned``: the top-k divergence on the tokens both vocabularies share, the sampled
    reverse KL elsewhere (``losses.aligned``)."""

    requires = ("aligned_mask", "teacher_topk_ids", "teacher_topk_logprobs", "teacher_topk_support",
                "teacher_label_logprobs", "group_offset")  # fmt: skip
    keeps_logits = True

    def divergence(self, logits_TV, batch, shard, label_logit):
        cfg, aligned = self.cfg, batch.aligned_mask
        first = torch.where(batch.teacher_topk_support[..., 0], batch.teacher_topk_ids[..., 0], -1)
        target_top1 = torch.where(aligned, first, -1)  # the teacher's top-1, where it has a twin
        per_token, divergence = aligned_divergence(
            logits_TV, batch.labels, aligned, batch.teacher_topk_ids, batch.teacher_topk_logprobs,
            batch.teacher_topk_support, batch.teacher_label_logprobs, batch.group_offset, cfg.kind,
            vocab_size=self.vocab_size, beta=cfg.beta, tail=cfg.tail, coverage_weight=cfg.coverage_weight,
            student_temperature=cfg.student_temperature, chunk_size=cfg.chunk_size,
            context_parallel=batch.context_parallel, sampled_ratio_clip=cfg.sampled_ratio_clip,
            drawn_logprobs=batch.truncated_logprobs,
        )  # fmt: skip
        return TokenLoss(per_token, target_top1, divergence)


def objective_for(
    cfg: LossConfig,
    *,
    vocab_size: int | None = None,
    teacher_temperature: float = 1.0,
    teacher_weight: torch.Tensor | None = None,
    sampling: SamplingParams | None = None,
) -> Objective:
    """The objective of the teacher signal ``cfg`` asks for (the config's validation keeps the combinations
    consistent: ``cross_tokenizer=aligned`` is a top-k loss, ``cross_tokenizer=sampled`` a sampled one). The loss
    needs ``vocab_size`` (None: the logits' full width) and the teacher's temperature and output weight; what the
    objective declares (``needs_teacher``, ``teacher_request``, ...) does not."""
    if cfg.kind == "sft":
        cls = SftObjective
    elif cfg.cross_tokenizer == "aligned":
        cls = AlignedObjective
    elif cfg.mode == "sampled":
        cls = SampledObjective
    elif cfg.mode == "topk":
        cls = TopkObjective
    else:
        cls = DenseObjective
    return cls(cfg, vocab_size=vocab_size, teacher_temperature=teacher_temperature, teacher_weight=teacher_weight,
               sampling=sampling)  # fmt: skip


def make_loss_fn(
    cfg: LossConfig,
    *,
    vocab_size: int,
    teacher_temperature: float,
    normalizer: float,
    scale: float,
    output: HiddenStateOutput | None = None,
    grad_hint: float | None = None,
    teacher_weight: torch.Tensor | None = None,
    context_parallel: ContextParallelSplit | None = None,
    sampling: SamplingParams | None = None,
) -> Callable[[torch.Tensor, dict], tuple[torch.Tensor, MicroBatchStats]]:
    """The loss function Megatron's schedule calls with (logits, micro-batch) on the last pipeline stage.

    ``normalizer``: the global denominator of ``cfg.reduction`` (trained tokens or sequences over the global
    batch; unused for ``sum``). ``scale``: micro-batches x data-parallel size (undone by the schedule and DDP).
    ``output``: the model's hidden-state switch when it is active (``loss.fused_output``): the schedule then hands
    over final hidden states ``[B, S, H]`` and the logits are formed chunk by chunk inside the loss.
    ``grad_hint``: the gradient Megatron's schedule will bring to the returned loss (``fused_output_loss``: the
    weight gradient then goes straight into its buffer); None when unknown. ``teacher_weight``: the in-process
    teacher's output-weight shard when its scores are hidden states (``TeacherScores.output_weight``).
    ``context_parallel``: the micro-batches are split over context-parallel ranks (``split_for_context_parallel``).
    ``sampling``: the rollouts' sampling (its truncation: ``Objective.truncation``; None: the model's own).
    """
    objective = objective_for(
        cfg, vocab_size=vocab_size, teacher_temperature=teacher_temperature, teacher_weight=teacher_weight,
        sampling=sampling,
    )  # fmt: skip

    def loss_fn(output_tensor: torch.Tensor, mb: dict) -> tuple[torch.Tensor, MicroBatchStats]:
        batch = LossBatch.of(mb, context_parallel)
        objective.check(batch)
        mask_BS, weights_BS = batch.loss_mask, batch.weights
        kwargs = {} if cfg.reduction == "sum" else {"normalizer": normalizer, "segment_ids": batch.segment_ids,
                                                   "sequence_weights": batch.sequence_tokens}  # fmt: skip
        if output is None:
            per_token_BS, reads = objective.per_token_pass(output_tensor, batch)
            staleness = staleness_weights(reads, batch)
            if cfg.staleness_correction == "prefix":  # the stale prefix's importance weight (fused output is off)
                if staleness is None:
                    raise ValueError("loss.staleness_correction=prefix: the batch has no rollout log-probabilities")
                weights_BS = weights_BS * staleness[0]
            if cfg.rollout_correction != "off":  # the rollout-trainer gap at every staleness (fused output is off)
                weights_BS = weights_BS * rollout_correction(reads, batch)
            weighted_BS = per_token_BS * weights_BS.to(per_token_BS.dtype)
            loss = reduce_loss(weighted_BS, mask_BS, cfg.reduction, **kwargs)
        else:
            loss, per_token_BS, reads = _fused_pass(output_tensor, output.weight, batch, kwargs)
            staleness = staleness_weights(reads, batch)
        divergence_BS = reads.divergence if reads.divergence is not None else per_token_BS
        with torch.no_grad():  # on the device: one host read per step, after the last micro-batch (sum_stats)
            valid_BS = mask_BS != 0
            values = {
                "loss": loss.detach().double(),
                "divergence_sum": torch.where(valid_BS, divergence_BS.detach(), 0.0).sum(),
                "agree_sum": ((reads.student_top1 == reads.target_top1) & valid_BS).sum(),
                "top1_tokens": ((reads.target_top1 >= 0) & valid_BS).sum(),
                "tokens": valid_BS.sum(),
                "nonfinite": ~torch.isfinite(loss.detach()),
            }
            if batch.rollout_logprobs is not None:
                values.update(fidelity_sum_tensors(reads.label_lp, batch.rollout_logprobs, mask_BS, staleness))
            stats = MicroBatchStats.of(values, loss.device)
        return loss * scale, stats

    def policy_logprobs(reads: TokenReads, batch: LossBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The trainer's and the sampler's log-probabilities of each sampled token under the distribution the
        sampler draws from (``losses.importance``): truncated where the rollouts are, else the model's own (None
        without the sampler's)."""
        if objective.truncation is None:
            return None if batch.rollout_logprobs is None else (reads.label_lp, batch.rollout_logprobs)
        if batch.drawn_logprobs is None or reads.truncated_lp is None:
            return None
        return reads.truncated_lp, batch.drawn_logprobs

    def staleness_weights(reads: TokenReads, batch: LossBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prefix importance weights of the micro-batch's sampled tokens and where they were clipped (None
        without the sampler's log-probabilities)."""
        pair = policy_logprobs(reads, batch)
        if pair is None:
            return None
        with torch.no_grad():
            return prefix_weights(*pair, batch.loss_mask, batch.segment_ids,
                                  inclusive=cfg.mode == "sampled", clip=cfg.staleness_clip,
                                  context_parallel=batch.context_parallel)  # fmt: skip

    def rollout_correction(reads: TokenReads, batch: LossBatch) -> torch.Tensor:
        """``loss.rollout_correction``'s weights of the micro-batch's tokens (``losses.importance``)."""
        pair = policy_logprobs(reads, batch)
        if pair is None:
            raise ValueError(
                f"loss.rollout_correction={cfg.rollout_correction}: the batch has no sampler log-probabilities of "
                "the distribution drawn from (Rollouts.logprobs, or drawn_logprobs under truncated sampling)"
            )
        with torch.no_grad():
            return rollout_correction_weights(*pair, batch.loss_mask, batch.segment_ids, mode=cfg.rollout_correction,
                                              clip=cfg.rollout_correction_clip,
                                              context_parallel=batch.context_parallel)  # fmt: skip

    def _fused_pass(hidden_BSH: torch.Tensor, weight_VH: torch.Tensor, batch: LossBatch, kwargs: dict):
        """The objective's ``per_token_pass`` a chunk of trained tokens at a time on logits formed from the hidden
        states."""
        mask_BS = batch.loss_mask
        (b, s), n = mask_BS.shape, mask_BS.numel()
        flat = batch.flatten()
        placed: list[TokenReads | None] = [None]  # the chunks' reads at their tokens (None: no chunk yet)

        def token_pass(logits_CV: torch.Tensor, index_C: torch.Tensor) -> torch.Tensor:
            per_token_C, reads = objective.per_token_pass(logits_CV, flat.select(index_C))
            placed[0] = reads.placed(placed[0], index_C, n)
            return per_token_C

        coeff = reduction_coefficients(mask_BS, batch.weights, cfg.reduction, **kwargs)
        rows = chunk_tokens(cfg.chunk_size, weight_VH.shape[0], hidden_BSH.device)
        loss, per_token_N, index_N = fused_output_loss(
            hidden_BSH.reshape(n, -1),
            weight_VH,
            coeff,
            mask_BS != 0,
            token_pass,
            rows=rows,
            grad_hint=None if grad_hint is None else grad_hint * scale,
            index_N=batch.trained_index,
        )
        per_token_BS = per_token_N.new_zeros(n).index_copy(0, index_N, per_token_N).view(b, s)
        if placed[0] is None:  # nothing trained
            zeros = mask_BS.new_zeros(n)
            placed[0] = TokenReads(zeros, zeros, zeros if batch.rollout_logprobs is not None else None)
        reads = placed[0].viewed(b, s)
        return loss, per_token_BS, reads

    return loss_fn


def teacher_columns(scores, batch=None) -> dict[str, torch.Tensor]:
    """The micro-batch columns holding the teacher's scores (none on ranks without a loss).

    With a ``batch`` holding the student's top-k ids (union support), also those ids and the teacher's
    log-probabilities at them: the reply to ``batch.teacher_request_ids()``, whose slots ``1 : 1 + k`` they are.
    The log-probability at slot 0 (the token each position predicts) is ``teacher_label_logprobs`` (``loss.mode=
    sampled``), and ``scores.extras`` (e.g. a cross-tokenizer batch's ``group_offset``) are columns as they are.
    """
    columns: dict[str, torch.Tensor] = {}
    requested = scores.requested_logprobs
    if scores.topk_ids is not None:
        columns = {"teacher_topk_ids": scores.topk_ids, "teacher_topk_logprobs": scores.topk_logprobs}
        student_ids = None if batch is None else batch.student_topk_ids
        if student_ids is not None:
            k = student_ids.shape[-1]
            if requested is None or requested.shape[-1] != 1 + k:
                got = None if requested is None else tuple(requested.shape)
                raise ValueError(
                    f"the teacher's requested_logprobs are {got}; the union support needs [N, S, {1 + k}] "
                    "(the sampled token and the student's top-k ids of TrainBatch.teacher_request_ids())"
                )
            columns["student_topk_ids"] = student_ids
            columns["teacher_logprobs_at_student_ids"] = requested[..., 1:]
    elif scores.dense_logits is not None:
        columns = {"teacher_logits": scores.dense_logits}
    elif scores.dense_hidden is not None:
        columns = {"teacher_hidden": scores.dense_hidden}
    if requested is not None:
        columns["teacher_label_logprobs"] = requested[..., 0]
    columns.update(scores.extras)
    return columns


def _local_count(mask: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sequence_mean":
        return (mask != 0).any(dim=-1).sum().double()
    if reduction == "sum":
        return mask.double().sum()
    return (mask != 0).sum().double()


def _data_parallel_sum(local: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_opd.distributed.device import collective_device

    t = local.reshape(-1).to(collective_device())
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.cpu()


def global_count(mask: torch.Tensor, reduction: str) -> float:
    """The reduction's denominator over the global batch: trained tokens (``token_mean``), sequences with a
    trained token (``sequence_mean``) or the plain sum of ``mask`` (``sum``); a collective over data-parallel
    ranks. ``mask`` holds whole sequences (counted before any context-parallel split: CP ranks hold the same)."""
    return float(_data_parallel_sum(_local_count(mask, reduction)).item())


@dataclass(frozen=True)
class TeacherObjective:
    """How one of several teachers' samples are trained (``teachers.NAME``): its merged ``loss.*``, its temperature
    and its ``loss.weight``."""

    loss: LossConfig
    temperature: float = 1.0
    weight: float = 1.0


def _micro_batches(batch, columns: dict, *, micro_batch_size: int, packing: bool, micro_batch_tokens: int | None,
                   ragged: bool = False) -> list[dict]:  # fmt: skip
    from megatron.core import parallel_state as ps

    tp, one_stage = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size() == 1
    if packing:
        budget = pipeline_token_budget(micro_batch_tokens, micro_batch_size, batch.seq_len)
        return batch.packed_micro_batches(
            micro_batch_size, columns, pad_multiple=tp, token_budget=budget, ragged=ragged
        )
    # sequence parallelism splits S over TP
    return batch.micro_batches(micro_batch_size, columns, trim=one_stage, pad_multiple=8 * tp, ragged=ragged)


def train_step(
    student,
    batch,
    scores,
    cfg: LossConfig,
    *,
    vocab_size: int,
    teacher_temperature: float,
    micro_batch_size: int,
    guard: Callable[[StepStats], None] | None = None,
    packing: bool = False,
    micro_batch_tokens: int | None = None,
    teachers: dict[str, TeacherObjective] | None = None,
    lr_scale: Callable[[StepStats], float] | None = None,
    sampling: SamplingParams | None = None,
):
    """One optimizer step of ``student`` on ``batch`` (and the teacher's ``scores``; None for SFT); ``guard`` may
    refuse the step before it is applied and ``lr_scale`` shorten it (``Student.step``). ``packing``: THD
    micro-batches (``train.packing``). ``teachers`` (``teachers.*``, with ``scores`` a ``RoutedScores``): each
    teacher's objective by name. ``sampling``: the rollouts' sampling parameters (``make_loss_fn``)."""
    from megatron.core import parallel_state as ps

    layout = dict(micro_batch_size=micro_batch_size, packing=packing, micro_batch_tokens=micro_batch_tokens)
    if teachers is not None:
        return _routed_step(student, batch, scores, cfg, teachers, vocab_size=vocab_size, guard=guard,
                            lr_scale=lr_scale, sampling=sampling, **layout)  # fmt: skip
    columns = teacher_columns(scores, batch) if scores is not None else {}
    micro_batches = _micro_batches(batch, columns, **layout)
    split = ContextParallelSplit.current()
    if split is not None:  # Megatron's CP layout; sequence parallelism then splits each rank's share over TP
        tp = ps.get_tensor_model_parallel_world_size()
        multiple = 2 * split.size * (tp if student.model[0].config.sequence_parallel else 1)
        micro_batches = [split_for_context_parallel(mb, split, pad_multiple=multiple) for mb in micro_batches]
    output = HiddenStateOutput(student.model) if fused_output_applies(cfg) else None
    if output is not None and not output.exact:  # soft-capped final logits: the loss takes the logits
        output = None
    if output is not None:  # the fused loss chunks the trained tokens: found here, not by a device sync in the loop
        for mb in micro_batches:
            mb["trained_index"] = (mb["loss_mask"] != 0).reshape(-1).nonzero().reshape(-1)
    loss_fn = make_loss_fn(
        cfg,
        vocab_size=vocab_size,
        teacher_temperature=teacher_temperature,
        normalizer=global_count(batch.loss_mask, cfg.reduction),
        scale=len(micro_batches) * ps.get_data_parallel_world_size(),
        output=output,
        grad_hint=_grad_hint(student, len(micro_batches)),
        teacher_weight=getattr(scores, "output_weight", None),
        context_parallel=split,
        sampling=sampling,
    )
    with output.active() if output is not None else contextlib.nullcontext():
        return student.step(micro_batches, loss_fn, guard, lr_scale=lr_scale)


def _grad_hint(student, num_micro_batches: int) -> float | None:
    """What the schedule does to the loss: x CP size / micro-batches, and fp16's dynamic loss scale (not known)."""
    from megatron.core import parallel_state as ps

    fp16 = any(getattr(getattr(chunk, "config", None), "fp16", False) for chunk in student.model)
    return None if fp16 else ps.get_context_parallel_world_size() / num_micro_batches


def teacher_shares(
    batch, routed, teachers: dict[str, TeacherObjective], reduction: str, balance: str
) -> dict[str, float]:
    """Each teacher's factor on its samples' weights: its ``loss.weight``, and with ``loss.teacher_balance=
    per_teacher`` ``D / (T * D_t)`` (``D_t`` its part of the reduction's global denominator ``D``, ``T`` the teachers
    with samples in the step), so each teacher's part weighs the same. One collective over data-parallel ranks."""
    names = list(teachers)
    local = torch.zeros(len(names), dtype=torch.float64)
    for part in routed.parts:
        mask = batch.loss_mask.index_select(0, torch.tensor(part.rows, dtype=torch.int64))
        local[names.index(part.name)] = _local_count(mask, reduction)
    counts = _data_parallel_sum(local)
    present = counts > 0
    shares = {}
    for i, name in enumerate(names):
        balance_t = 1.0
        if balance == "per_teacher" and present[i]:
            balance_t = float(counts.sum() / (present.sum() * counts[i]))
        shares[name] = teachers[name].weight * balance_t
    return shares


def _routed_step(student, batch, routed, cfg: LossConfig, teachers: dict[str, TeacherObjective], *, vocab_size: int,
                 guard, lr_scale=None, sampling=None, **layout):  # fmt: skip
    """``train_step`` of a batch scored by several teachers: each teacher's samples in micro-batches of their own,
    each trained by that teacher's objective, all reduced over the whole batch (``loss.teacher_balance``)."""
    from megatron.core import parallel_state as ps

    names = list(teachers)
    shares = teacher_shares(batch, routed, teachers, cfg.reduction, cfg.teacher_balance)
    micro_batches, weights = [], {}
    for part in routed.parts:
        sub = batch.select(part.rows)
        sub.seq_weights = sub.seq_weights * shares[part.name]
        weights[part.name] = getattr(part.scores, "output_weight", None)
        for mb in _micro_batches(sub, teacher_columns(part.scores, sub), ragged=True, **layout):
            mb["teacher"] = names.index(part.name)  # a plain int: which objective applies (kept off the device)
            micro_batches.append(mb)
    fused = all(fused_output_applies(t.loss) for t in teachers.values())
    output = HiddenStateOutput(student.model) if fused else None
    if output is not None and not output.exact:  # soft-capped final logits: the loss takes the logits
        output = None
    if output is not None:
        for mb in micro_batches:
            mb["trained_index"] = (mb["loss_mask"] != 0).reshape(-1).nonzero().reshape(-1)
    common = dict(vocab_size=vocab_size, normalizer=global_count(batch.loss_mask, cfg.reduction),
                  scale=len(micro_batches) * ps.get_data_parallel_world_size(), output=output,
                  grad_hint=_grad_hint(student, len(micro_batches)), sampling=sampling)  # fmt: skip
    loss_fns = [
        make_loss_fn(t.loss, teacher_temperature=t.temperature, teacher_weight=weights.get(name), **common)
        for name, t in teachers.items()
    ]

    def loss_fn(output_tensor: torch.Tensor, mb: dict):
        index = mb["teacher"]
        loss, stats = loss_fns[index](output_tensor, mb)
        return loss, stats.for_teacher(index, len(names))

    with output.active() if output is not None else contextlib.nullcontext():
        return student.step(micro_batches, loss_fn, guard, teachers=tuple(names), lr_scale=lr_scale)


def fused_output_applies(cfg: LossConfig) -> bool:
    """Whether the update forms its logits inside the loss (``Objective.fuses_output``)."""
    return objective_for(cfg).fuses_output
