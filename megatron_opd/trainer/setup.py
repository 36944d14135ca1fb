"""Build what the training loop calls: tokenizers and the vocabulary check, student, teacher, rollout, data.

Each builder reads its section of the config and returns one object; ``train.py`` wires them together.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatron_opd.checkpoint.source import build_and_load, config_dir, load_output_weight, model_architecture
from megatron_opd.distributed.device import Accelerator
from megatron_opd.interfaces import SamplingParams
from megatron_opd.models import rope
from megatron_opd.models.families import family_named
from megatron_opd.trainer.config import TrainConfig
from megatron_opd.trainer.objective import objective_for
from megatron_opd.trainer.student import PrecisionPlan, Student, precision_plan

logger = logging.getLogger(__name__)


@dataclass
class Vocabulary:
    """The student's tokenizer and the facts every path shares (from the one vocabulary check)."""

    tokenizer: object
    vocab_size: int
    """Real tokens (ids below it); padded embedding rows are never sampled, scored or trained."""
    pad_token_id: int
    stop_token_ids: tuple[int, ...]
    """The tokenizer's EOS, every EOS id of generation_config.json, and rollout.stop_token_ids."""
    tokenizer_dir: Path
    teacher_fingerprint: str | None = None
    """Remote teachers: the checked vocabulary's fingerprint, which every replica must serve."""
    teacher_tokenizer: object | None = None
    """``loss.cross_tokenizer``: the teacher's own tokenizer (None: the teacher shares the student's)."""
    teachers: dict[str, Vocabulary] = field(default_factory=dict)
    """With ``teachers.*``: each teacher's vocabulary check (its fingerprint and tokenizer), by name."""

    @property
    def teacher_vocab_size(self) -> int:
        """Real tokens of the teacher's vocabulary."""
        return self.vocab_size if self.teacher_tokenizer is None else len(self.teacher_tokenizer)


def check_vllm_models(cfg: TrainConfig, views: dict) -> None:
    """Refuse a model vLLM would compute as another one (``ModelFamily.check_vllm_config``) before any model: the
    student with ``rollout.backend=vllm``, a teacher with ``teacher.backend=vllm`` and a ``teacher.path``."""
    from megatron_opd.checkpoint.source import config_dir
    from megatron_opd.rollout.vllm_engine import check_vllm_config

    if cfg.rollout.backend == "vllm":
        check_vllm_config(str(config_dir(cfg.student.path, "student.path")), "rollout.backend=vllm")
    for name, view in views.items():
        if view.teacher.backend == "vllm" and view.teacher.path:
            where = "teacher" if view is cfg else f"teachers.{name}"
            check_vllm_config(str(config_dir(view.teacher.path, f"{where}.path")), f"{where}.backend=vllm")


def check_inputs(cfg: TrainConfig) -> Vocabulary:
    """The refusals that read files but need no model, run on every rank before any process group or model: the
    layout splits the student (and the in-process teacher, built at the same layout), the data files are there,
    and the vocabulary check (its result is returned)."""
    from megatron_opd.data.records import check_paths
    from megatron_opd.models.builder import check_shared_expert_overlap, check_window_context_parallel, validate_layout

    student = model_architecture(cfg.student.path, "student.path")
    validate_layout(student, cfg.parallel)
    cp = cfg.parallel.context_parallel_size
    check_window_context_parallel(student, cp, max_seq_len(cfg), "student.path")
    check_packed_attention(cfg, student, f"student.path={cfg.student.path}")
    check_soft_capped(cfg, student, f"student.path={cfg.student.path}", student_model=True)
    if cfg.student.lora.enabled:  # every rank refuses alike, not one pipeline stage while building its layers
        from megatron_opd.models.lora import check_lora_targets

        check_lora_targets(student, cfg.student.lora, cfg.parallel.stage_layer_indices(student.num_layers))
    check_shared_expert_overlap(cfg.build, cfg.parallel, student, f"the student ({cfg.student.path})")
    if cfg.train.freeze_router and student.moe is None:
        raise ValueError(
            f"train.freeze_router=true, but the student ({cfg.student.path}) has no Mixture-of-Experts layer and so "
            "no router; remove train.freeze_router"
        )
    sigmoid_bias = student.moe is not None and (
        (student.moe.expert_bias and student.moe.score_function == "sigmoid")
        or (student.routing is not None and student.routing.expert_bias and student.routing.score_function == "sigmoid")
    )
    if cfg.build.moe_router_bias_update_rate > 0 and not sigmoid_bias:
        raise ValueError(
            f"build.moe_router_bias_update_rate={cfg.build.moe_router_bias_update_rate}, but the student "
            f"({cfg.student.path}) has no sigmoid router with an expert bias to update (DeepSeek-V3, GLM-4.5, MiniMax-M2); set "
            "it to 0 (build.moe_aux_loss_coeff balances other Mixture-of-Experts students)"
        )
    views = cfg.teacher_views() if cfg.teachers else {"teacher": cfg}
    for name, view in views.items():
        objective = objective_for(view.loss)
        if objective.needs_teacher and view.teacher.backend == "inprocess":
            where = "teacher.path" if view is cfg else f"teachers.{name}.path"
            teacher = model_architecture(view.teacher.path, where)
            validate_layout(teacher, cfg.parallel)
            check_packed_attention(cfg, teacher, f"{where}={view.teacher.path}")
            check_soft_capped(cfg, teacher, f"{where}={view.teacher.path}")
            if view.teacher.cuda_graphs:
                from megatron_opd.distributed.device import detect_accelerator
                from megatron_opd.teacher.graphs import check_capturable

                knob = where.replace(".path", ".cuda_graphs")
                check_capturable(teacher, cfg.build.moe_fused_routing, knob)
                if (kind := detect_accelerator(cfg.device).type) != "cuda":
                    raise ValueError(f"{knob}=true needs a CUDA device, and this run's is {kind}: set it to false")
            # The teacher scores the student's sequences; in its own tokens (loss.cross_tokenizer), up to its context.
            own = objective.cross_tokenizer
            check_window_context_parallel(teacher, cp, teacher.max_position_embeddings if own else max_seq_len(cfg),
                                          where)  # fmt: skip
    check_vllm_models(cfg, views)
    check_micro_batch_tokens(cfg)
    check_paths(cfg.data.train_files, "data.train_files")
    for name, view in views.items():  # every record must have the fields a teacher's own prompt names
        template = view.teacher.prompt_template
        if template is not None and objective_for(view.loss).needs_teacher:
            from megatron_opd.data.teacher_prompt import check_records

            where = "teacher" if view is cfg else f"teachers.{name}"
            try:
                check_records(template, cfg.data.train_files, "data.train_files")
            except ValueError as err:
                raise type(err)(str(err).replace("teacher.prompt_template", f"{where}.prompt_template")) from None
    if cfg.data.eval_files:
        check_paths(cfg.data.eval_files, "data.eval_files")
    # The in-process teacher (at most one) is the one the estimate places beside the student.
    check_memory(next((v for v in views.values() if v.teacher.backend == "inprocess"), cfg))
    if not cfg.teachers:
        vocab = load_vocabulary(cfg)
        check_first_records(cfg, vocab)
        return vocab
    from megatron_opd.data.routing import TeacherRouter

    router = TeacherRouter.of(cfg)
    counts = router.check_files(cfg.data.train_files, "data.train_files")
    if cfg.data.eval_files:
        router.check_files(cfg.data.eval_files, "data.eval_files")
    logger.info("training records per teacher: %s", counts)
    vocab = teachers_vocabulary(views)
    check_first_records(cfg, vocab)
    return vocab


def check_first_records(cfg: TrainConfig, vocab: Vocabulary) -> None:
    """Each data file's first record encodes with the student's tokenizer (a chat record needs a chat template, an
    SFT record its response), and with each cross-tokenizer teacher's, which re-tokenizes the prompts: the refusals
    users otherwise meet only after every model is built."""
    from megatron_opd.data.prompts import PromptEncoder
    from megatron_opd.data.records import first_records

    encoders = {"student.path": PromptEncoder.for_data(vocab.tokenizer, cfg.data)}
    views = cfg.teacher_views() if cfg.teachers else {"teacher": cfg}
    for name, view in views.items():
        v = vocab.teachers[name] if cfg.teachers else vocab
        if objective_for(view.loss).cross_tokenizer and v.teacher_tokenizer is not None:
            where = "teacher.tokenizer" if view is cfg else f"teachers.{name}.tokenizer"
            encoders[where] = PromptEncoder.for_data(v.teacher_tokenizer, cfg.data)
    on_records = not objective_for(cfg.loss).samples  # SFT trains on the records' responses
    for key in ("data.train_files", "data.eval_files"):
        paths = getattr(cfg.data, key.split(".")[1])
        for path, record in first_records(paths, key) if paths else ():
            for model, encoder in encoders.items():
                where = f"{path} record 0 (the tokenizer of {model})"
                encoder.prompt_ids(record, where=where)
                if on_records and key == "data.train_files":
                    encoder.response_ids(record, where=where)


def check_micro_batch_tokens(cfg: TrainConfig) -> None:
    """Refuse a ``train.micro_batch_tokens`` shorter than the longest sample the run can produce: a packed
    micro-batch holds whole samples, so the first such sample would stop the run mid-way. The budget applies with
    packing at pipeline parallelism only; the longest sample is ``max_seq_len`` (the prompt room plus
    ``rollout.max_new_tokens``; for SFT the prompt plus its response), which every sample and the in-process
    teacher's view of it (same tokenizer) fit."""
    tokens = cfg.train.micro_batch_tokens
    if tokens is None or not cfg.train.packing or cfg.parallel.pipeline_model_parallel_size == 1:
        return
    longest = max_seq_len(cfg)
    if tokens < longest:
        tp = cfg.parallel.tensor_model_parallel_size
        source = f"train.max_seq_len={cfg.train.max_seq_len}" if cfg.train.max_seq_len else "the student's context"
        what = "prompt and response" if not objective_for(cfg.loss).samples else (
            f"prompt room {longest - cfg.rollout.max_new_tokens} + rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
        )  # fmt: skip
        raise ValueError(
            f"train.micro_batch_tokens={tokens} is shorter than the longest sample this run can produce: {longest} "
            f"tokens ({source}: {what}), which would stop the run at the first such sample; raise it to at least "
            f"{-(-longest // tp) * tp}, lower train.max_seq_len, or unset it (null: micro_batch_size x the step's "
            "longest sample)"
        )


def check_soft_capped(cfg: TrainConfig, arch, where: str, student_model: bool = False) -> None:
    """Refuse what soft-capped logits (Gemma 2) cannot run: capped attention scores on Megatron's local attention
    (only ``build.attention=sdpa`` caps them), and a student's fused output-layer loss (its hidden states times the
    output weight are not its capped logits; ``loss.fused_output=auto`` then keeps the logits)."""
    if arch.attn_logit_softcapping is not None and cfg.build.attention != "sdpa":
        raise ValueError(
            f"build.attention={cfg.build.attention}: the {arch.family} model of {where} soft-caps its attention "
            f"logits (config.json attn_logit_softcapping={arch.attn_logit_softcapping}), which only "
            "build.attention=sdpa does; set build.attention=sdpa"
        )
    if student_model and arch.final_logit_softcapping is not None and cfg.loss.fused_output == "on":
        raise ValueError(
            f"loss.fused_output=on: the {arch.family} model of {where} soft-caps its final logits (config.json "
            f"final_logit_softcapping={arch.final_logit_softcapping}), which the fused output-layer loss does not; "
            "set loss.fused_output=auto (the loss then takes the logits) or off"
        )


def check_packed_attention(cfg: TrainConfig, arch, where: str) -> None:
    """Refuse packed sequences on Megatron's local attention for a family that always builds the local layer spec:
    ``validate`` lets ``build.attention=local`` pack with ``build.use_transformer_engine=true`` (TE's attention
    separates the sequences), but such a family keeps the local spec, whose attention fails at the first forward."""
    b = cfg.build
    if (
        cfg.train.packing
        and b.attention == "local"
        and b.use_transformer_engine
        and family_named(arch.family).local_spec_only
    ):
        raise ValueError(
            f"train.packing=true with build.use_transformer_engine=true and build.attention=local: the "
            f"{arch.family} model of {where} always runs Megatron's local layer spec (TransformerEngine's layers do "
            "not apply to it), whose local attention cannot separate packed sequences; set build.attention=sdpa "
            "(or train.packing=false)"
        )


def teachers_vocabulary(views: dict[str, TrainConfig]) -> Vocabulary:
    """``teachers.*``: the vocabulary check of each teacher against the student; the student's facts, with each
    teacher's result in ``Vocabulary.teachers``."""
    per = {}
    for name, view in views.items():
        try:
            per[name] = load_vocabulary(view)
        except ValueError as err:
            raise ValueError(f"teachers.{name}: {err}") from None
    first = next(iter(per.values()))
    sizes = {name: v.vocab_size for name, v in per.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the teachers' vocabulary checks give the student different vocabulary sizes {sizes}")
    return replace(first, teacher_fingerprint=None, teacher_tokenizer=None, teachers=per)


def device_memory_gib(accel_type: str) -> float | None:
    """This process's accelerator memory in GiB (None on CPU)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if accel_type == "cuda":
        return torch.cuda.get_device_properties(local_rank).total_memory / (1 << 30)
    if accel_type == "npu":
        return torch.npu.get_device_properties(local_rank).total_memory / (1 << 30)  # type: ignore[attr-defined]
    return None


def _device_type(cfg: TrainConfig) -> str:
    from megatron_opd.distributed.device import detect_accelerator

    return detect_accelerator(None if cfg.device == "auto" else cfg.device).type


def check_memory(cfg: TrainConfig) -> None:
    """The start-up memory check (``trainer/memory.py``) before any weight is loaded: log each device's estimated
    peak, and refuse a run whose fullest device exceeds its memory unless ``train.skip_memory_check``."""
    from megatron_opd.trainer.memory import MemoryCheckError, check_trainer_memory

    accel_type = _device_type(cfg)
    device_gib = cfg.train.device_memory_gib or device_memory_gib(accel_type)
    if not device_gib and int(os.environ.get("RANK", 0)) != 0:
        return  # nothing to check against (CPU): only rank 0 logs the estimate, the others skip building it
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        peak, table = check_trainer_memory(cfg, world_size, accel_type, device_gib)
    except MemoryCheckError:
        if not cfg.train.skip_memory_check:
            raise
        logger.warning("train.skip_memory_check=true: starting although the estimate exceeds the device", exc_info=True)
        return
    except Exception as err:  # noqa: BLE001 - a model the estimate cannot place: say so, never block the run on it
        logger.warning("memory check skipped, the estimate failed: %r", err)
        return
    if int(os.environ.get("RANK", 0)) == 0:
        logger.info("estimated peak per device %.2f GiB%s\n%s", peak.total / (1 << 30),
                    f" of {device_gib:g}" if device_gib else "", table)  # fmt: skip


def load_vocabulary(cfg: TrainConfig) -> Vocabulary:
    """Load the student's (and teacher's) tokenizer and run the one vocabulary check.

    Any format :mod:`megatron_opd.tokenizer` reads: ``tokenizer.json``, or a SentencePiece / tiktoken
    ``tokenizer.model`` (converted so it tokenizes exactly as sentencepiece / tiktoken do).
    """
    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.vocab import check_rows, check_vocab, eos_token_ids, tokenizer_dir

    student_tok_dir = (
        Path(cfg.student.tokenizer) if cfg.student.tokenizer else tokenizer_dir(cfg.student.path, "student.path")
    )
    tokenizer = load_tokenizer(student_tok_dir, "student.tokenizer")
    student_rows = model_architecture(cfg.student.path, "student.path").vocab_size
    vocab_size = len(tokenizer)
    if vocab_size > student_rows:
        raise ValueError(
            f"student tokenizer ({student_tok_dir}) has {vocab_size} tokens but the student's embedding "
            f"(student.path={cfg.student.path}) only {student_rows} rows; they do not belong together"
        )
    teacher_fingerprint, teacher_own = None, None
    objective = objective_for(cfg.loss)
    cross = objective.cross_tokenizer
    if cross and cfg.teacher.backend in ("vllm", "server"):
        # The trainer tokenizes for the teacher with its files: they must be the tokenizer the server runs (vLLM's
        # transport confirms them against its /tokenize; a teacher server's summary must have their fingerprint).
        client = remote_client(cfg)
        try:
            _, info = client.vocabulary()
        finally:
            client.close()
        teacher_fingerprint = info.vocab_fingerprint
        teacher_own = _teacher_tokenizer(cfg)
        from megatron_opd.teacher.vocabulary import fingerprint, tokenizer_summary

        if cfg.teacher.backend == "server" and fingerprint(tokenizer_summary(teacher_own)) != teacher_fingerprint:
            t = cfg.teacher
            where = f"teacher.tokenizer={t.tokenizer}" if t.tokenizer else f"teacher.path={t.path}"
            raise ValueError(
                f"the tokenizer of {where} is not the one teacher server {cfg.teacher.address} serves (vocabulary "
                f"fingerprints differ): point it at the folder of the model the server runs"
            )
    elif cross:  # another tokenizer by design: no id-by-id check, only that its ids have embedding rows
        teacher_own = _teacher_tokenizer(cfg)
        rows = model_architecture(cfg.teacher.path, "teacher.path").vocab_size
        check_rows(len(teacher_own), rows, "teacher", f"teacher.path={cfg.teacher.path}")
    elif objective.needs_teacher and cfg.teacher.backend in ("server", "vllm"):
        # A teacher server sends its tokenizer summary at connect; a vLLM server's is read from teacher.tokenizer
        # and confirmed against its /tokenize. The same check runs on it.
        client = remote_client(cfg)
        try:
            teacher_tokenizer, info = client.vocabulary()
        finally:
            client.close()
        vocab_size = check_vocab(
            teacher_tokenizer,
            tokenizer,
            teacher_name=f"teacher.address={cfg.teacher.address}",
            student_name=f"student.path={cfg.student.path}",
            teacher_embedding_rows=info.embedding_rows,
            student_embedding_rows=student_rows,
        )
        teacher_fingerprint = info.vocab_fingerprint
    elif objective.needs_teacher:
        teacher_tok_dir = (
            Path(cfg.teacher.tokenizer) if cfg.teacher.tokenizer else tokenizer_dir(cfg.teacher.path, "teacher.path")
        )
        teacher_tokenizer = load_tokenizer(teacher_tok_dir, "teacher.tokenizer")
        vocab_size = check_vocab(
            teacher_tokenizer,
            tokenizer,
            teacher_name=f"teacher.path={cfg.teacher.path}",
            student_name=f"student.path={cfg.student.path}",
            teacher_embedding_rows=model_architecture(cfg.teacher.path, "teacher.path").vocab_size,
            student_embedding_rows=student_rows,
        )
    stops = set(eos_token_ids(config_dir(cfg.student.path, "student.path"), tokenizer))
    stops.update(cfg.rollout.stop_token_ids)
    if not stops:
        raise ValueError(
            f"the student's tokenizer ({student_tok_dir}) has no EOS token and rollout.stop_token_ids is empty: "
            "responses could never end; set rollout.stop_token_ids"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    return Vocabulary(
        tokenizer, vocab_size, int(pad), tuple(sorted(stops)), student_tok_dir, teacher_fingerprint, teacher_own
    )


def build_student(cfg: TrainConfig, accel: Accelerator) -> Student:
    """The student's chunks under ``cfg.parallel``, loaded from ``student.path``, with optimizer and schedule."""
    plan = resolve_precision(cfg, accel)
    arch, chunks = build_and_load(cfg.student.path, cfg.parallel, cfg.build, trainable=True, field="student.path")
    if cfg.student.lora.enabled:  # before DDP and the optimizer, which then hold the adapters only
        from megatron_opd.models.lora import add_lora

        adapted = add_lora(chunks, cfg.student.lora, seed=cfg.seed, arch=arch)
        logger.info(
            "student.lora: rank-%d adapters on %d layers of this rank; the base frozen", cfg.student.lora.rank, adapted
        )
    return Student(chunks, cfg.optim, plan, cfg.train.steps, freeze_router=cfg.train.freeze_router)


def resolve_precision(cfg: TrainConfig, accel: Accelerator) -> PrecisionPlan:
    """The precision plan, and the one rule for parameter dtypes: the student and the in-process teacher are built
    at ``build.dtype``. ``auto`` becomes the plan's dtype (``optim.bf16``, by default on for a GPU/NPU); a set
    ``build.dtype`` decides ``optim.bf16`` when that is unset (``validate`` refuses a contradiction)."""
    optim = cfg.optim
    if cfg.build.dtype != "auto" and optim.bf16 is None:
        optim = replace(optim, bf16=cfg.build.dtype == "bf16")
    plan = precision_plan(optim, accel)
    if cfg.build.dtype not in ("auto", plan.params_dtype):
        raise ValueError(
            f"build.dtype={cfg.build.dtype} contradicts optim.bf16={str(optim.bf16).lower()}: the student's parameters "
            "are the optimizer's; set one of them (or build.dtype=auto to follow optim.bf16)"
        )
    cfg.build.dtype = plan.params_dtype  # resolved: the teacher, and its output weight's shard, read it too
    return plan


def build_teacher(
    cfg: TrainConfig, accel: Accelerator, vocab_size: int, student: Student, teacher_fingerprint: str | None = None
):
    """The teacher back end of ``teacher.backend`` (None for ``loss.kind=sft``)."""
    request = objective_for(cfg.loss).teacher_request
    if request is None:
        return None
    if cfg.teacher.backend in ("server", "vllm"):
        return build_remote_teacher(cfg, teacher_fingerprint, student, vocab_size)
    from megatron_opd.teacher.inprocess import InProcessTeacher

    device = accel.device(torch.cuda.current_device() if accel.type == "cuda" else 0)
    graphs = None
    if cfg.teacher.cuda_graphs:  # refused off CUDA before the teacher is built
        from megatron_opd.teacher.graphs import bucketed_teacher_forward

        graphs = bucketed_teacher_forward(cfg.teacher.cuda_graph_lengths, cfg.train.micro_batch_size, device)
    _, chunks = build_and_load(cfg.teacher.path, cfg.parallel, cfg.build, trainable=False, field="teacher.path")
    student_width, teacher_width = student.chunks[-1].vocab_size, chunks[-1].vocab_size
    if request.dense and student_width != teacher_width:
        raise ValueError(
            f"loss.mode=dense needs the student's and teacher's logit shards to line up, but their padded "
            f"vocabularies differ ({student_width} vs {teacher_width} columns); use loss.mode=topk"
        )
    teacher = InProcessTeacher(
        chunks,
        vocab_size=vocab_size,
        mode=request.mode,
        topk=request.topk,
        temperature=cfg.teacher.temperature,
        micro_batch_size=cfg.train.micro_batch_size,
        offload=cfg.teacher.offload,
        device=device,
        packing=cfg.train.packing,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        graphs=graphs,
    )
    check_teacher_mode(teacher, cfg.loss.mode)
    return teacher


def remote_client(cfg: TrainConfig, teacher_fingerprint: str | None = None):
    """The fault-tolerant client of ``teacher.address``, configured from ``teacher.*``: ZeroMQ to teacher servers,
    HTTP to vLLM servers."""
    from megatron_opd.config import comma_list
    from megatron_opd.teacher.client import TeacherClient
    from megatron_opd.teacher.serve import read_token
    from megatron_opd.teacher.transport import split_addresses

    t = cfg.teacher
    token = read_token(t.token_file) or b""
    if t.backend == "vllm":
        from megatron_opd.rollout.vllm_engine import check_vllm_config
        from megatron_opd.teacher.vllm_transport import VLLMTransportFactory

        if t.path:  # a config.json vLLM would read as another model (the family's check)
            check_vllm_config(t.path)

        factory = VLLMTransportFactory(
            _teacher_tokenizer(cfg),
            topk=cfg.loss.teacher_topk,
            embedding_rows=model_architecture(t.path, "teacher.path").vocab_size if t.path else None,
            api_key=token.decode(),
            max_batch_tokens=t.max_batch_tokens,
            max_message_bytes=t.max_message_bytes,
            tokenizer_name="teacher.tokenizer" if t.tokenizer else "teacher.path",
        )
        addresses = comma_list(t.address)  # URLs: checked by the vLLM transport
    else:
        from megatron_opd.teacher.zmq_transport import ZmqTransportFactory

        factory = ZmqTransportFactory(token=token, max_message_bytes=t.max_message_bytes)
        addresses = split_addresses(t.address)
    return TeacherClient(
        addresses,
        factory,
        topk=cfg.loss.teacher_topk,
        temperature=t.temperature,
        wire_dtype=t.wire_dtype,
        timeout_s=t.timeout_s,
        retries=t.retries,
        backoff_s=t.backoff_s,
        backoff_max_s=t.backoff_max_s,
        connect_timeout_s=t.connect_timeout_s,
        max_message_bytes=t.max_message_bytes,
        expected_fingerprint=teacher_fingerprint,
        transfer=t.transfer,
    )


def _teacher_tokenizer(cfg: TrainConfig):
    """The teacher's tokenizer from its files: ``teacher.tokenizer``, else the one beside ``teacher.path``."""
    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.vocab import tokenizer_dir

    t = cfg.teacher
    folder = Path(t.tokenizer) if t.tokenizer else tokenizer_dir(t.path, "teacher.path")
    return load_tokenizer(folder, "teacher.tokenizer")


def build_remote_teacher(cfg: TrainConfig, teacher_fingerprint: str | None, student: Student, vocab_size: int):
    """``teacher.backend=server|vllm``: the first TP rank of the last pipeline stage asks, its TP group shares the
    scores (with ``teacher.transfer=hidden``, each rank also holds its shard of the teacher's output layer)."""
    from megatron.core import parallel_state as ps

    from megatron_opd.teacher.capabilities import declared
    from megatron_opd.teacher.shared import GroupSharedTeacher

    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    full_VH = None
    if cfg.teacher.transfer == "hidden":  # every rank: a collective for a dist_ckpt
        full_VH = load_output_weight(cfg.teacher.path, "teacher.path")
    client = None
    if last_stage and ps.get_tensor_model_parallel_rank() == 0:
        client = remote_client(cfg, teacher_fingerprint)
        info = client.connect()
        logger.info("teacher server(s) %s: %s, top-k <= %d", cfg.teacher.address, info.model, info.max_topk)
        if full_VH is not None:
            check_output_weight(full_VH, info, vocab_size, cfg.teacher.path)
    teacher = GroupSharedTeacher(
        client,
        group=ps.get_tensor_model_parallel_group(),
        src=ps.get_tensor_model_parallel_src_rank(),
        active=last_stage,
        supports_requested_logprobs=declared(cfg.teacher.backend, cfg.teacher.transfer).requested_logprobs,
    )
    if full_VH is not None:
        from megatron_opd.teacher.hidden import HiddenStateTeacher

        weight = None
        if last_stage:
            weight = output_weight_shard(full_VH, student.chunks[-1].vocab_size, vocab_size, cfg.build.dtype)
        teacher = HiddenStateTeacher(
            teacher, weight, vocab_size=vocab_size, temperature=cfg.teacher.temperature, chunk_size=cfg.loss.chunk_size
        )
    check_teacher_mode(teacher, cfg.loss.mode)
    return teacher


def check_teacher_mode(teacher, mode: str) -> None:
    """Dense needs the teacher's logit shards, or its hidden states and output layer; a top-k teacher has neither."""
    if mode == "dense" and not teacher.supports_dense:
        raise ValueError(
            f"loss.mode=dense needs the teacher's logit shards, which teacher.backend={type(teacher).__name__} does "
            "not provide (a remote teacher sends its top-k); use loss.mode=topk, or teacher.transfer=hidden with a "
            "teacher server"
        )


def output_weight_shard(full_VH: torch.Tensor, padded_vocab: int, vocab_size: int, dtype: str) -> torch.Tensor:
    """This TP rank's rows of the teacher's output layer, laid out like the student's output-layer shard (the
    student's padded vocabulary split over TP; rows past the real tokens zero), on this rank's device."""
    from megatron.core import parallel_state as ps

    from megatron_opd.distributed.device import collective_device
    from megatron_opd.dtypes import parse_dtype

    width = padded_vocab // ps.get_tensor_model_parallel_world_size()
    lo = ps.get_tensor_model_parallel_rank() * width
    shard_VH = torch.zeros(width, full_VH.shape[1], dtype=parse_dtype(dtype))
    real = max(0, min(width, vocab_size - lo))
    shard_VH[:real] = full_VH[lo : lo + real]
    return shard_VH.to(collective_device())  # the accelerator in use (the CPU with gloo)


def check_output_weight(full_VH: torch.Tensor, info, vocab_size: int, path: str) -> None:
    """Refuse an output layer (from ``teacher.path``) that is not the one the teacher server multiplies by: the
    hidden sizes must agree and so must the sums of squares of the real tokens' rows (in the server's dtype)."""
    from megatron_opd.dtypes import parse_dtype

    hidden_size, sumsq = info.extra.get("hidden_size"), info.extra.get("output_weight_sumsq")
    if full_VH.shape[1] != hidden_size or full_VH.shape[0] < vocab_size:
        raise ValueError(
            f"teacher.path={path} has an output layer of {tuple(full_VH.shape)}, but the teacher server "
            f"({info.model}) sends hidden states of size {hidden_size} for {vocab_size} tokens: point teacher.path "
            "at the model the server runs"
        )
    ours = float(full_VH[:vocab_size].to(parse_dtype(info.extra.get("dtype", "fp32"))).double().square().sum())
    if sumsq is None or abs(ours - sumsq) > 1e-6 * max(abs(sumsq), 1e-30):
        raise ValueError(
            f"the output layer in teacher.path={path} is not the teacher server's ({info.model}): sums of squares "
            f"{ours:.9g} vs {sumsq}; point teacher.path at the model the server runs"
        )


def build_retokenizer(cfg: TrainConfig, vocab: Vocabulary):
    """The teacher's view of each batch where it is not the student's (None where it is): ``loss.cross_tokenizer``
    (its own tokens), or ``teacher.prompt_template`` with the student's tokenizer (its own prompt)."""
    from megatron_opd.data.teacher_prompt import TemplatePromptEncoder

    objective = objective_for(cfg.loss)
    template = cfg.teacher.prompt_template
    if not objective.cross_tokenizer:
        if template is None:
            return None
        from megatron_opd.teacher.reprompt import Reprompter

        return Reprompter(TemplatePromptEncoder.for_data(vocab.tokenizer, cfg.data, template), vocab.pad_token_id)
    from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer

    encoder = TemplatePromptEncoder.for_data(vocab.teacher_tokenizer, cfg.data, template)
    # A vLLM teacher scores the next token only: the stop's prefix correction needs other ids at one position.
    stop_prefix_ids = 1 if cfg.teacher.backend == "vllm" else 16
    return CrossTokenizer(vocab.tokenizer, vocab.teacher_tokenizer, encoder, vocab.stop_token_ids, stop_prefix_ids,
                          topk=objective.teacher_request.mapped_topk)  # fmt: skip


def build_teachers(cfg: TrainConfig, accel: Accelerator, vocab: Vocabulary, student: Student) -> dict:
    """``teachers.*``: each teacher's back end (and re-tokenizer, for another tokenizer), by name, in config order."""
    from megatron_opd.scheduler.batch_schedule import RoutedTeacher

    teachers = {}
    for name, view in cfg.teacher_views().items():
        v = vocab.teachers[name]
        backend = build_teacher(view, accel, v.teacher_vocab_size, student, v.teacher_fingerprint)
        teachers[name] = RoutedTeacher(backend, build_retokenizer(view, v))
    return teachers


def max_seq_len(cfg: TrainConfig) -> int:
    """Longest prompt + response: ``train.max_seq_len`` or the student's context."""
    arch = model_architecture(cfg.student.path, "student.path")
    context = arch.max_position_embeddings
    if cfg.train.max_seq_len is not None and cfg.train.max_seq_len > context:
        raise ValueError(f"train.max_seq_len={cfg.train.max_seq_len} exceeds the student's context of {context}")
    length = context if cfg.train.max_seq_len is None else cfg.train.max_seq_len
    rope.check_sequence_length(arch.rope, length, "train.max_seq_len")  # longrope: its short factors only
    return length


def build_rollout(cfg: TrainConfig, student: Student, vocab: Vocabulary):
    """The rollout back end of ``rollout.backend`` (with tool turns when ``rollout.tool_fn`` is set)."""
    if cfg.rollout.routing_replay:  # the student's routers record (sampler) and replay (trainer) routes
        from megatron_opd.models import route_replay

        route_replay.install(student.chunks)
    if cfg.rollout.backend == "vllm":
        from megatron_opd.rollout.vllm_setup import build_vllm_rollout

        rollout = build_vllm_rollout(cfg, student.chunks, max_seq_len(cfg), vocab.vocab_size)
    else:
        from megatron_opd.rollout.builtin import BuiltinSampler

        rollout = BuiltinSampler(
            student.chunks, vocab_size=vocab.vocab_size, max_seq_len=max_seq_len(cfg), pad_token_id=vocab.pad_token_id
        )
    if cfg.rollout.tool_fn:
        from megatron_opd.rollout.tools import ToolRollout
        from megatron_opd.trainer.sequence_weights import import_function

        tool = import_function(cfg.rollout.tool_fn, "rollout.tool_fn")
        rollout = ToolRollout(
            rollout, vocab.tokenizer, tool, stop=cfg.rollout.tool_stop, max_turns=cfg.rollout.max_turns
        )
    return rollout


def sampling_params(cfg: TrainConfig, vocab: Vocabulary, temperature: float | None = None) -> SamplingParams:
    """``rollout.*`` as sampling parameters (the seed is set per step by the scheduler)."""
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature if temperature is None else temperature,
        top_p=cfg.rollout.top_p if temperature is None else 1.0,
        top_k=cfg.rollout.top_k if temperature is None else 0,
        stop_token_ids=vocab.stop_token_ids,
        seed=cfg.seed,
        return_routes=cfg.rollout.routing_replay and temperature is None,
    )
