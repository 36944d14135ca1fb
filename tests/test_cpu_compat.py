"""Each Megatron-Core CPU workaround is needed (the call fails without it) and works (it succeeds with it)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_opd.testing.multiprocess import DistributedTestError, run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are a no-op with CUDA")


def _megatron_calls():
    """The CUDA-assuming Megatron calls each patch is for, by patch."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.utils import get_default_causal_mask

    def rng_tracker():
        tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        with tracker.fork():
            b = torch.rand(4)
        # The fork advances its own stream and leaves the default one alone.
        assert not torch.equal(a, b) and torch.equal(before, torch.get_rng_state())

    def clip_grads():
        from megatron.core.optimizer import optimizer as mcore_optimizer

        param = torch.nn.Parameter(torch.ones(4))
        param.grad = torch.full((4,), 3.0)
        mcore_optimizer.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0)
        assert torch.allclose(param.grad, torch.full((4,), 0.5), atol=1e-6), param.grad

    def recompute():
        tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
        x = torch.ones(3, requires_grad=True)
        tensor_parallel.checkpoint(lambda t: (t * t).sum(), False, x).backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0)), x.grad

    def write_results_queue():
        """The queue a checkpoint save's writer reports through: its Manager forked, not spawned (a fresh interpreter
        importing the trainer; refused here before it starts)."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        getter = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
        real = filesystem_async.mp.get_context

        def fork_only(method=None):
            assert method == "fork", f"the writer's Manager would start by {method!r}"
            return real(method)

        filesystem_async.mp.get_context, filesystem_async._results_queue = fork_only, None
        try:
            queue = getter()
        finally:
            filesystem_async.mp.get_context = real
        queue.put("written")
        assert queue.get(timeout=30) == "written"

    def cp_pos_emb():
        from megatron.core.models.common.embeddings import rotary_pos_embedding

        from megatron_opd.testing.context_parallel import StandInGroup, megatron_cp_split

        group = StandInGroup(2, 1)  # the second of two CP ranks
        emb = torch.arange(8.0).view(8, 1, 1, 1)  # RoPE's [S, 1, 1, d]
        got = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(emb, 0, group).reshape(-1)
        expected = megatron_cp_split({"x": torch.arange(8.0)[None]}, group)["x"][0]
        assert torch.equal(got, expected), (got, expected)

    def shared_expert_streams():
        """What ``SharedExpertMLP`` does with its side stream under ``moe_shared_expert_overlap``."""
        from megatron.core.transformer.moe import shared_experts

        cuda = shared_experts.torch.cuda
        stream = cuda.Stream()
        stream.wait_stream(cuda.current_stream())
        with cuda.stream(stream):
            torch.ones(2)
        cuda.current_stream().wait_stream(stream)

    return {
        "shared_expert_streams": shared_expert_streams,
        "write_results_queue": write_results_queue,
        "rng_tracker": rng_tracker,
        "cp_pos_emb": cp_pos_emb,
        "recompute": recompute,
        "clip_grads": clip_grads,
        "current_device": lambda: torch.empty(2, device=torch.cuda.current_device()),
        "synchronize": lambda: torch.cuda.synchronize(),
        "tensor_cuda": lambda: torch.ones(2).cuda(),
        "cuda_literals": lambda: get_default_causal_mask(3),
    }


def _outcomes(apply: bool):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    if apply:
        from megatron_opd.distributed.cpu_compat import apply_cpu_patches

        apply_cpu_patches()
    outcomes = {}
    for name, call in _megatron_calls().items():
        try:
            call()
            outcomes[name] = "ok"
        except Exception as err:  # noqa: BLE001
            outcomes[name] = f"{type(err).__name__}: {err}"
    return outcomes


def test_every_patch_is_needed_and_works():
    unpatched, patched = (run_distributed(_outcomes, 1, args=(flag,))[0] for flag in (False, True))
    for name in unpatched:
        assert unpatched[name] != "ok", f"{name}: Megatron call works without its patch; the patch is dead code"
        assert patched[name] == "ok", f"{name}: still fails with the patch: {patched[name]}"


def _grad_sync_outcomes():
    """A DDP gradient sync with every CPU patch, first without the CUDA-stream one, then with it."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import MegatronModule, TransformerConfig

    from megatron_opd.distributed import cpu_compat

    parallel_state.initialize_model_parallel()
    unpatched = torch.cuda.current_stream
    cpu_compat.apply_cpu_patches()
    patched, outcomes = torch.cuda.current_stream, {}
    for name, current_stream in (("without", unpatched), ("with", patched)):
        torch.cuda.current_stream = current_stream
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        module = MegatronModule(config)
        module.weight = torch.nn.Parameter(torch.ones(4))
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), module)
        module.weight.main_grad.fill_(2.0)
        try:
            ddp.finish_grad_sync()
            outcomes[name] = "ok" if torch.equal(module.weight.main_grad, torch.full((4,), 2.0)) else "wrong grad"
        except Exception as err:  # noqa: BLE001
            outcomes[name] = f"{type(err).__name__}: {err}"
    return outcomes


_HOLDS_A_MANAGER = """
import os, sys, psutil
from megatron_opd.distributed.cpu_compat import forked_write_results_queue
forked_write_results_queue().put(1)
print(*[c.pid for c in psutil.Process().children()], flush=True)
sys.stdin.read()
"""


def test_a_killed_ranks_checkpoint_manager_lets_go_of_its_output_and_exits():
    """Patch 10's forked Manager, its rank killed (SIGKILL: no finalizer stops the Manager): the rank's output pipe
    reaches its end (a launcher reading it would otherwise wait for ever) and the Manager exits by itself."""
    import select
    import signal
    import subprocess
    import sys
    import time

    import psutil

    manager = None
    proc = subprocess.Popen([sys.executable, "-c", _HOLDS_A_MANAGER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        (manager,) = map(int, proc.stdout.readline().split())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # The end of the pipe: nobody else holds it (before the fix the Manager did, and a launcher waited for ever).
        assert select.select([proc.stdout], [], [], 10)[0] and proc.stdout.read() == "", "the Manager holds the pipe"
        deadline = time.monotonic() + 10
        while psutil.pid_exists(manager) and psutil.Process(manager).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the Manager outlived its rank by 10 s"
            time.sleep(0.1)
    finally:
        proc.kill()
        if manager is not None and psutil.pid_exists(manager):
            psutil.Process(manager).kill()


def test_grad_sync_stream_patch_is_needed_and_works():
    import megatron.core

    from megatron_opd.distributed.cpu_compat import grad_sync_uses_cuda_stream

    if not grad_sync_uses_cuda_stream():  # then the patch is not applied
        pytest.skip(f"megatron-core {megatron.core.__version__}'s gradient sync makes no CUDA stream call")
    outcomes = run_distributed(_grad_sync_outcomes, 1)[0]
    assert "CUDA" in outcomes["without"], f"the gradient sync works without the stream patch: {outcomes}"
    assert outcomes["with"] == "ok", outcomes


def _optimizer_outcomes():
    """bf16 with the plain and with the distributed optimizer, built with every CPU patch, first without the
    ``Tensor.type()`` one (patch 9: the constructors unwrapped), then with it; and ``Tensor.type()`` afterwards."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.transformer import MegatronModule, TransformerConfig

    from megatron_opd.distributed import cpu_compat

    parallel_state.initialize_model_parallel()
    cpu_compat.apply_cpu_patches()
    patched = {cls: cls.__init__ for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer)}
    outcomes = {}
    for name in ("without", "with"):
        for cls, init in patched.items():
            cls.__init__ = init if name == "with" else init.__wrapped__
        for distributed in (False, True):
            config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, bf16=True,
                                       params_dtype=torch.bfloat16)  # fmt: skip
            module = MegatronModule(config)
            module.weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
            ddp = DistributedDataParallel(config, ddp_config, module)
            key = f"{name} patch, {'distributed' if distributed else 'plain'} optimizer"
            try:
                optimizer = get_megatron_optimizer(
                    OptimizerConfig(
                        lr=0.5,
                        weight_decay=0.0,
                        bf16=True,
                        params_dtype=torch.bfloat16,
                        use_distributed_optimizer=distributed,
                    ),
                    [ddp],
                )
                ddp.zero_grad_buffer()
                module.weight.main_grad.fill_(1.0)
                optimizer.step()  # Adam's first step moves every weight by lr
                ok = torch.equal(module.weight.detach(), torch.full((4,), 0.5, dtype=torch.bfloat16))
                outcomes[key] = "ok" if ok else f"wrong step: {module.weight}"
            except Exception as err:  # noqa: BLE001
                outcomes[key] = f"{type(err).__name__}: {err}"
    outcomes["type() afterwards"] = torch.ones(1).type()
    return outcomes


def test_optimizer_type_patch_is_needed_works_and_is_scoped():
    outcomes = run_distributed(_optimizer_outcomes, 1)[0]
    for kind in ("plain", "distributed"):
        without, with_ = outcomes[f"without patch, {kind} optimizer"], outcomes[f"with patch, {kind} optimizer"]
        assert "Wrapped parameters must be one of" in without, f"{kind}: builds without the patch: {without}"
        assert with_ == "ok", f"{kind}: {with_}"
    assert outcomes["type() afterwards"] == "torch.FloatTensor", "Tensor.type() answers CUDA names outside"


def _attempt(call) -> str:
    try:
        return call()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


def _moe_patch_outcomes(hf_dir: str):
    """The MoE patches, each first undone then applied: the fp32 router's ``te_general_gemm`` (0.16 only) and the
    alltoall token dispatcher at EP=2 (its logits against the allgather dispatcher's)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Alltoall

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, cpu_compat, initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig

    out = {"te_general_gemm unbound": not hasattr(moe_utils, "te_general_gemm")}
    x, w = torch.randn(5, 8), torch.randn(3, 8)

    def gate() -> str:
        got = moe_utils.router_gating_linear(x, w, None, torch.float32)
        return "ok" if torch.allclose(got.double(), x.double() @ w.double().T, atol=1e-5) else f"wrong: {got}"

    out["te_general_gemm without"] = _attempt(gate)
    cpu_compat.bind_te_general_gemm()
    out["te_general_gemm with"] = _attempt(gate)

    original = Alltoall.__dict__["_maybe_dtoh_and_synchronize"], Alltoall.cuda_dtoh_stream
    parallel = ParallelConfig(expert_model_parallel_size=2)
    initialize_distributed(parallel)  # every CPU patch
    Alltoall._maybe_dtoh_and_synchronize, Alltoall.cuda_dtoh_stream = original
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))

    def logits(dispatcher: str) -> torch.Tensor:
        build = ModelBuildConfig(moe_token_dispatcher=dispatcher)
        _, (chunk,) = build_and_load(hf_dir, parallel, build, trainable=False)
        with torch.no_grad():
            return chunk(tokens, torch.arange(16).expand(2, 16), None)

    out["alltoall without"] = _attempt(lambda: logits("alltoall") and "ok")
    cpu_compat.patch_alltoall_dispatcher()
    ref = logits("allgather")
    got = _attempt(lambda: logits("alltoall"))
    close = isinstance(got, torch.Tensor) and (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    out["alltoall with"] = "ok" if close else f"differs from allgather: {got}"
    return out


def test_moe_patches_are_needed_and_work(shape_dirs):
    outcomes = run_distributed(_moe_patch_outcomes, 2, args=(shape_dirs["qwen3_moe_dense0"],), timeout=300)
    for rank, out in enumerate(outcomes):
        if out["te_general_gemm unbound"]:  # Megatron-Core 0.16; 0.19 binds it to None itself
            assert "NameError" in out["te_general_gemm without"], f"rank {rank}: the router works unpatched: {out}"
        assert out["te_general_gemm with"] == "ok", f"rank {rank}: {out}"
        assert "CUDA" in out["alltoall without"], f"rank {rank}: the alltoall dispatcher works unpatched: {out}"
        assert out["alltoall with"] == "ok", f"rank {rank}: {out}"


def _mla_outcomes():
    """A multi-latent attention layer of the local spec, built with every CPU patch, first with Megatron's
    ``HAVE_TE`` as 0.16 leaves it without TransformerEngine (True), then after :func:`unmark_mla_te`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_opd.distributed import cpu_compat

    parallel_state.initialize_model_parallel()
    cpu_compat.apply_cpu_patches()
    config = MLATransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_head_dim=4,
        qk_pos_emb_head_dim=2, v_head_dim=4, rope_type="rope", qk_layernorm=True, use_cpu_initialization=True,
    )  # fmt: skip
    from megatron_opd.models.attention import SDPAttention

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention  # Megatron 0.16's has no k_channels
    outcomes = {}
    for name in ("without", "with"):
        mla.HAVE_TE = True
        if name == "with":
            cpu_compat.unmark_mla_te()
        try:
            build_module(spec.submodules.self_attention, config=config, layer_number=1)
            outcomes[name] = "ok"
        except Exception as err:  # noqa: BLE001
            outcomes[name] = f"{type(err).__name__}: {err}"
    return outcomes


def test_mla_te_flag_patch_is_needed_and_works():
    from megatron.core.transformer import multi_latent_attention as mla

    if isinstance(mla.TELinear, type):
        pytest.skip("TransformerEngine's TELinear is installed: multi-latent attention's TE check is sound")
    outcomes = run_distributed(_mla_outcomes, 1)[0]
    assert "isinstance" in outcomes["without"], f"MLA builds without the patch: {outcomes}"
    assert outcomes["with"] == "ok", outcomes


def _hang(rank_to_fail: int):
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail:
        raise ValueError("planted failure")
    dist.barrier()  # the other rank waits forever for the failed one


def _sleep_forever():
    import time

    time.sleep(3600)


_DEFERRED_COMPILE = """
import sys, torch
from megatron_opd.distributed.cpu_compat import CompileOnFirstCall, apply_cpu_patches, torch_compile_deferred

if sys.argv[1] == "without":
    import megatron.core
    print("inductor imported" if "torch._inductor.compile_fx" in sys.modules else "inductor not imported")
    sys.exit()
apply_cpu_patches()
from megatron.core.transformer.moe.router import TopKRouter  # imported after the patch: jit_fuser stays deferred

assert "torch._inductor.compile_fx" not in sys.modules, "megatron.core imported TorchInductor"
assert torch.compile.__module__ == "torch", "torch.compile left patched"
assert isinstance(TopKRouter.__dict__["_apply_expert_bias"], CompileOnFirstCall)  # a method: run in test_moe.py
with torch_compile_deferred():  # the mechanics, on dynamo's eager backend (no C++ build)
    @torch.compile(backend="eager")
    def shifted_sine(x):
        return x.sin() + 1

    class Scale:
        def __init__(self, k):
            self.k = k

        @torch.compile(backend="eager")
        def apply(self, x):
            return self.k * x

    doubled = torch.compile(lambda x: 2 * x, backend="eager")
x = torch.randn(5)
assert shifted_sine._compiled is None and shifted_sine.__name__ == "shifted_sine"
torch.testing.assert_close(shifted_sine(x), x.sin() + 1)
assert shifted_sine._compiled is not None and shifted_sine._compiled is not shifted_sine.__wrapped__
torch.testing.assert_close(Scale(3.0).apply(x), 3.0 * x)
torch.testing.assert_close(doubled(x), 2 * x)
print("ok")
"""


def test_compile_on_first_call_patch_is_needed_and_works():
    import subprocess
    import sys

    def run(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", _DEFERRED_COMPILE, mode], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    assert run("without") == "inductor imported", "Megatron-Core no longer compiles at import: patch 14 is dead code"
    assert run("with") == "ok"


def test_harness_reports_failing_rank_and_timeouts():
    with pytest.raises(DistributedTestError, match="planted failure") as info:
        run_distributed(_hang, 2, args=(1,), timeout=120)
    assert "rank 1" in str(info.value)
    with pytest.raises(TimeoutError, match="did not finish"):
        run_distributed(_sleep_forever, 1, timeout=8, init_process_group=False)


_LEAVES_AN_ORPHAN = """
import os, sys, time
if os.fork() == 0:  # outlives its parent, in a session of its own, holding the pipe (a rank torchrun left behind)
    os.setsid()
    print(os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
time.sleep(0.5)
"""


def test_harness_kills_what_a_run_left_behind_and_never_waits_for_ever():
    """A run whose leftover process is re-parented to init and keeps the output pipe open: the harness fails the test
    at its timeout (instead of waiting for the pipe for ever) and the leftover is killed."""
    import sys
    import time

    import psutil

    from megatron_opd.testing.multiprocess import run_process_group

    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 5 s") as info:
        run_process_group([sys.executable, "-c", _LEAVES_AN_ORPHAN], env=dict(os.environ), cwd=".", timeout=5)
    assert time.monotonic() - start < 60
    orphan = int(str(info.value).split("s:\n")[1].split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the leftover process is still running"
        time.sleep(0.1)
