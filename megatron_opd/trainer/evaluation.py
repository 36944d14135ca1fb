"""Held-out evaluation: task accuracy and the per-token divergence to the teacher.

Two divergences are measured with the training objective (``trainer.objective``; none for ``loss.kind=sft``, which has
no teacher):
- on the student's own (greedy by default) samples of the eval prompts: what on-policy distillation minimises;
- on a fixed set of teacher-generated greedy responses (made once): comparable across checkpoints and runs.
Accuracy is the mean of ``eval.scorer(prompt, response, record)`` over the eval prompts, where configured.

Eval prompts are split over data-parallel ranks; sums are added over the world (each data-parallel replica
counts once: only its first tensor-parallel rank of the last pipeline stage contributes).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_opd.data.batch import TrainBatch, pack_rollouts
from megatron_opd.data.stream import PromptItem
from megatron_opd.distributed.device import collective_device
from megatron_opd.interfaces import RolloutBackend, SamplingParams
from megatron_opd.models.context_parallel import ContextParallelSplit
from megatron_opd.models.forward_backward import forward_backward
from megatron_opd.trainer.config import TrainConfig
from megatron_opd.trainer.loss_batch import LossBatch, split_for_context_parallel
from megatron_opd.trainer.objective import objective_for, teacher_columns

logger = logging.getLogger(__name__)


@dataclass
class EvalSet:
    """The eval prompts of this data-parallel rank."""

    items: list[PromptItem]
    prompt_texts: list[str]
    counted: bool = True
    """False on a rank with no eval prompts of its own: it evaluates another rank's first one, uncounted, so that
    every rank runs the same passes (MoE layers may exchange tokens across data-parallel ranks)."""


def _reporting_rank() -> bool:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0  # its sums are already the CP group's (``_divergence_sums``)
        and ps.is_pipeline_last_stage(ignore_virtual=True)
    )


def _all_reduce(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.cpu().tolist()


class Evaluator:
    """Measures the student on ``data.eval_files``; a collective (every rank calls ``run``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        eval_set: EvalSet,
        *,
        student_chunks: list,
        rollout: RolloutBackend,
        teacher,
        teacher_sampler: RolloutBackend | None,
        tokenizer,
        vocab_size: int,
        pad_token_id: int,
        stop_token_ids: tuple[int, ...],
        max_len: int,
        scorer=None,
        router=None,
    ) -> None:
        self.cfg = cfg
        self.eval_set = eval_set
        self.student_chunks = student_chunks
        self.rollout = rollout
        self.teacher = teacher
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.max_len = max_len
        self.scorer = scorer
        self.router = router
        """``teachers.*``: the accuracy is also reported per teacher (``eval/NAME/accuracy``) by the records' field."""
        self.sampling = SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.eval.temperature,
            stop_token_ids=stop_token_ids,
            seed=cfg.seed + 999_983,
        )
        self.teacher_batch: TrainBatch | None = None
        if teacher is not None and teacher_sampler is not None and cfg.eval.teacher_responses:
            greedy = dataclasses.replace(self.sampling, temperature=0.0)
            prompts = [item.prompt_ids for item in eval_set.items]
            rollouts = teacher_sampler.generate(prompts, greedy, 1).result()
            self.teacher_batch = pack_rollouts(rollouts, pad_token_id=pad_token_id, max_len=max_len)

    @torch.no_grad()
    def _divergence_sums(self, batch: TrainBatch, own: bool = True) -> tuple[float, float]:
        """Sum of per-token divergences over response tokens, and their count (on the reporting rank): the training
        objective's measure (``Objective.measure``) on the student's own samples, or on the teacher's (``own``)."""
        request = objective_for(self.cfg.loss).teacher_request
        # The sampled estimators read the teacher's log-probability of each token: ask for it.
        request_ids = batch.teacher_request_ids()[..., :1] if request.label_logprobs else None
        scores = self.teacher.score(batch.tokens, request_ids, lengths=batch.lengths).result()
        objective = objective_for(self.cfg.loss, vocab_size=self.vocab_size,
                                  teacher_temperature=self.cfg.teacher.temperature,
                                  teacher_weight=scores.output_weight)  # fmt: skip
        mbs = batch.num_samples
        extra = teacher_columns(scores)
        split = ContextParallelSplit.current()

        def measure(logits_BSV: torch.Tensor, mb: dict):
            d = objective.measure(logits_BSV, LossBatch.of(mb, split), teacher_samples=not own)
            mask = mb["loss_mask"] != 0
            return logits_BSV.new_zeros(()), (float(torch.where(mask, d, 0.0).sum()), float(mask.sum()))

        micro_batches = batch.micro_batches(mbs, extra)
        if split is not None:  # each CP rank measures its share of every sequence; the sums add up over them
            sp = self.student_chunks[0].config.sequence_parallel
            multiple = 2 * split.size * (self.student_chunks[0].config.tensor_model_parallel_size if sp else 1)
            micro_batches = [split_for_context_parallel(mb, split, pad_multiple=multiple) for mb in micro_batches]
        outputs = forward_backward(self.student_chunks, micro_batches, measure, forward_only=True)
        sums = (sum(o[0] for o in outputs), sum(o[1] for o in outputs)) if outputs else (0.0, 0.0)
        if split is not None and outputs:
            total = torch.tensor(sums, dtype=torch.float64, device=collective_device())
            torch.distributed.all_reduce(total, group=split.group)
            sums = (float(total[0]), float(total[1]))
        return sums

    def run(self) -> dict[str, float]:
        """Evaluate now; returns the metrics on every rank."""
        items = self.eval_set.items
        prompts = [item.prompt_ids for item in items]
        rollouts = self.rollout.generate(prompts, self.sampling, 1).result() if prompts else None
        correct = 0.0
        names = self.router.names if self.router is not None else []
        per_teacher = [0.0] * (2 * len(names))  # correct, prompts of each teacher
        if self.scorer is not None and rollouts is not None:
            for i, item in enumerate(items):
                response = self.tokenizer.decode(rollouts.response_ids[i].tolist(), skip_special_tokens=True)
                score = float(self.scorer(self.eval_set.prompt_texts[i], response, item.record))
                correct += score
                if names:
                    t = names.index(self.router(item.record))
                    per_teacher[2 * t] += score
                    per_teacher[2 * t + 1] += 1.0
        own = teacher_fixed = (0.0, 0.0)
        if self.teacher is not None and rollouts is not None:
            own = self._divergence_sums(pack_rollouts(rollouts, pad_token_id=self.pad_token_id, max_len=self.max_len))
            if self.teacher_batch is not None:
                teacher_fixed = self._divergence_sums(self.teacher_batch, own=False)
        length = float(sum(rollouts.response_lengths)) if rollouts is not None else 0.0
        mine = 1.0 if _reporting_rank() and self.eval_set.counted else 0.0
        sums = _all_reduce(
            [
                correct * mine,
                len(items) * mine,
                own[0] * mine,
                own[1] * mine,
                teacher_fixed[0] * mine,
                teacher_fixed[1] * mine,
                length * mine,
                *[v * mine for v in per_teacher],
            ]
        )
        out = {"eval/response_length": sums[6] / max(sums[1], 1.0)}
        if self.scorer is not None:
            out["eval/accuracy"] = sums[0] / max(sums[1], 1.0)
            for t, name in enumerate(names):
                if sums[8 + 2 * t]:
                    out[f"eval/{name}/accuracy"] = sums[7 + 2 * t] / sums[8 + 2 * t]
        if self.teacher is not None:
            out["eval/divergence_own_samples"] = sums[2] / max(sums[3], 1.0)
            if self.teacher_batch is not None:
                out["eval/divergence_teacher_samples"] = sums[4] / max(sums[5], 1.0)
        return out


def teacher_responses_skipped(cfg: TrainConfig, teacher) -> str | None:
    """Why ``eval.teacher_responses`` cannot run with this teacher (the one line logged instead), or None.

    The teacher's responses come from the built-in sampler on the teacher's own chunks: a remote teacher has none
    here, and the sampler does not decode across pipeline stages (at context parallelism each rank decodes whole
    sequences: ``models.context_parallel.whole_sequences``)."""
    if not hasattr(teacher, "chunks"):
        return "eval.teacher_responses needs the teacher's weights in this job: skipped with a remote teacher"
    pp = cfg.parallel.pipeline_model_parallel_size
    if pp > 1:
        return (
            f"eval.teacher_responses samples the in-process teacher with the built-in sampler, which needs "
            f"pipeline_model_parallel_size=1 (got {pp}): skipped; the divergence on the student's own samples is "
            "still measured"
        )
    return None


def build_evaluator(cfg: TrainConfig, vocab, encoder, student, teacher, rollout, prompt_room: int, seq_len: int):
    """The evaluator of ``data.eval_files`` (None without them); this data-parallel rank's share of the prompts."""
    from megatron.core import parallel_state as ps

    from megatron_opd.data.prompts import load_prompts
    from megatron_opd.data.routing import TeacherRouter
    from megatron_opd.rollout.builtin import BuiltinSampler
    from megatron_opd.trainer.sequence_weights import import_function

    if not cfg.data.eval_files:
        return None
    records, prompt_ids = load_prompts(cfg.data.eval_files, encoder, "data.eval_files")
    usable = [
        PromptItem(i, ids, rec) for i, (ids, rec) in enumerate(zip(prompt_ids, records)) if len(ids) <= prompt_room
    ]
    items = usable[: cfg.eval.max_prompts]
    mine = items[ps.get_data_parallel_rank() :: ps.get_data_parallel_world_size()]
    counted = bool(mine) or not items
    mine = mine or items[:1]
    teacher_sampler = None
    router = TeacherRouter.of(cfg)
    if router is not None:
        logger.info("evaluation with teachers.*: accuracy, overall and per teacher (eval/NAME/accuracy)")
        teacher = None
    elif objective_for(cfg.loss).cross_tokenizer:  # the teacher scores its own tokens: no per-token divergence here
        logger.info("evaluation with loss.cross_tokenizer: accuracy only (see cross_tokenizer/* in the step metrics)")
        teacher = None
    elif cfg.teacher.prompt_template is not None:  # the teacher's scores follow its own prompt, not the student's
        logger.info("evaluation with teacher.prompt_template: accuracy only (the teacher sees what the student lacks)")
        teacher = None
    if teacher is not None and cfg.eval.teacher_responses:
        if skipped := teacher_responses_skipped(cfg, teacher):
            logger.info("%s", skipped)
        else:
            teacher_sampler = BuiltinSampler(
                teacher.chunks, vocab_size=vocab.vocab_size, max_seq_len=seq_len, pad_token_id=vocab.pad_token_id
            )
    return Evaluator(
        cfg,
        EvalSet(mine, [encoder.prompt_text(it.record) for it in mine], counted),
        student_chunks=student.chunks,
        rollout=rollout,
        teacher=teacher,
        teacher_sampler=teacher_sampler,
        tokenizer=vocab.tokenizer,
        vocab_size=vocab.vocab_size,
        pad_token_id=vocab.pad_token_id,
        stop_token_ids=vocab.stop_token_ids,
        max_len=seq_len,
        scorer=import_function(cfg.eval.scorer, "eval.scorer") if cfg.eval.scorer else None,
        router=router,
    )
