"""The Triton RMSNorm (``kernels/rmsnorm_triton.py``) against ``torch.nn.functional.rms_norm`` in float64.

Device selection as in ``test_kernels_triton.py``: CUDA when triton is installed; on a CPU machine the kernels run
only under ``TRITON_INTERPRET=1`` (small shapes), else those tests skip. The module test (torch's path on CPU,
bitwise) and the ahead-of-time sm_90 compile run without the interpreter.

Error: max |a - ref| / max |ref| over a tensor, ref in float64 from the same (rounded) inputs. fp32 must be within
1e-5. bf16/fp16 results are rounded once to 8/11 significant bits by both torch and the kernel, so the bound there is
relative to torch's own error on the same inputs: at most twice it (four times for bf16 under the interpreter, whose
fp32 -> bf16 cast truncates). Both compute in fp32 and differ only in summation order, so a correct kernel lands at
about 1x; a bf16 intermediate, a wrong eps or a lost partial sum is many times over.

Shape legend: ``M`` rows, ``N`` width.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_opd.kernels import rmsnorm_triton
from megatron_opd.kernels.divergence_triton import triton_available
from megatron_opd.models.norms import RMSNorm, TritonRMSNorm

if torch.cuda.is_available() and triton_available():
    DEVICE = torch.device("cuda")
elif rmsnorm_triton.triton_usable_on(torch.device("cpu")) and os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
else:
    DEVICE = None
ON_GPU = DEVICE is not None and DEVICE.type == "cuda"
needs_runtime = pytest.mark.skipif(
    DEVICE is None, reason="needs CUDA and triton (or TRITON_INTERPRET=1 with triton installed)"
)

EPS = 1e-6
# Twice torch's error; under the interpreter its fp32 -> bf16 cast truncates (1 ulp, not half of one): four times.
HALF_BOUND = {torch.float16: 2.0, torch.bfloat16: 4.0 if DEVICE is not None and DEVICE.type == "cpu" else 2.0}
SHAPES = [(3, 5, 128), (7, 2048), (2, 3, 4096)] + ([(65536, 128), (4096, 5120)] if ON_GPU else [])
# Rows enough for every backward program to sum several tiles (the last one partial) into its dw partial.
MANY_ROWS = (65536 + 7, 128) if ON_GPU else (300, 128)


def _inputs(shape, x_dtype, w_dtype, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale + 0.3 * scale).to(x_dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    dy = torch.randn(shape, generator=g).to(x_dtype)
    return x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE)


def _run(fn, x, w, dy, eps=EPS):
    """Output, dx and dw of ``fn(x, w, eps)`` backpropagating ``dy``."""
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)  # no clone: it would drop x's strides
    y = fn(x, w, eps)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _torch(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _errors(results, x, w, dy, eps=EPS):
    ref_eps = torch.finfo(torch.float32).eps if eps is None else eps  # torch's eps=None: its fp32 compute type's
    ref = _run(_torch, x.double(), w.double(), dy.double(), ref_eps)
    return [float((a.double() - r).abs().max() / r.abs().max()) for a, r in zip(results, ref)]


def _check_against_torch(x, w, dy, eps=EPS):
    """Output and gradients in torch's dtypes; fp32 ones within 1e-5, the others within a bound times torch's error."""
    mine = _run(rmsnorm_triton.rms_norm, x, w, dy, eps)
    theirs = _run(_torch, x, w, dy, eps)
    assert [t.dtype for t in mine] == [t.dtype for t in theirs] == [x.dtype, x.dtype, w.dtype]
    for name, t, err, torch_err in zip(
        ("y", "dx", "dw"), mine, _errors(mine, x, w, dy, eps), _errors(theirs, x, w, dy, eps)
    ):
        bound = 1e-5 if t.dtype == torch.float32 else HALF_BOUND[t.dtype] * torch_err
        assert err <= bound, f"{name} ({t.dtype}): {err:.3g} vs torch's {torch_err:.3g}"


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_float64(shape) -> None:
    x, w, dy = _inputs(shape, torch.float32, torch.float32)
    for name, err in zip(("y", "dx", "dw"), _errors(_run(rmsnorm_triton.rms_norm, x, w, dy), x, w, dy)):
        assert err < 1e-5, f"{name}: {err:.3g}"


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_torch(shape, dtype) -> None:
    _check_against_torch(*_inputs(shape, dtype, dtype, seed=1))


@needs_runtime
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, on its composite path
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_mixed_dtypes_as_torch(x_dtype, w_dtype) -> None:
    # fp32 hidden states with a bf16 weight (Float16Module): output and dx in fp32 (tight), dw rounded to bf16.
    _check_against_torch(*_inputs((5, 2048), x_dtype, w_dtype, seed=2))


@needs_runtime
def test_weight_gradient_over_many_tiles_is_exact_and_deterministic() -> None:
    n_rows, n_cols = MANY_ROWS
    block_m, _, num_warps = rmsnorm_triton._tiles(n_cols)
    n_tiles = -(-n_rows // block_m)
    n_programs = rmsnorm_triton._num_programs(DEVICE, n_tiles, num_warps)
    assert n_tiles > 2 * n_programs  # each program sums more than two tiles into its partial
    x, w, dy = _inputs(MANY_ROWS, torch.float32, torch.float32, seed=3)
    first = _run(rmsnorm_triton.rms_norm, x, w, dy)
    assert max(_errors(first, x, w, dy)) < 1e-5
    assert torch.equal(_run(rmsnorm_triton.rms_norm, x, w, dy)[2], first[2])  # partial sums, not atomics


@needs_runtime
def test_strided_rows_and_gradient() -> None:
    # A row view of a wider buffer (as a split of fused QKV gives) and a strided upstream gradient.
    x, w, dy = _inputs((6, 160), torch.float32, torch.float32, seed=4)
    x, dy = x[:, :128], dy[:, 16:144]
    assert x.stride(0) == dy.stride(0) == 160
    mine = _run(rmsnorm_triton.rms_norm, x, w[:128].contiguous(), dy)
    assert max(_errors(mine, x, w[:128], dy)) < 1e-5


@needs_runtime
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_eps_is_torchs(dtype) -> None:
    # eps=None is fp32's eps for every input dtype (torch's compute type); with mean(x^2) ~ 1e-8 it matters.
    x, w, dy = _inputs((4, 128), dtype, dtype, seed=5, scale=1e-4)
    _check_against_torch(x, w, dy, eps=None)
    torch_errors = _errors(_run(_torch, x, w, dy, None), x, w, dy, None)
    assert max(torch_errors) < (1e-5 if dtype == torch.float32 else 1e-2)  # the reference's eps is torch's


@needs_runtime
def test_no_rows() -> None:
    x, w, dy = _inputs((0, 128), torch.float32, torch.float32)
    y, dx, dw = _run(rmsnorm_triton.rms_norm, x, w, dy)
    assert y.shape == dx.shape == (0, 128) and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("cls", [RMSNorm, TritonRMSNorm])
def test_module_runs_torch_on_cpu_and_tags_sequence_parallel(cls) -> None:
    config = SimpleNamespace(params_dtype=torch.float32, sequence_parallel=True)
    norm, ref = cls(config, 64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
        ref.weight.copy_(norm.weight)
    assert norm.weight.sequence_parallel
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    dy = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(7))
    y, y_ref = norm(x), ref(x_ref)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad) and torch.equal(norm.weight.grad, ref.weight.grad)


@pytest.mark.skipif(not ON_GPU, reason="the module takes the kernel on CUDA only")
def test_module_runs_the_kernel_on_cuda() -> None:
    config = SimpleNamespace(params_dtype=torch.bfloat16, sequence_parallel=False)
    norm = TritonRMSNorm(config, 128, eps=1e-6).cuda()  # build.norm=triton
    x = torch.randn(4, 3, 128, device="cuda", dtype=torch.bfloat16)
    y = norm(x)
    assert type(y.grad_fn).__name__ == "_RMSNormBackward"
    assert torch.equal(y, rmsnorm_triton.rms_norm(x, norm.weight, 1e-6))


@pytest.mark.skipif(
    rmsnorm_triton.triton is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton installed (and not in interpreter mode)",
)
def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    # Ahead-of-time compilation to sm_90 cubin, as in test_kernels_triton.py: what the interpreter cannot check.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = rmsnorm_triton
    scalars = {"stride_x": "i64", "stride_dy": "i64", "n_rows": "i32", "n_cols": "i32", "eps": "fp32"}
    for x_dt, w_dt in (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")):
        ptrs = {"x_ptr": x_dt, "y_ptr": x_dt, "dy_ptr": x_dt, "dx_ptr": x_dt, "w_ptr": w_dt}
        ptrs.update(rstd_ptr="fp32", dw_part_ptr="fp32")
        for n_cols in (128, k.MAX_N):
            block_m, block_n, num_warps = k._tiles(n_cols)
            constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n}
            for fn in (k._rmsnorm_fwd_kernel, k._rmsnorm_bwd_kernel):
                signature = {
                    name: "constexpr" if name in constexprs else scalars.get(name) or "*" + ptrs[name]
                    for name in fn.arg_names
                }
                compiled = triton.compile(
                    ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                    target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": num_warps},
                )
                assert "cubin" in compiled.asm, fn.__name__
