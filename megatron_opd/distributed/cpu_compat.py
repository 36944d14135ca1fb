"""Everything Megatron-Core needs to run on a CPU with gloo, in one place.

Megatron-Core assumes CUDA in a handful of spots. On a machine without CUDA (tests, the quick start,
CI) :func:`apply_cpu_patches` redirects them to the CPU; it is a no-op when CUDA is available, and
nothing else in megatron-opd patches Megatron. Each patch is covered by a test that fails without it
(``tests/test_cpu_compat.py``). Measured against megatron-core 0.16.1 and 0.19.2.

Patches (all idempotent):

1. RNG tracker: Megatron's ``CudaRNGStatesTracker`` saves and restores CUDA generator state; the
   replacement forks the CPU generator instead, so tensor-parallel initialisation and dropout keep
   their per-rank streams.
2. ``torch.cuda.current_device()`` is passed as ``device=`` all over Megatron: it returns the CPU
   device. ``torch.cuda.synchronize()`` becomes a no-op.
3. ``Tensor.cuda()`` (tied embeddings with PP > 1, ``tensor_parallel/data.py``) returns the tensor.
4. Hard-coded ``device="cuda"`` literals (pipeline schedules, checkpoint exchange utilities, rerun
   state machine, ``tensor_parallel/data.py``, ...): those modules see a ``torch`` whose tensor
   factories map a CUDA device to the CPU.
5. ``torch.autocast("cuda", ...)`` in the schedules is only entered for fp16/bf16 autocast configs,
   which are not used on CPU; nothing to patch.
6. Gradient clipping: ``clip_grad_by_total_norm_fp32`` asserts every gradient is a
   ``torch.cuda.FloatTensor``; the optimizer gets a copy without that type check (same arithmetic).
7. Newer Megatron-Core (0.19.2; not 0.16.1): every gradient sync (``start_grad_sync``) asks for
   ``torch.cuda.current_stream()`` to wait on CUDA-graph events; it gets the CPU's current stream (whose
   ``wait_event`` / ``wait_stream`` are no-ops). Applied only when the installed release makes that call.
8. Activation recomputation (``build.recompute_granularity``): Megatron's ``CheckpointFunction`` saves and restores
   the CUDA generator state around the recomputed forward; it gets the CPU generator's.
9. Mixed precision and the distributed optimizer: the constructors of ``Float16OptimizerWithFloat16Params`` (bf16)
   and ``DistributedOptimizer`` sort parameters by ``Tensor.type()`` strings and refuse anything but
   ``torch.cuda.{Float,Half,BFloat16}Tensor``. While (and only while) one of them is being built, ``Tensor.type()``
   of a CPU tensor answers the CUDA name of its dtype; the arithmetic afterwards is the GPU's.
10. Checkpoint saves: the async file writer of ``dist_checkpointing`` collects its results through a queue of a
   ``multiprocessing`` Manager that its first save starts in a *spawned* process, a fresh interpreter importing the
   trainer's main module (2 s of CPU; the first save of a run took 3-7 s instead of 0.3 s). The Manager is forked
   instead, as Megatron's own trainer creates it (``get_write_results_queue(mp_mode="fork")``, 0.19); it lets go
   of the rank's output and exits when the rank is gone (a rank killed mid-run left it holding the launcher's pipe).
11. Context parallelism: ``rope_utils.get_pos_emb_on_this_cp_rank`` (RoPE's slice for this CP rank) builds its
   index in pinned memory, which needs CUDA; the same slice (``ContextParallelSplit.split``) replaces it in
   ``rope_utils`` and in the modules that import it by name.
12. Mixture-of-Experts router without TransformerEngine (any device): Megatron-Core 0.16's ``moe_utils`` leaves
   ``te_general_gemm`` unbound when TE is missing (NameError in the fp32 router); it is bound to None, which selects
   the router's torch matmul (:func:`bind_te_general_gemm`, applied on GPUs too).
13. The alltoall token dispatcher: its constructor makes a ``torch.cuda.Stream`` and its split sizes stay tensors,
   which gloo's ``all_to_all_single`` refuses; no side stream, and the split sizes become host arrays.
14. Import time: Megatron's ``jit_fuser`` is ``torch.compile``, applied at import to a dozen functions and methods
   (fused activations, norms, the MoE router), and each such decoration imports TorchInductor and triton (about
   3 s of CPU in every process, most of which never calls one). ``megatron.core`` is first imported with
   ``torch.compile`` deferring to the first call (:class:`CompileOnFirstCall`): what is called compiles exactly as
   before, what is not costs nothing.
15. Shared experts overlapped with the alltoall dispatcher (``build.moe_shared_expert_overlap``): Megatron's
   ``SharedExpertMLP`` makes a ``torch.cuda.Stream`` and runs its pieces under ``torch.cuda.stream``; on CPU its module
   sees ``torch.cpu``'s streams instead (no side stream: the pieces run in order, as the GPU's stream waits ensure).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

_APPLIED = False

# Megatron modules that spell out device="cuda" (or torch.device("cuda")) in code paths we use.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.data",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)

_TENSOR_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "tensor",
        "as_tensor",
        "arange",
        "rand",
        "randn",
        "randint",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_strided",
    }
)


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, int):  # a CUDA ordinal
        return torch.device("cpu")
    return device


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` inside a Megatron module: same attributes, CUDA devices become CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _TENSOR_FACTORIES:

            @functools.wraps(value)
            def factory(*args: Any, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                return value(*args, **kwargs)

            return factory
        if name == "device":
            return lambda *args, **kwargs: (
                torch.device("cpu") if args and str(args[0]).startswith("cuda") else torch.device(*args, **kwargs)
            )
        return value


class CpuRNGStatesTracker:
    """Drop-in for Megatron's ``CudaRNGStatesTracker`` that forks the CPU generator."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _get_cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state`` for recomputation: the CPU generator's state (already a copy)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _identity_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
    return self


def clip_grad_by_total_norm_cpu(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA tensor-type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def cuda_tensor_type_names():
    """``Tensor.type()`` (no argument) of a CPU float tensor answers its CUDA type name, inside this block only."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _built_with_cuda_type_names(cls: type) -> None:
    """Wrap ``cls.__init__`` in :func:`cuda_tensor_type_names` (patch 9)."""
    init = cls.__init__
    if getattr(init, "_cpu_compat", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with cuda_tensor_type_names():
            init(self, *args, **kwargs)

    __init__._cpu_compat = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def grad_sync_uses_cuda_stream() -> bool:
    """Whether this Megatron-Core's gradient sync calls ``torch.cuda.current_stream()`` (0.19.2 does, 0.16.1 not)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    return "current_stream" in _ParamAndGradBucketGroup.start_grad_sync.__code__.co_names


_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def forked_write_results_queue(*args: Any, **kwargs: Any) -> Any:  # noqa: ARG001 (mp_mode: always fork)
    """Megatron's ``get_write_results_queue`` (``_get_write_results_queue`` in 0.16) with a forked Manager."""
    from multiprocessing.managers import SyncManager

    filesystem_async = importlib.import_module(_FILESYSTEM_ASYNC)
    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=filesystem_async.mp.get_context("fork"))
        manager.start(_manager_outlives_no_one, (os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue


def _manager_outlives_no_one(parent: int) -> None:
    """In the forked Manager: let go of the rank's output (a launcher reading it to the end would otherwise wait on
    this process) and exit once the rank is gone, even when it was killed before it could stop the Manager."""
    import threading
    import time

    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def exit_when_orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_when_orphaned, daemon=True, name="exit-when-orphaned").start()


# Modules that import get_pos_emb_on_this_cp_rank by name (patch 11).
_MODULES_WITH_CP_POS_EMB = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's ``get_pos_emb_on_this_cp_rank`` without pinned memory: this CP rank's two chunks along
    ``seq_dim``."""
    from megatron_opd.distributed.sequence_split import ContextParallelSplit

    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    return ContextParallelSplit(cp_group, cp_group.size(), cp_group.rank()).split(pos_emb, seq_dim)


def bind_te_general_gemm() -> None:
    """Megatron-Core 0.16's ``moe_utils`` imports ``te_general_gemm`` from TransformerEngine and leaves the name
    unbound when TE is missing, so the fp32 router fails with a NameError (0.19 binds it to None); bind it to
    None, which selects the router's torch matmul. Needed without TE on a GPU too."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
    """CPU stand-in for ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: on a GPU it copies the token
    counts to the host on a side CUDA stream and waits for an event; on CPU there is nothing to copy or wait for,
    but Megatron's copy also turns the split sizes into the host arrays ``all_to_all_single`` needs (it leaves CPU
    tensors as tensors, which gloo's all-to-all refuses), so do that."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def patch_alltoall_dispatcher() -> None:
    """The alltoall token dispatcher on CPU: no ``torch.cuda.Stream`` (its constructor makes one) and host split
    sizes (:func:`_cpu_dtoh_and_synchronize`)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no side stream"  # set, so __init__ makes no CUDA stream
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize  # type: ignore[method-assign]


class _CpuStreamsTorch(types.ModuleType):
    """Stands in for ``torch`` inside a Megatron module that runs work on CUDA side streams: ``torch.cuda.Stream``,
    ``torch.cuda.stream`` and ``torch.cuda.current_stream`` are ``torch.cpu``'s (whose waits are no-ops)."""

    class _Cuda(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name in ("Stream", "stream", "current_stream"):
                return getattr(torch.cpu, name)
            return getattr(torch.cuda, name)

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = self._Cuda("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def patch_shared_expert_streams() -> None:
    """Patch 15: ``SharedExpertMLP`` (``moe_shared_expert_overlap``) on CPU streams."""
    from megatron.core.transformer.moe import shared_experts

    if shared_experts.torch is torch:
        shared_experts.torch = _CpuStreamsTorch()


def unmark_mla_te() -> None:
    """Megatron-Core 0.16's ``multi_latent_attention`` sets ``HAVE_TE = True`` when TransformerEngine is missing too
    (its TE stand-ins import), then calls ``isinstance(linear_proj, TELinear)`` with a stand-in that is no type: every
    multi-latent attention layer fails to build. Set it False where ``TELinear`` is no class (0.19 reads TE's flag)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "HAVE_TE", False) and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


_torch_compile = torch.compile


class CompileOnFirstCall:
    """``torch.compile(fn, **options)``, made when ``fn`` is first called rather than when it is decorated. A method
    too (``__get__``): Megatron compiles methods such as ``Router._apply_expert_bias``."""

    def __init__(self, fn: Any, options: dict[str, Any]) -> None:
        functools.update_wrapper(self, fn)
        self._fn, self._options, self._compiled = fn, options, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self._compiled = _torch_compile(self._fn, **self._options)
        return self._compiled(*args, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)


def compile_on_first_call(model: Any = None, **options: Any) -> Any:
    """``torch.compile``'s signature, both as ``compile(fn, ...)`` and as the decorator ``compile(...)(fn)``."""
    if model is None:
        return lambda fn: CompileOnFirstCall(fn, options)
    return CompileOnFirstCall(model, options)


@contextlib.contextmanager
def torch_compile_deferred():
    """While inside, ``torch.compile`` is :func:`compile_on_first_call`: a module imported here that binds it at
    import (Megatron's ``jit_fuser``) keeps the deferred one."""
    torch.compile = compile_on_first_call  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = _torch_compile  # type: ignore[assignment]


def import_megatron_with_deferred_compile() -> None:
    """Patch 14: the first import of ``megatron.core`` binds ``jit_fuser`` to :func:`compile_on_first_call`."""
    if "megatron.core.jit" in sys.modules:
        logger.debug("cpu_compat: megatron.core was imported before the CPU patches; its jit_fuser compiles at import")
        return
    with torch_compile_deferred():
        import megatron.core  # noqa: F401
        import megatron.core.jit  # noqa: F401


def apply_cpu_patches() -> None:
    """Make Megatron-Core usable on a CPU-only process. No-op when CUDA is available (but for the patches any
    machine without TransformerEngine needs)."""
    global _APPLIED
    if not torch.cuda.is_available():
        import_megatron_with_deferred_compile()
    bind_te_general_gemm()
    unmark_mla_te()
    if _APPLIED or torch.cuda.is_available():
        return

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.Tensor.cuda = _identity_cuda  # type: ignore[method-assign]
    if grad_sync_uses_cuda_stream():
        torch.cuda.current_stream = torch.cpu.current_stream  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc,assignment]
    mcore_random.initialize_rng_tracker(force_reset=True)
    mcore_random._get_cuda_rng_state = _get_cpu_rng_state  # type: ignore[assignment]
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state  # type: ignore[assignment]

    from megatron.core.optimizer import clip_grads as mcore_clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    mcore_clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu  # type: ignore[assignment]
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu  # type: ignore[assignment]
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _built_with_cuda_type_names(mcore_optimizer.Float16OptimizerWithFloat16Params)
    _built_with_cuda_type_names(DistributedOptimizer)

    filesystem_async = importlib.import_module(_FILESYSTEM_ASYNC)
    for getter in ("get_write_results_queue", "_get_write_results_queue"):  # 0.19, 0.16
        if hasattr(filesystem_async, getter):
            setattr(filesystem_async, getter, forked_write_results_queue)
    for module_name in _MODULES_WITH_CP_POS_EMB:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    patch_alltoall_dispatcher()
    patch_shared_expert_streams()

    cpu_torch = _CpuTorch()
    for module_name in _MODULES_WITH_CUDA_LITERALS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # moved or removed in another megatron-core release
            logger.debug("cpu_compat: %s not found; skipped", module_name)
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch
    _APPLIED = True
    logger.info("Applied Megatron-Core CPU patches (no CUDA device)")
