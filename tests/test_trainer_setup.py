"""Trainer set-up: how optim.* maps to Megatron-Core configs per accelerator (the GPU path cannot run here), and
which teacher back ends may feed a dense loss."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.distributed.device import Accelerator
from megatron_opd.trainer.config import OptimConfig
from megatron_opd.trainer.student import ddp_config, megatron_optimizer_config, precision_plan

CPU, GPU, NPU = Accelerator("cpu", "gloo"), Accelerator("cuda", "nccl"), Accelerator("npu", "hccl")


def test_cpu_defaults_to_plain_fp32():
    plan = precision_plan(OptimConfig(), CPU)
    assert (plan.params_dtype, plan.bf16, plan.use_distributed_optimizer) == ("fp32", False, False)
    opt = megatron_optimizer_config(OptimConfig(lr=2e-5, clip_grad=0.7, weight_decay=0.1), plan)
    assert opt.params_dtype == torch.float32 and not opt.bf16 and not opt.use_distributed_optimizer
    assert (opt.lr, opt.clip_grad, opt.weight_decay, opt.optimizer) == (2e-5, 0.7, 0.1, "adam")


@pytest.mark.parametrize("accel", [GPU, NPU])
def test_accelerators_default_to_bf16_with_distributed_optimizer(accel):
    plan = precision_plan(OptimConfig(), accel)
    assert (plan.params_dtype, plan.bf16, plan.use_distributed_optimizer, plan.grad_reduce_in_fp32) == (
        "bf16",
        True,
        True,
        True,
    )
    opt = megatron_optimizer_config(OptimConfig(), plan)
    assert opt.bf16 and opt.params_dtype == torch.bfloat16 and opt.use_distributed_optimizer
    assert opt.main_params_dtype == torch.float32  # fp32 main parameters
    ddp = ddp_config(plan)
    assert ddp.use_distributed_optimizer and ddp.grad_reduce_in_fp32
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and opt.overlap_param_gather  # overlapped
    assert not ddp.align_param_gather and ddp_config(plan, interleaved=True).align_param_gather  # as Megatron-LM


def test_overlap_defaults_and_refusals():
    cpu = precision_plan(OptimConfig(), CPU)
    assert cpu.overlap_grad_reduce and not cpu.overlap_param_gather  # the plain optimizer has nothing to gather
    assert not precision_plan(OptimConfig(overlap_grad_reduce=False), GPU).overlap_param_gather
    off = precision_plan(OptimConfig(overlap_grad_reduce=False, overlap_param_gather=False), GPU)
    ddp = ddp_config(off)
    assert not (ddp.overlap_grad_reduce or ddp.overlap_param_gather)
    with pytest.raises(ValueError, match="optim.overlap_param_gather=true needs optim.overlap_grad_reduce=true"):
        OptimConfig(overlap_grad_reduce=False, overlap_param_gather=True)
    with pytest.raises(ValueError, match="needs the distributed optimizer.*optim.use_distributed_optimizer=true"):
        OptimConfig(use_distributed_optimizer=False, overlap_param_gather=True)
    with pytest.raises(ValueError, match="needs the distributed optimizer, which is off here"):
        precision_plan(OptimConfig(overlap_param_gather=True), CPU)


def test_overrides_and_cpu_defaults():
    plan = precision_plan(OptimConfig(bf16=False, use_distributed_optimizer=True), GPU)
    assert (plan.params_dtype, plan.use_distributed_optimizer) == ("fp32", True)
    assert not precision_plan(OptimConfig(use_distributed_optimizer=False), GPU).use_distributed_optimizer
    default = precision_plan(OptimConfig(), CPU)
    assert (default.params_dtype, default.use_distributed_optimizer) == ("fp32", False)
    plan = precision_plan(OptimConfig(bf16=True, use_distributed_optimizer=True), CPU)  # the GPU defaults, asked for
    assert (plan.params_dtype, plan.use_distributed_optimizer) == ("bf16", True)


def test_dense_mode_needs_a_colocated_teacher():
    from megatron_opd.trainer.setup import check_teacher_mode

    class RemoteTeacher:
        supports_dense = False
        supports_requested_logprobs = True

    check_teacher_mode(RemoteTeacher(), "topk")
    with pytest.raises(ValueError, match="loss.mode=dense needs the teacher's logit shards.*use loss.mode=topk"):
        check_teacher_mode(RemoteTeacher(), "dense")


def test_build_dtype_is_the_student_and_teacher_dtype():
    """``build.dtype`` is honoured (``build_student`` used to overwrite it with the plan's): ``auto`` follows the
    precision plan, a set value decides ``optim.bf16`` when unset; the resolved value is what the in-process
    teacher is built at; contradictions and fp16 are refused by ``validate`` before any model is built."""
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import resolve_precision

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl"]

    def resolved(accel, *overrides):
        cfg = parse_args(TrainConfig, [*base, *overrides])
        cfg.validate()
        plan = resolve_precision(cfg, accel)
        return cfg.build.dtype, plan.params_dtype, plan.bf16, plan.use_distributed_optimizer

    assert parse_args(TrainConfig, base).build.dtype == "auto"
    assert resolved(GPU) == ("bf16", "bf16", True, True)
    assert resolved(CPU) == ("fp32", "fp32", False, False)
    assert resolved(GPU, "build.dtype=fp32") == ("fp32", "fp32", False, False)
    assert resolved(CPU, "build.dtype=fp32") == ("fp32", "fp32", False, False)
    assert resolved(NPU, "build.dtype=bf16", "optim.bf16=true") == ("bf16", "bf16", True, True)
    assert resolved(GPU, "optim.bf16=false") == ("fp32", "fp32", False, False)
    for overrides, message in [
        (["build.dtype=fp32", "optim.bf16=true"], "build.dtype=fp32 contradicts optim.bf16=true"),
        (["build.dtype=bf16", "optim.bf16=false"], "build.dtype=bf16 contradicts optim.bf16=false"),
        (["build.dtype=fp16"], "build.dtype=fp16: the trainer builds the student"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_args(TrainConfig, [*base, *overrides]).validate()
