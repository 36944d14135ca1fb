"""``loss.*``: the per-token objective (a section of ``trainer.config.TrainConfig``; its checks against the other
sections are there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_opd.losses.importance import ROLLOUT_CORRECTIONS
from megatron_opd.losses.sampled import SAMPLED_CREDITS, SAMPLED_KINDS


@dataclass
class LossConfig:
    """The per-token objective."""

    kind: Literal["forward_kl", "reverse_kl", "jsd", "sft"] = "reverse_kl"
    """Divergence to the teacher, or ``sft``: cross-entropy on the records' ``response`` (no rollout, no teacher)."""
    beta: float = 0.5
    """Teacher weight in the JSD mixture (0: forward KL, 1: reverse KL limits)."""
    mode: Literal["dense", "topk", "sampled"] = "dense"
    """``dense``: full teacher logit shards (colocated teacher); ``topk``: the teacher's top-k ids + log-probs;
    ``sampled``: only the teacher's log-probability of each sampled token, the sampled reverse or forward KL
    (``losses.sampled``; every teacher back end can give it, also with another tokenizer)."""
    topk: int = 64
    """k for ``mode=topk``."""
    tail: Literal["bucket", "renorm", "ignore"] = "bucket"
    """Mass outside the support: one bucket (exact), renormalised away, or ignored (verl)."""
    support: Literal["teacher_topk", "union"] = "teacher_topk"
    """Ids the ``mode=topk`` loss is computed over: the teacher's top-k, or its union with the student's own top-k
    (TCAD; the rollout records the student's ids, the teacher request returns its log-probabilities at them)."""
    student_topk: int = 0
    """``support=union``: how many of the student's most probable ids join the support (0: ``loss.topk``)."""
    coverage_weight: float = 0.0
    """``mode=topk``: adds this times -log(student's mass on the support) per token (TCAD's coverage term; 0: off)."""
    reduction: Literal["token_mean", "sequence_mean", "sum"] = "token_mean"
    """How per-token losses become the step's loss (over the whole global batch)."""
    student_temperature: float = 1.0
    """The student's logits are divided by this inside the loss."""
    chunk_size: int | None = None
    """Tokens per loss chunk (memory bound; with the fused output layer also its logit block, where smaller costs
    time); None: automatic."""
    fused_output: Literal["auto", "on", "off"] = "auto"
    """The output layer fused into the divergence (``losses.fused_output``): the update's logits are formed a chunk
    of tokens at a time inside the loss and never held whole. ``auto``/``on``: every distillation loss (SFT keeps
    the output layer; ``on`` refuses it); ``off``: the output layer writes the whole logit shard first."""
    sampled_ratio_clip: float = 10.0
    """``loss.mode=sampled`` (and ``aligned``'s sampled positions) with ``loss.kind=forward_kl``: the importance
    weight ``p/q`` of a sampled token is capped at this (truncated importance sampling; 0: no cap). The cap bites
    only where the student gives a token less than 1/cap of the teacher's probability (rare under the student's
    sampling, but then one token would weigh as much as a batch)."""
    sampled_credit: Literal["token", "to_go"] = "token"
    """``loss.mode=sampled`` with ``loss.kind=reverse_kl`` (one tokenizer, or ``cross_tokenizer=sampled``): what
    weighs ``grad log q`` at each sampled token. ``token``: its own token's (group's) log-ratio ``log q - log p``, the
    fixed-prefix part of the sequence's divergence (the teacher's view of the later tokens is left out). ``to_go``:
    the sum of the log-ratios of its group and every later group of its sample (the reward to go), whose expected
    gradient is the whole sequence-level reverse KL's (docs/losses.md); choose it where the teacher's judgment of a
    token shows only later (across tokenizers, long answers), at the cost of a noisier weight. The logged divergence
    is the same either way. Not for ``forward_kl`` (a sequence-level forward KL needs the prefix's importance
    weights); keeps the output layer unfused (a sample's tokens must be in one pass)."""
    cross_tokenizer: Literal["off", "sampled", "aligned"] = "off"
    """A teacher with another tokenizer: ``sampled`` re-tokenizes each response for the teacher, aligns the two
    tokenizations by byte offsets and trains on the sampled divergence (``loss.kind`` reverse or forward KL) per
    aligned group (``loss.mode=sampled``; ``megatron_opd.cross_tokenizer``). ``aligned`` (``loss.mode=topk``): at
    each group's first position, the teacher's top-k mapped to the student token each teacher token begins with,
    with the top-k divergence (``loss.kind``, ``loss.tail``; unmapped teacher mass goes to the tail); other
    positions, and those where under half the top-k mass mapped, the sampled one of the same kind (reverse KL for
    ``jsd``). ``off``: the vocabulary check refuses a teacher with another tokenizer."""
    staleness_correction: Literal["off", "prefix"] = "off"
    """``prefix``: weight each token's loss by the truncated importance weight of the sampled prefix before it,
    ``min(prod_{s<t} pi_trainer(y_s) / pi_sampler(y_s), loss.staleness_clip)`` (``s <= t`` for ``loss.mode=sampled``),
    correcting the state distribution of batches sampled by older weights (``scheduler.mode`` one/two_step_off);
    1 for fresh batches. ``pi`` is the distribution the sampler draws from: with rollout.temperature / top_k / top_p
    the truncated one (the trainer's recomputed from its logits, one top-k merge and top-p search per step; the
    built-in sampler records the sampler's, the trainer's vLLM engine with one scoring pass more). Keeps the output
    layer unfused. See docs/training.md."""
    staleness_clip: float = 2.0
    """Upper clip of the prefix importance weights (logged as ``staleness/*`` either way)."""
    rollout_correction: Literal["off", "token_tis", "sequence_tis", "token_mis", "sequence_mis"] = "off"
    """Importance weights for the rollout-trainer gap at every staleness (``losses.importance``), from ``r_t =
    pi_trainer(y_t) / pi_sampler(y_t)`` (``pi`` as for ``staleness_correction``): ``token_tis`` weighs each token's
    loss by ``min(r_t, C)``, ``sequence_tis`` every token of a sample by ``min(prod_t r_t, C)``; ``token_mis`` /
    ``sequence_mis`` by ``r`` where ``r <= C`` and drop the token / sample otherwise (``C``:
    ``loss.rollout_correction_clip``). Costs one gather per token (plus the truncated recomputation, as above) and
    keeps the output layer unfused; off: weight 1."""
    rollout_correction_clip: float = 2.0
    """``C`` of ``loss.rollout_correction`` (>= 1: fresh tokens whose sampler agrees with the trainer keep weight 1)."""
    weighting: Literal["none", "reward", "teacher_confidence"] = "none"
    """Per-sequence weights: none, reward-weighted distillation, or TCAD teacher-confidence weights."""
    reward_fn: str | None = None
    """``module:function`` scoring (prompt, response, record) -> float, for ``weighting=reward``."""
    reward_transform: Literal["identity", "exp", "group_softmax"] = "group_softmax"
    """Reward -> weight: r itself, exp(r / T), or n * softmax(r / T) over the samples of each prompt."""
    weight_temperature: float = 1.0
    """T of the reward transform and of the teacher-confidence softmax."""
    teacher_balance: Literal["tokens", "per_teacher"] = "tokens"
    """With ``teachers.*``: ``tokens``: ``loss.reduction`` over the whole batch (each token counts the same, whichever
    teacher scored it); ``per_teacher``: each teacher's part of the batch weighs the same, however many tokens it
    has (each teacher's reduction, averaged over the teachers in the step; times ``teachers.NAME.loss.weight``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"loss.beta must be in [0, 1], got {self.beta}")
        if self.topk < 1:
            raise ValueError(f"loss.topk must be >= 1, got {self.topk}")
        if self.weighting == "reward" and not self.reward_fn:
            raise ValueError("loss.weighting=reward needs loss.reward_fn=module:function")
        if not self.weight_temperature > 0:
            raise ValueError(f"loss.weight_temperature must be > 0, got {self.weight_temperature}")
        if self.student_topk < 0:
            raise ValueError(f"loss.student_topk must be >= 0 (0: loss.topk), got {self.student_topk}")
        if not 0.0 <= self.coverage_weight < float("inf"):
            raise ValueError(f"loss.coverage_weight must be a finite number >= 0, got {self.coverage_weight}")
        if self.fused_output not in ("auto", "on", "off"):
            raise ValueError(f"loss.fused_output must be auto, on or off, got {self.fused_output!r}")
        if self.fused_output == "on" and self.kind == "sft":
            raise ValueError(
                "loss.fused_output=on fuses the output layer into a distillation divergence; loss.kind=sft keeps the "
                "logits: set loss.fused_output=auto or off"
            )
        if self.mode == "sampled" and self.kind not in (*SAMPLED_KINDS, "sft"):
            raise ValueError(
                f"loss.mode=sampled estimates the reverse or forward KL from the student's own samples; "
                f"loss.kind={self.kind} needs the teacher's distribution: set loss.kind=forward_kl or reverse_kl, or "
                "loss.mode=topk/dense"
            )
        if not 0.0 <= self.sampled_ratio_clip < float("inf"):
            raise ValueError(
                f"loss.sampled_ratio_clip must be a finite number >= 0 (0: no cap), got {self.sampled_ratio_clip}"
            )
        if self.sampled_credit not in SAMPLED_CREDITS:
            raise ValueError(f"loss.sampled_credit must be token or to_go, got {self.sampled_credit!r}")
        if self.sampled_credit == "to_go" and (self.mode != "sampled" or self.kind != "reverse_kl"):
            raise ValueError(
                f"loss.sampled_credit=to_go weighs each sampled token by the reverse KL's log-ratios of the rest of "
                f"its sample: set loss.mode=sampled and loss.kind=reverse_kl (got loss.mode={self.mode}, loss.kind="
                f"{self.kind}; the forward KL's sequence-level form would need the prefix's importance weights "
                "p(y_<=t)/q(y_<=t): keep loss.sampled_credit=token)"
            )
        if self.sampled_credit == "to_go" and self.fused_output == "on":
            raise ValueError(
                "loss.fused_output=on cannot be used with loss.sampled_credit=to_go (a sample's tokens must be in one "
                "chunk): set loss.fused_output=auto or off"
            )
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(
                f"loss.rollout_correction must be one of {', '.join(ROLLOUT_CORRECTIONS)}, got {self.rollout_correction!r}"
            )
        if not 1.0 <= self.rollout_correction_clip < float("inf"):
            raise ValueError(
                f"loss.rollout_correction_clip={self.rollout_correction_clip} must be a finite number >= 1 (a token "
                "whose sampler agrees with the trainer has weight 1)"
            )
        cross = self.cross_tokenizer
        if cross not in ("off", "sampled", "aligned"):
            raise ValueError(f"loss.cross_tokenizer must be off, sampled or aligned, got {cross!r}")
        if cross == "sampled" and (self.mode != "sampled" or self.kind not in SAMPLED_KINDS):
            raise ValueError(
                f"loss.cross_tokenizer=sampled compares aligned groups of tokens by their sampled log-probabilities: "
                f"set loss.mode=sampled and loss.kind=forward_kl or reverse_kl (got loss.mode={self.mode}, "
                f"loss.kind={self.kind}; "
                "for a top-k loss on the tokens both vocabularies share, loss.cross_tokenizer=aligned)"
            )
        if cross == "aligned" and (self.mode != "topk" or self.kind == "sft" or self.support != "teacher_topk"):
            raise ValueError(
                f"loss.cross_tokenizer=aligned maps the teacher's top-k to the student's ids: set loss.mode=topk, a "
                f"divergence loss.kind and loss.support=teacher_topk (got loss.mode={self.mode}, loss.kind={self.kind},"
                f" loss.support={self.support})"
            )
        if cross != "off" and self.weighting == "teacher_confidence":
            raise ValueError(
                "loss.weighting=teacher_confidence averages the teacher's per-token log-probabilities, which a "
                "teacher with another tokenizer gives per aligned group: use loss.weighting=none or reward"
            )
        if cross != "off" and self.fused_output == "on":
            raise ValueError(
                f"loss.fused_output=on cannot be used with loss.cross_tokenizer={cross} yet (a group's tokens must "
                "be in one chunk): set loss.fused_output=auto or off"
            )
        distilling_topk = self.kind != "sft" and self.mode == "topk"
        if self.support == "union" and not distilling_topk:
            raise ValueError(
                f"loss.support=union is a top-k distillation loss (got loss.kind={self.kind}, loss.mode={self.mode}): "
                "set loss.mode=topk with a divergence loss.kind, or loss.support=teacher_topk"
            )
        if self.coverage_weight and not distilling_topk:
            raise ValueError(
                f"loss.coverage_weight applies to top-k distillation (got loss.kind={self.kind}, loss.mode="
                f"{self.mode}; over the dense vocabulary it is 0): set loss.mode=topk or loss.coverage_weight=0"
            )

    @property
    def teacher_mode(self) -> Literal["dense", "topk"]:
        """What the teacher computes: ``mode``, except ``sampled``, which needs only the log-probability at each
        sampled token (the requested ids every teacher request carries; a top-1 comes along)."""
        return "topk" if self.mode == "sampled" else self.mode

    @property
    def teacher_topk(self) -> int:
        """The teacher's k: ``topk``, or 1 for ``mode=sampled``."""
        return 1 if self.mode == "sampled" else self.topk

    @property
    def union_student_topk(self) -> int:
        """The student's ids per token the rollout must record: ``student_topk or topk`` for the union, else 0."""
        return (self.student_topk or self.topk) if self.support == "union" else 0
