"""On-policy distillation: the student samples, the teacher scores every token, the student learns.

    torchrun --nproc-per-node N [--nnodes M ...] -m megatron_opd.train --config FILE.yaml [key=value ...]
    python -m megatron_opd.train --help        # every config key with its default and what it does

Each step: take the next prompts, let the scheduler produce scored rollouts (rollout back end, then teacher back
end), turn the teacher's scores into a vocab-parallel divergence on the student's response tokens, and apply one
optimizer step. ``loss.kind=sft`` trains on the records' responses instead (no rollout, no teacher).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_opd import quiet
from megatron_opd.checkpoint.adapters import (
    adapter_entries,
    adapter_record,
    check_adapter_resume,
    load_adapters,
    saved_adapter_record,
)
from megatron_opd.checkpoint.mcore_io import chunks_sharded_state_dict
from megatron_opd.config import parse_args, to_dict
from megatron_opd.data.batch import pack_sft
from megatron_opd.data.prompts import PromptEncoder, load_prompts
from megatron_opd.data.routing import TeacherRouter
from megatron_opd.data.stream import PromptStream
from megatron_opd.distributed import destroy_distributed, initialize_distributed
from megatron_opd.faults import fault_point, hold_point
from megatron_opd.fused_libraries import log_fused_libraries
from megatron_opd.interfaces import SamplingParams
from megatron_opd.rollout.fidelity import (
    RolloutMismatchError,
    check_step,
    fidelity_metrics,
    policy_lag_warning,
    startup_check,
)
from megatron_opd.trainer.checkpointing import (
    CheckpointManager,
    PreemptionGuard,
    reseed_rng,
    set_rng_state,
    sharded_rng_state,
)
from megatron_opd.trainer.collapse import CollapseWatch
from megatron_opd.trainer.config import TrainConfig
from megatron_opd.trainer.evaluation import build_evaluator
from megatron_opd.trainer.lag_lr import lag_lr_scale
from megatron_opd.trainer.metrics import MetricsLogger
from megatron_opd.trainer.objective import TeacherObjective, global_count, objective_for, train_step
from megatron_opd.trainer.resharding import check_optimizer_state, current_layout, saved_layout
from megatron_opd.trainer.sequence_weights import import_function, sequence_weights
from megatron_opd.trainer.setup import (
    build_retokenizer,
    build_rollout,
    build_student,
    build_teacher,
    build_teachers,
    check_inputs,
    max_seq_len,
    sampling_params,
)
from megatron_opd.trainer.student import NonFiniteLossError, Student

logger = logging.getLogger("megatron_opd.train")


def training_state(
    student: Student,
    data_state: dict,
    step: int,
    cfg: TrainConfig,
    loading: bool,
    *,
    rng: bool = True,
    optimizer: bool = True,
    optimizer_format: str = "",
    collapse: CollapseWatch | None = None,
) -> dict:
    """Everything a resume needs, as one dist_checkpointing state dict (``data_state``: the prompt stream's
    position before the first batch not yet trained). ``rng`` / ``optimizer``: include those (a resume leaves out
    what the layout or ``checkpoint.load_optimizer`` cannot take; ``optimizer_format``: the distributed optimizer's
    format in the checkpoint being loaded); the layout is saved for the next resume, and ``collapse``'s state so that
    a resumed run's watch can stop it as soon as the uninterrupted run's would."""
    if not loading:
        student.finish_param_sync()  # the checkpoint (and the export read from it) holds the updated weights
    state = chunks_sharded_state_dict(student.chunks)
    if cfg.student.lora.enabled:  # adapters only: the frozen base is student.path's, reloaded at resume
        state = {key: adapter_entries(chunk_state) for key, chunk_state in state.items()}
    layout = current_layout(student)
    if optimizer:
        # fully_reshardable: the distributed optimizer's shards are gathered into one tensor per parameter, which
        # loads at any layout (0.16 defaults to fully_sharded_model_space, whose flattened ranges its torch_dist
        # saver refuses). A resume reads the format the checkpoint was written in (``optimizer_format``).
        metadata = {"distrib_optim_sharding_type": optimizer_format or layout.optimizer_format}
        state["optimizer"] = student.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    state["opt_param_scheduler"] = student.lr_schedule.state_dict()
    if rng:
        state["rng_state"] = sharded_rng_state()
    state["trainer"] = {"step": step, "data": data_state, "config": to_dict(cfg), "layout": layout.to_dict()}
    if collapse is not None:
        state["trainer"]["collapse"] = collapse.state_dict()
    if cfg.student.lora.enabled:
        state["trainer"]["adapters"] = adapter_record(cfg.student)
    return state


def resume(ckpt: CheckpointManager, student: Student, data: PromptStream, cfg: TrainConfig,
           collapse: CollapseWatch | None = None) -> int:  # fmt: skip
    """Load the latest checkpoint into the student, optimizer, schedule, RNG, data stream and collapse watch, at this
    run's layout whatever the checkpoint's; its step (0: fresh). A refused resume leaves the run folder's lock as it
    was. A checkpoint saved before the watch's state was (no ``trainer.collapse``) starts the watch afresh."""
    path = ckpt.latest() if cfg.checkpoint.resume else None
    if path is None:
        return 0
    with ckpt.starting():
        saved, current = saved_layout(path), current_layout(student)
        check_adapter_resume(saved_adapter_record(path), cfg.student, path)
        same_ranks, load_optimizer = saved.ranks() == current.ranks(), cfg.checkpoint.load_optimizer
        if load_optimizer:
            check_optimizer_state(saved, current, path)
            student.prepare_optimizer_for_loading()
        wanted = training_state(student, data.state_dict(), 0, cfg, loading=True, rng=same_ranks,
                                optimizer=load_optimizer, optimizer_format=saved.optimizer_format)  # fmt: skip
        state = ckpt.load(path, wanted)
        for i, chunk in enumerate(student.chunks):
            chunk_state = state["model" if len(student.chunks) == 1 else f"model{i}"]
            if cfg.student.lora.enabled:
                load_adapters(chunk, chunk_state, path)
            else:
                chunk.load_state_dict(chunk_state)
        if load_optimizer:
            student.load_optimizer_state(state["optimizer"])
        student.lr_schedule.load_state_dict(state["opt_param_scheduler"])
        data.load_state_dict(state["trainer"]["data"])
        if collapse is not None and "collapse" in state["trainer"]:
            collapse.load_state_dict(state["trainer"]["collapse"])
    step = int(state["trainer"]["step"])
    if same_ranks:
        set_rng_state(state["rng_state"])
    else:
        seed = reseed_rng(cfg.seed, step)
        if dist.get_rank() == 0:
            logger.warning(
                "resumed at %s from a checkpoint saved at %s: model%s resharded; the per-rank RNG states do not "
                "carry over, every stream is re-seeded from seed and step (%d)",
                current.describe(), saved.describe(), " and optimizer" if load_optimizer else "", seed,
            )  # fmt: skip
    logger.info("resumed from %s (step %d)", path, step)
    return step


def build_data(cfg: TrainConfig, encoder: PromptEncoder, files: list[str], key: str, max_prompt_len: int, batch: int):
    """The prompt stream of ``files``; for SFT, records whose prompt + response exceed the context are skipped."""
    from megatron.core import parallel_state as ps

    records, prompt_ids = load_prompts(files, encoder, key)
    if not objective_for(cfg.loss).samples:  # SFT trains on the records' responses
        fits = [
            len(ids) + len(encoder.response_ids(rec, where=f"{key} record {i}")) <= max_prompt_len + 1
            for i, (ids, rec) in enumerate(zip(prompt_ids, records))
        ]
        if not all(fits):
            logger.warning(
                "skipped %d of %d records of %s whose prompt + response is longer than %d tokens (never truncated)",
                fits.count(False), len(fits), key, max_prompt_len + 1,
            )  # fmt: skip
            records = [r for r, ok in zip(records, fits) if ok]
            prompt_ids = [p for p, ok in zip(prompt_ids, fits) if ok]
    return PromptStream(
        prompt_ids,
        records,
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
        global_batch=batch,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        max_prompt_len=max_prompt_len,
        key=key,
    )


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run ``cfg`` to ``train.steps`` (resuming from ``checkpoint.dir``); returns the last eval metrics."""
    cfg.validate()
    vocab = check_inputs(cfg)  # before any process group or model
    accel = initialize_distributed(cfg.parallel, None if cfg.device == "auto" else cfg.device, seed=cfg.seed)
    log_fused_libraries(cfg.build.use_transformer_engine, attention=cfg.build.attention)
    sft = not objective_for(cfg.loss).samples  # loss.kind=sft: the records' responses, no rollout, no teacher
    ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep_last)
    ckpt.acquire_lock()

    # ---- the pieces: models, back ends, data -------------------------------------------------------------------
    student = build_student(cfg, accel)
    teacher, teachers = build_teacher_backends(cfg, accel, vocab, student)
    rollout = build_sampler(cfg, student, vocab)
    seq_len = max_seq_len(cfg)
    encoder = PromptEncoder.for_data(vocab.tokenizer, cfg.data)
    prompt_room = seq_len - 1 if sft else seq_len - cfg.rollout.max_new_tokens
    data = build_data(cfg, encoder, cfg.data.train_files, "data.train_files", prompt_room, cfg.train.prompts_per_step)
    scheduler = None if sft else rollout_scheduler(cfg, vocab, rollout, teacher, data, seq_len, teachers)
    evaluator = build_evaluator(cfg, vocab, encoder, student, teacher, rollout, prompt_room, seq_len)
    reward_fn = import_function(cfg.loss.reward_fn, "loss.reward_fn") if cfg.loss.weighting == "reward" else None

    collapse = CollapseWatch.for_run(cfg.train, cfg.loss)
    start_step = resume(ckpt, student, data, cfg, collapse)
    student.finish_param_sync()  # before any reader of the weights (a no-op unless a step left a gather pending)
    rollout.sync_weights(start_step)
    max_logprob_diff = max_logprob_diff_for(cfg, student)
    if not sft and cfg.rollout.backend == "vllm" and cfg.rollout.startup_check:
        check_sampler_at_start(rollout, student, vocab.vocab_size, max_logprob_diff, seq_len)
    log = StepLog.open(cfg, start_step, collapse, sft)
    guard = PreemptionGuard()
    last_eval = evaluate(evaluator, log.metrics, 0) if start_step == 0 else {}

    # ---- the loop: rollout -> teacher -> update -> sync, then what each step leaves ------------------------------
    step, saved_step = start_step, start_step
    data_state = data.state_dict if sft else scheduler.data_state  # a resume redoes the rollouts in flight
    try:
        while step < cfg.train.steps:
            t_start = time.perf_counter()
            if sft:
                work = sft_batch(data, encoder, vocab.pad_token_id, seq_len)
            else:  # batch `step`: sampled and scored; rollouts run ahead per scheduler.mode
                work = scored_batch(scheduler.next_batch(step), cfg, encoder, vocab.tokenizer, reward_fn)
            t_update = time.perf_counter()
            result = update(student, work, cfg, vocab.vocab_size, max_logprob_diff, step, ckpt)
            step += 1
            t_sync = time.perf_counter()
            work.timings["update"] = t_sync - t_update
            sync_weights(student, rollout, step)
            work.timings["weight_sync"] = time.perf_counter() - t_sync
            log.record(step, result, work, time.perf_counter() - t_start)

            stop = guard.should_stop()  # SIGTERM: save this step, then leave
            if step == cfg.train.steps or stop or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                saved_step = save_checkpoint(ckpt, student, data_state(), step, cfg, collapse)
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                last_eval = evaluate(evaluator, log.metrics, step, student) or last_eval
            fault_points(step)
            if stop:
                log.metrics.write(f"SIGTERM: saved step {step}; resume by starting the same command again")
                break
    finally:
        log.close()
        rollout.close()  # the vLLM back end's engine process
        guard.restore()
    if cfg.export_hf and step == cfg.train.steps and saved_step == step:
        export_student(cfg, ckpt.dir / f"step_{step:08d}")
    ckpt.release_lock()
    destroy_distributed()
    return last_eval


def build_teacher_backends(cfg: TrainConfig, accel, vocab, student: Student) -> tuple:
    """``(teacher, teachers)``: the teacher back end (None for SFT), or with ``teachers.*`` each one's by name (each
    record's samples go to the one it names; ``teacher`` is then None)."""
    if cfg.teachers:
        return None, build_teachers(cfg, accel, vocab, student)
    return build_teacher(cfg, accel, vocab.teacher_vocab_size, student, vocab.teacher_fingerprint), None


def build_sampler(cfg: TrainConfig, student: Student, vocab):
    """The rollout back end; with ``scheduler.sync_delay`` (debug) it samples with the weights of that many steps
    ago."""
    rollout = build_rollout(cfg, student, vocab)
    if not cfg.scheduler.sync_delay:
        return rollout
    from megatron_opd.scheduler import DelayedSync

    params = [p for chunk in student.chunks for p in chunk.parameters()]
    return DelayedSync(rollout, params, cfg.scheduler.sync_delay)


def check_sampler_at_start(rollout, student: Student, vocab_size: int, max_logprob_diff: float, seq_len: int) -> None:
    """``rollout.startup_check``: the sampler scores a fixed sequence as the trainer does, or the run stops."""
    diffs = startup_check(rollout, student.chunks, vocab_size, max_logprob_diff, seq_len)
    logger.info("rollout start-up check passed: %s", ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))


def sync_weights(student: Student, rollout, step: int) -> None:
    """The sampler takes the updated weights: policy version ``step`` = optimizer steps applied (waits for the
    rollouts in flight)."""
    student.finish_param_sync()  # optim.overlap_param_gather: the weights the sync and the sampler read
    rollout.sync_weights(step)


def save_checkpoint(ckpt: CheckpointManager, student: Student, data_state: dict, step: int, cfg: TrainConfig,
                    collapse: CollapseWatch) -> int:  # fmt: skip
    """Save everything a resume at ``step`` needs (``training_state``); the step saved."""
    state = training_state(student, data_state, step, cfg, loading=False, collapse=collapse)
    ckpt.save(step, state, {"config": to_dict(cfg)})
    return step


def fault_points(step: int) -> None:
    """The fault-injection tests' points after a step (``megatron_opd.faults``; nothing unless armed)."""
    fault_point("kill_after_step", step)
    hold_point(step)


class StepLog:
    """What each step leaves besides the weights: its metrics row, the policy-lag warning (at most once per
    ``logging.log_every`` steps), the collapse watch (distillation) and, on rank 0, the audit trail of the data order
    and staleness (``batches.jsonl``; not for SFT)."""

    def __init__(self, cfg: TrainConfig, metrics: MetricsLogger, collapse: CollapseWatch, audit, sft: bool) -> None:
        self.cfg, self.metrics, self.collapse, self.audit, self.sft = cfg, metrics, collapse, audit, sft
        self.warned_at = -cfg.logging.log_every

    @classmethod
    def open(cls, cfg: TrainConfig, start_step: int, collapse: CollapseWatch, sft: bool) -> StepLog:
        rank = dist.get_rank()
        metrics = MetricsLogger(cfg.logging, cfg.output_dir, rank=rank, total_steps=cfg.train.steps,
                                start_step=start_step, run_config=to_dict(cfg))  # fmt: skip
        audit = open(Path(cfg.output_dir) / "batches.jsonl", "a") if rank == 0 and not sft else None
        return cls(cfg, metrics, collapse, audit, sft)

    def record(self, step: int, result, work: StepWork, elapsed: float) -> None:
        """Log finished step ``step``; the collapse watch raises once a collapse has held long enough."""
        row = step_row(result, work, step, elapsed, self.cfg)
        metrics, collapse, sft = self.metrics, self.collapse, self.sft
        metrics.log(step, row)
        lag_warning = policy_lag_warning(row, work.staleness, self.cfg.scheduler.warn_policy_lag)
        if lag_warning and step - self.warned_at >= self.cfg.logging.log_every:  # at most once per log_every steps
            metrics.write(f"WARNING step {step}: {lag_warning}")
            self.warned_at = step
        if not sft and (warning := collapse.update(step, row)):  # raises once the collapse has held long enough
            metrics.write(warning)
        if self.audit is not None:  # the audit trail of the data order and staleness (rank 0's prompts)
            self.audit.write(json.dumps({"step": step, "prompts": [it.index for it in work.items],
                                         "sampled_by": float(step - 1 - work.staleness)}) + "\n")  # fmt: skip
            self.audit.flush()

    def close(self) -> None:
        self.metrics.close()
        if self.audit is not None:
            self.audit.close()


def rollout_scheduler(cfg: TrainConfig, vocab, rollout, teacher, data: PromptStream, seq_len: int, teachers=None):
    """The scheduler that hands the loop its sampled and scored batches (``scheduler.mode``); ``teachers``: the
    back ends of ``teachers.*`` by name (``teacher`` is then None)."""
    from megatron.core import parallel_state as ps

    from megatron_opd.scheduler import build_scheduler

    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return build_scheduler(
        cfg.scheduler.mode,
        rollout,
        teacher,
        sampling=sampling_params(cfg, vocab),
        n=cfg.rollout.n,
        data=data,
        seed_for=lambda b: cfg.seed * 1_000_003 + b * dp_size + dp_rank,  # batch b's sampling seed
        pad_token_id=vocab.pad_token_id,
        max_len=seq_len,
        student_topk=cfg.loss.union_student_topk,  # loss.support=union: the rollout records the student's ids
        total_steps=cfg.train.steps,
        retokenizer=None if teachers else build_retokenizer(cfg, vocab),  # another tokenizer: its own tokens
        teachers=teachers,
        route=TeacherRouter.of(cfg),
    )


@dataclass
class StepWork:
    """What one step trains on: the batch, the teacher's scores (None for SFT) and the figures logged with it."""

    items: list
    batch: object
    scores: object | None
    staleness: int
    response_tokens: int
    tool_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    """The data path's figures (``cross_tokenizer/*``)."""


def sft_batch(data: PromptStream, encoder: PromptEncoder, pad_token_id: int, seq_len: int) -> StepWork:
    """``loss.kind=sft``: the next records' prompts and responses (no rollout, no teacher)."""
    items = data.next_batch()
    responses = [encoder.response_ids(it.record, where=f"record {it.index}") for it in items]
    batch = pack_sft([it.prompt_ids for it in items], responses, pad_token_id=pad_token_id, max_len=seq_len)
    return StepWork(items, batch, None, staleness=0, response_tokens=sum(len(r) for r in responses))


def scored_batch(scored, cfg: TrainConfig, encoder: PromptEncoder, tokenizer, reward_fn) -> StepWork:
    """A scheduler's batch with its sequence weights (``loss.weighting``)."""
    scored.batch.seq_weights = sequence_weights(cfg.loss, scored, scored.items, encoder, tokenizer, reward_fn)
    return StepWork(
        scored.items,
        scored.batch,
        scored.scores,
        staleness=scored.staleness,
        response_tokens=sum(scored.rollouts.response_lengths),
        tool_tokens=sum(int((m == 0).sum()) for m in scored.rollouts.response_mask),  # never in the loss
        timings=dict(scored.timings),
        metrics=scored.metrics,
    )


def update(student: Student, work: StepWork, cfg: TrainConfig, vocab_size: int, max_logprob_diff: float,
           step: int, ckpt: CheckpointManager):  # fmt: skip
    """One optimizer step on ``work``; a sampler that is not the model or a non-finite loss stops the run first."""

    def fidelity_guard(stats) -> None:
        check_step(fidelity_metrics(stats.as_dict()), max_logprob_diff, work.staleness)

    def lag_lr(stats) -> float:  # optim.lag_lr_target: a stale batch's step shortened by its policy lag
        lag = fidelity_metrics(stats.as_dict()).get("rollout/logprob_diff_mean")  # = staleness/policy_lag
        return lag_lr_scale(lag, work.staleness, cfg.optim.lag_lr_target)

    try:
        return train_step(
            student,
            work.batch,
            work.scores,
            cfg.loss,
            vocab_size=vocab_size,
            teacher_temperature=cfg.teacher.temperature,
            micro_batch_size=cfg.train.micro_batch_size,
            guard=fidelity_guard,
            packing=cfg.train.packing,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            teachers=teacher_objectives(cfg),
            lr_scale=lag_lr if cfg.optim.lag_lr_target else None,
            sampling=SamplingParams(
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k
            ),  # fmt: skip
        )
    except NonFiniteLossError as err:
        raise NonFiniteLossError(
            f"step {step + 1}: {err}; stopped without applying the update. The last checkpoint "
            f"({ckpt.latest() or 'none'}) is kept; lower optim.lr or check the data and the teacher"
        ) from None
    except RolloutMismatchError as err:
        raise RolloutMismatchError(
            f"step {step + 1} (sampled by policy version {step - work.staleness}): {err}. Stopped without applying "
            f"the update; the last checkpoint ({ckpt.latest() or 'none'}) is kept"
        ) from None


def teacher_objectives(cfg: TrainConfig) -> dict[str, TeacherObjective] | None:
    """``teachers.*``: each teacher's merged loss, temperature and weight, by name (None with one teacher)."""
    if not cfg.teachers:
        return None
    return {
        name: TeacherObjective(view.loss, view.teacher.temperature, cfg.teachers[name].loss.weight)
        for name, view in cfg.teacher_views().items()
    }


def teacher_rows(stats) -> dict[str, float]:
    """Per-teacher figures of a step (``teacher/NAME/...``; none with one teacher)."""
    row = {}
    for name, t in stats.teachers.items():
        if t.tokens:
            row[f"teacher/{name}/divergence"] = t.divergence_sum / t.tokens
        if t.top1_tokens:
            row[f"teacher/{name}/top1_agreement"] = t.agree_sum / t.top1_tokens
        row[f"teacher/{name}/tokens"] = t.tokens
        row[f"teacher/{name}/loss"] = t.loss
    return row


def step_row(result, work: StepWork, step: int, elapsed: float, cfg: TrainConfig) -> dict[str, float]:
    """The metrics row of a finished step (global over data-parallel ranks where counted)."""
    from megatron.core import parallel_state as ps

    samples = len(work.batch.lengths) * ps.get_data_parallel_world_size()
    s = result.stats
    response_tokens = global_count(torch.tensor([float(work.response_tokens)]), "sum")
    fidelity = fidelity_metrics(s.as_dict())  # rollout/logprob_diff_* etc.: is the sampler the trained model?
    if work.staleness or cfg.loss.staleness_correction != "off":  # the stale batch's lag and its weights
        if "rollout/logprob_diff_mean" in fidelity:
            fidelity["staleness/policy_lag"] = fidelity["rollout/logprob_diff_mean"]
    else:
        fidelity = {k: v for k, v in fidelity.items() if not k.startswith("staleness/")}
    if cfg.optim.lag_lr_target:  # every step, 1 where the batch is fresh or lags less than the target
        fidelity["staleness/lr_scale"] = result.lr_scale
    return {
        "loss": s.loss,
        "divergence": s.divergence_sum / max(s.tokens, 1.0),
        **({"top1_agreement": s.agree_sum / s.top1_tokens} if s.top1_tokens else {}),  # where the teacher has one
        "response_length": response_tokens / samples,
        "tokens_per_s": response_tokens / elapsed,
        "tool_tokens": global_count(torch.tensor([float(work.tool_tokens)]), "sum") / samples,  # never trained
        "time/step": elapsed,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "staleness": float(work.staleness),
        "sampled_by": float(step - 1 - work.staleness),  # policy version of the weights that sampled this batch
        **fidelity,
        **{f"time/{k}": v for k, v in work.timings.items()},
        **work.metrics,
        **teacher_rows(s),
        **result.router,
    }


def evaluate(evaluator, metrics: MetricsLogger, step: int, student: Student | None = None) -> dict[str, float]:
    """Run the held-out evaluation (if configured) and log it at ``step``; its metrics ({} without one). ``student``:
    its pending parameter gather is finished first (after a step)."""
    if student is not None:
        student.finish_param_sync()
    if evaluator is None:
        return {}
    out = evaluator.run()
    metrics.log(step, out, advance=False)
    metrics.write(("eval before training: " if step == 0 else f"eval after step {step}: ") + _fmt(out))
    return out


def export_student(cfg: TrainConfig, ckpt_dir: Path) -> None:
    """Write the final student as a Hugging Face folder ``output_dir/hf`` with the converter's library."""
    from megatron_opd.checkpoint.source import config_dir
    from megatron_opd.checkpoint.workers import run_in_fresh_process

    if dist.get_rank() == 0:
        out = Path(cfg.output_dir) / "hf"
        # A fresh process: the converter forms its own process group and must not disturb this job's.
        run_in_fresh_process(_export, str(ckpt_dir), str(out), str(config_dir(cfg.student.path)))
        logger.info("exported the trained model to %s (Hugging Face format)", out)
    dist.barrier()


def _export(ckpt_dir: str, out: str, hf_config_dir: str) -> None:
    from megatron_opd.checkpoint.lora_export import to_hugging_face

    quiet.install(rank=0, level=logging.WARNING)

    to_hugging_face(ckpt_dir, out, hf_config_dir=hf_config_dir, force=True)  # a LoRA student's: merged into its base


def max_logprob_diff_for(cfg: TrainConfig, student: Student) -> float:
    """``rollout.max_logprob_diff``, or its default for the trainer's and the sampler's dtypes."""
    from megatron_opd.rollout.fidelity import default_max_logprob_diff

    if cfg.rollout.max_logprob_diff is not None:
        return cfg.rollout.max_logprob_diff
    trainer_dtype = str(next(student.chunks[0].parameters()).dtype)
    sampler_dtype = cfg.rollout.vllm_dtype if cfg.rollout.backend == "vllm" else "auto"
    return default_max_logprob_diff(trainer_dtype, trainer_dtype if sampler_dtype == "auto" else sampler_dtype)


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k.split('/', 1)[-1]} {v:.4f}" for k, v in metrics.items())  # eval/NAME/accuracy: NAME/accuracy


def main(argv: list[str] | None = None) -> None:
    quiet.install()
    cfg = parse_args(TrainConfig, argv, description=__doc__.split("\n\n")[0])
    train(cfg)


if __name__ == "__main__":
    from megatron_opd.process_exit import exit_now

    main()
    exit_now(0)
