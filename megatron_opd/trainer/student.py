"""The trainable student: Megatron DDP chunks, Megatron's optimizer and LR schedule, one optimizer step.

Precision (``precision_plan``): on GPU/NPU the default is bf16 parameters with fp32 main parameters and
gradients reduced in fp32, with the distributed optimizer (optimizer state sharded over data-parallel ranks).
On CPU the default is fp32 with the plain optimizer (bf16 arithmetic is slow there); both GPU settings can be
switched on (``distributed/cpu_compat.py`` lets Megatron build them), which is how CI tests the GPU defaults.
Micro-batches go through ``get_forward_backward_func`` (any TP/PP/VP); ``finalize_model_grads`` reduces gradients
over data-parallel ranks and ties embeddings across stages. Gradient reduction and (distributed optimizer) the
parameter all-gather overlap computation by default (``optim.overlap_*``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_opd.distributed.device import Accelerator, collective_device
from megatron_opd.models.forward_backward import forward_backward
from megatron_opd.trainer.config import OptimConfig
from megatron_opd.trainer.lag_lr import scaled_lr
from megatron_opd.trainer.objective import MicroBatchStats, StepStats
from megatron_opd.trainer.router import RouterMetrics, freeze_routers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrecisionPlan:
    """How parameters, gradients and optimizer state are stored."""

    params_dtype: str
    """Model parameter dtype (``fp32`` or ``bf16``)."""
    bf16: bool
    """bf16 parameters with fp32 main parameters in the optimizer."""
    use_distributed_optimizer: bool
    """Optimizer state and main parameters sharded over data-parallel ranks."""
    grad_reduce_in_fp32: bool
    """Gradients are accumulated and all-reduced in fp32."""
    overlap_grad_reduce: bool = False
    """Gradient reduction overlapped with the backward pass (``optim.overlap_grad_reduce``)."""
    overlap_param_gather: bool = False
    """The distributed optimizer's parameter all-gather overlapped with the next forward pass."""


def precision_plan(optim: OptimConfig, accel: Accelerator) -> PrecisionPlan:
    """Resolve ``optim.bf16`` / ``optim.use_distributed_optimizer`` for this accelerator (None = its default:
    bf16 and the distributed optimizer on a GPU/NPU, fp32 and the plain optimizer on CPU)."""
    on_cpu = accel.type == "cpu"
    bf16 = (not on_cpu) if optim.bf16 is None else optim.bf16
    distributed = (bf16 and not on_cpu) if optim.use_distributed_optimizer is None else optim.use_distributed_optimizer
    gather = (
        (distributed and optim.overlap_grad_reduce)
        if optim.overlap_param_gather is None
        else optim.overlap_param_gather
    )
    if gather and not distributed:
        raise ValueError(
            "optim.overlap_param_gather=true needs the distributed optimizer, which is off here (the default on "
            f"{accel.type}); set optim.use_distributed_optimizer=true or unset optim.overlap_param_gather"
        )
    return PrecisionPlan(
        params_dtype="bf16" if bf16 else "fp32",
        bf16=bf16,
        use_distributed_optimizer=distributed,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        overlap_param_gather=gather,
    )


def megatron_optimizer_config(optim: OptimConfig, plan: PrecisionPlan):
    """Megatron-Core ``OptimizerConfig`` for ``optim`` under ``plan``."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=plan.bf16,
        params_dtype=torch.bfloat16 if plan.bf16 else torch.float32,
        use_distributed_optimizer=plan.use_distributed_optimizer,
        overlap_param_gather=plan.overlap_param_gather,
    )


def ddp_config(plan: PrecisionPlan, interleaved: bool = False):
    """Megatron-Core ``DistributedDataParallelConfig`` for ``plan``. ``interleaved``: several model chunks per
    pipeline rank, whose parameter all-gathers the pipeline schedule starts (``align_param_gather``, as Megatron-LM
    sets it for the interleaved schedule only)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=plan.grad_reduce_in_fp32,
        overlap_grad_reduce=plan.overlap_grad_reduce,
        overlap_param_gather=plan.overlap_param_gather,
        align_param_gather=plan.overlap_param_gather and interleaved,
        use_distributed_optimizer=plan.use_distributed_optimizer,
    )


@dataclass
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    stats: StepStats
    grad_norm: float
    lr: float
    router: dict[str, float] = field(default_factory=dict)
    """A Mixture-of-Experts student's router metrics (``trainer/router.py``); empty for a dense one."""
    lr_scale: float = 1.0
    """The factor this step's learning rate was multiplied by (``optim.lag_lr_target``; 1 without it)."""


class NonFiniteLossError(RuntimeError):
    """The loss of a step was NaN or infinite; the step was not applied."""


class Student:
    """This rank's student chunks wrapped for training, with their optimizer and LR schedule."""

    def __init__(
        self, chunks: list, optim: OptimConfig, plan: PrecisionPlan, total_steps: int, freeze_router: bool = False
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.chunks = chunks
        mark_experts_expert_parallel(chunks)
        if freeze_router:  # before DDP and the optimizer, which then leave the routers out
            frozen = freeze_routers(chunks)
            logger.info("train.freeze_router: %d router parameter(s) frozen on this rank", frozen)
        self.router_metrics = RouterMetrics(chunks) if getattr(chunks[0].config, "num_moe_experts", None) else None
        self.model = [
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config(plan, interleaved=len(chunks) > 1),
                module=chunk,
                disable_bucketing=i > 0,
            )
            for i, chunk in enumerate(chunks)
        ]
        self.optimizer = get_megatron_optimizer(megatron_optimizer_config(optim, plan), self.model)
        decay_end = optim.lr_decay_steps or total_steps
        decay_steps = max(1, decay_end - optim.lr_warmup_steps)
        self.lr_schedule = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr if optim.lr_decay_style != "constant" else optim.lr,
            lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=optim.lr_warmup_steps + decay_steps,
            lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        config = self.model[0].config
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = _per_chunk([m.no_sync for m in self.model])
        # As Megatron-LM's training.py: with overlapped reduction the pipeline schedule starts each chunk's gradient
        # reduction after its last backward (align_grad_reduce), and with the interleaved schedule each chunk's
        # parameter all-gather (align_param_gather); otherwise the DDP hooks do it.
        if plan.overlap_grad_reduce:
            config.grad_sync_func = _per_chunk([m.start_grad_sync for m in self.model])
        if plan.overlap_param_gather and len(self.model) > 1:
            config.param_sync_func = _per_chunk([m.start_param_sync for m in self.model])

    def finish_param_sync(self) -> None:
        """Make every parameter current: with ``overlap_param_gather`` the distributed optimizer's step leaves the
        other data-parallel ranks' slices of the updated parameters to be all-gathered in the next forward pass.
        Every reader of the weights outside the training step (weight sync, sampler, evaluation, checkpoint) calls
        this first; a no-op when nothing is pending (a collective over data-parallel ranks otherwise)."""
        for chunk in self.model:
            if not chunk.ddp_config.overlap_param_gather:
                continue
            groups = chunk.bucket_groups + getattr(chunk, "expert_parallel_bucket_groups", [])
            if any(not g.param_gather_dispatched or g.param_gather_handle is not None for g in groups):
                chunk.start_param_sync(force_sync=True)

    def prepare_optimizer_for_loading(self) -> None:
        """Give a fresh distributed optimizer its state before a checkpoint is loaded into it.

        dist_checkpointing loads optimizer state in place, so it must exist first; a torch Adam has none before its
        first step, and Megatron's distributed optimizer asserts on the missing step count. Megatron fills it the
        way its own loader does: one step on zero gradients (the loaded checkpoint then replaces every value).
        """
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            fill = getattr(optimizer, "_init_optimizer_states_with_dummy_values", None)
            if fill is not None and not optimizer.optimizer.state:
                fill()

    def load_optimizer_state(self, state_dict: dict) -> None:
        """Load a checkpoint's optimizer state (after :meth:`prepare_optimizer_for_loading` and the load).

        With torch's Adam (no apex/TE), Megatron's distributed optimizer (0.16) saves Adam's step count in each
        parameter group, not per parameter, and on loading leaves the per-parameter counts wrong (the placeholder
        step's, or one tensor shared by every parameter, which torch's Adam would then advance once per parameter).
        Each parameter gets its own count from its group, as the uninterrupted run has it.
        """
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        with contextlib.ExitStack() as stack:
            for optimizer in optimizers:
                stack.enter_context(_keeping_unsaved_states(optimizer))
            self.optimizer.load_state_dict(state_dict)
        for optimizer in optimizers:
            inner = optimizer.optimizer
            for group in inner.param_groups:
                if group.get("step") is None:  # only the distributed optimizer's groups carry it
                    continue
                for param in group["params"]:
                    state = inner.state.get(param, {})
                    if torch.is_tensor(state.get("step")):
                        state["step"] = torch.full_like(state["step"], float(group["step"]))

    def train(self) -> None:
        for chunk in self.model:
            chunk.train()

    def step(
        self,
        micro_batches: list[dict],
        loss_fn: Callable[[torch.Tensor, dict], tuple[torch.Tensor, MicroBatchStats]],
        guard: Callable[[StepStats], None] | None = None,
        teachers: tuple[str, ...] = (),
        lr_scale: Callable[[StepStats], float] | None = None,
    ) -> StepResult:
        """Forward and backward every micro-batch, check the loss (and ``guard``, which raises to refuse the step:
        the rollout-fidelity monitor), then apply one optimizer step. ``teachers``: the names of the per-teacher
        blocks ``loss_fn``'s statistics carry (``teachers.*``), the same on every rank. ``lr_scale``: the factor on
        this step's learning rate from its statistics (``trainer.lag_lr``; identical on every rank)."""
        self.train()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self.router_metrics.recording() if self.router_metrics else contextlib.nullcontext():
            outputs = forward_backward(self.model, micro_batches, loss_fn)
        router = self.router_metrics.reduce(len(micro_batches)) if self.router_metrics else {}
        stats = sum_stats(outputs, teachers)
        if stats.nonfinite:
            raise NonFiniteLossError(f"loss is {stats.loss}")
        if guard is not None:
            guard(stats)  # identical stats on every rank: all refuse together, before any update
        scale = 1.0 if lr_scale is None else float(lr_scale(stats))
        with scaled_lr(self.optimizer, scale):  # this step only: the schedule's rate is back before it moves on
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # only a loss-scaled fp16 optimizer skips steps; bf16/fp32 never do
            logger.warning("optimizer skipped the step (gradient overflow)")
        self.lr_schedule.step(increment=1)
        lr = self.optimizer.param_groups[0]["lr"]
        return StepResult(stats=stats, grad_norm=float(grad_norm or 0.0), lr=float(lr), router=router, lr_scale=scale)


def mark_experts_expert_parallel(chunks: list) -> None:
    """Mark every routed expert's parameters as Megatron does at expert parallelism (``allreduce=False``), at EP=1
    too. Megatron's DDP then reduces their gradients over the expert-data-parallel ranks (at EP=1 the data-parallel
    ones: the same sums) and its optimizer steps them in an optimizer of their own, a ``ChainedOptimizer`` at every
    EP; otherwise the optimizer state saved at EP=1 (one optimizer) had other checkpoint keys than at EP > 1 (two,
    ``chained_N.``-prefixed) and could not be resumed at another EP.

    At expert TP 1 an expert's output bias (gpt-oss) loses Megatron's ``sequence_parallel`` mark: each TP rank's
    experts see only its tokens, and the expert-data-parallel group DDP sums over holds those TP ranks, so
    ``finalize_model_grads``' sequence-parallel all-reduce over TP would count the bias's gradient twice."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    unsplit = parallel_state.get_expert_tensor_parallel_world_size() == 1
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for param in module.experts.parameters():
                    param.allreduce = False
                    if unsplit and getattr(param, "sequence_parallel", False):
                        param.sequence_parallel = False


def _per_chunk(funcs: list) -> Callable | list[Callable]:
    """Megatron's config takes one function for one model chunk, a list for several."""
    return funcs[0] if len(funcs) == 1 else funcs


@contextlib.contextmanager
def _keeping_unsaved_states(optimizer):
    """While a distributed optimizer loads a ``fully_reshardable`` state, the state it holds but the checkpoint
    does not (torch Adam's per-parameter ``step``: Megatron saves it in the parameter groups) stays as it is.

    Megatron's loader copies every state tensor the optimizer holds from the checkpoint's and raises
    ``KeyError: 'step'`` (0.16.1 and 0.19.2, torch's Adam without apex/TransformerEngine); the counts are then set
    from the groups by :meth:`Student.load_optimizer_state`. Under ``no_grad``: fp32 main parameters are views of
    the model's leaf parameters.
    """
    original = getattr(optimizer, "_set_main_param_and_optimizer_states", None)
    if original is None:  # the plain optimizer
        yield
        return

    def set_states(model_param, tensors: dict) -> None:
        with torch.no_grad():
            original(model_param, {**optimizer._get_main_param_and_optimizer_states(model_param), **tensors})

    optimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        del optimizer._set_main_param_and_optimizer_states


def sum_stats(outputs: list[StepStats] | list[MicroBatchStats], teachers: tuple[str, ...] = ()) -> StepStats:
    """Add the micro-batch stats of the last pipeline stage and share the totals with every rank (a collective).

    Data-parallel ranks' sums add up, and so do context-parallel ranks' (each holds its share of every sequence);
    pipeline stages without a loss contribute zeros; tensor-parallel ranks hold identical values, so the total is
    divided by the tensor-parallel size. ``StepStats.MAX_FIELDS`` (never
    negative) take the maximum instead, over micro-batches and ranks (a second all-reduce).
    """
    from megatron.core import parallel_state as ps

    is_max = StepStats.max_mask(len(teachers))
    total = torch.zeros(len(is_max), dtype=torch.float64)
    if outputs:  # added where the loss put them (MicroBatchStats: on its device); read to the host once, below
        is_max = is_max.to(outputs[0].as_tensor().device)
        total = total.to(is_max.device)
    for stats in outputs:
        values = stats.as_tensor().to(torch.float64)
        total = torch.where(is_max, torch.maximum(total, values), total + values)
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = torch.where(is_max, 0.0, total).to(collective_device())
        maxima = torch.where(is_max, total, 0.0).to(collective_device())
        dist.all_reduce(sums)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        sums /= ps.get_tensor_model_parallel_world_size()
        total = torch.where(is_max.cpu(), maxima.cpu(), sums.cpu())
    return StepStats.from_tensor(total.cpu(), teachers)
