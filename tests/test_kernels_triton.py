"""The fused Triton kernels against the torch reference path, through the public loss API.

Runs on CUDA when triton is installed; on a CPU machine it runs only under ``TRITON_INTERPRET=1`` with triton
importable (slow, small shapes), and otherwise skips. The torch path itself is checked against the float64
full-vocabulary reference in ``test_losses.py``.

Shape legend: ``T`` tokens, ``V`` shard vocabulary, ``K`` teacher top-k.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_opd.kernels import divergence_triton
from megatron_opd.losses import dense_divergence, topk_divergence, union_divergence

if torch.cuda.is_available() and divergence_triton.triton_available():
    DEVICE = torch.device("cuda")
elif divergence_triton.triton_usable_on(torch.device("cpu")) and os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
else:
    DEVICE = None
needs_runtime = pytest.mark.skipif(
    DEVICE is None, reason="needs CUDA and triton (or TRITON_INTERPRET=1 with triton installed)"
)
needs_triton_compiler = pytest.mark.skipif(
    divergence_triton.triton is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton installed (and not in interpreter mode)",
)

KINDS = ("forward_kl", "reverse_kl", "jsd")
TAILS = ("bucket", "renorm", "ignore")
# One gradient ulp in bf16 is 2^-8 relative; the kernel and the torch path round independently.
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def _run(fn, student_TV: torch.Tensor, weights_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = student_TV.clone().requires_grad_(True)
    loss_T = fn(x)
    (loss_T * weights_T).sum().backward()
    return loss_T.detach(), x.grad


def _data(n_tokens: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student_TV = (torch.randn(n_tokens, width, generator=g) * 3).to(dtype).to(DEVICE)
    teacher_TV = (torch.randn(n_tokens, width, generator=g) * 3).to(dtype).to(DEVICE)
    weights_T = torch.randn(n_tokens, generator=g).to(DEVICE)
    return student_TV, teacher_TV, weights_T


@needs_runtime
# 5000 columns: more than one 4096-wide block; vocab_size 4990: a strided row view with padding to skip.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_dense_kernel_matches_torch(kind: str, dtype: torch.dtype) -> None:
    student_TV, teacher_TV, weights_T = _data(6, 5000, dtype)
    teacher_TV[0, 4000:4100] = float("-inf") if kind != "reverse_kl" else teacher_TV[0, 4000:4100]
    results = {}
    for backend in ("torch", "triton"):
        results[backend] = _run(
            lambda x, backend=backend: dense_divergence(
                x,
                teacher_TV,
                kind,
                beta=0.3,
                student_temperature=1.3,
                teacher_temperature=0.8,
                vocab_size=4990,
                backend=backend,
            ),
            student_TV,
            weights_T,
        )
    (ref_loss, ref_grad), (loss, grad) = results["torch"], results["triton"]
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert _rel(loss, ref_loss) < 2e-5
    assert _rel(grad, ref_grad) < GRAD_TOL[dtype]
    assert torch.all(grad[:, 4990:] == 0)


@needs_runtime
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", KINDS)
def test_topk_kernel_matches_torch(kind: str, tail: str, dtype: torch.dtype) -> None:
    student_TV, teacher_TV, weights_T = _data(5, 5000, dtype, seed=1)
    logp_TV = torch.log_softmax(teacher_TV[:, :4990].float(), dim=-1)
    lp_TK, ids_TK = logp_TV.topk(40, dim=-1)
    ids_TK[1:3, -8:] = torch.arange(4982, 4990, device=DEVICE)  # ids in the last partial block and word
    lp_TK[1:3, -8:] = logp_TV[1:3, 4982:4990]
    results = {}
    for backend in ("torch", "triton"):
        results[backend] = _run(
            lambda x, backend=backend: topk_divergence(
                x, ids_TK, lp_TK, kind, beta=0.3, tail=tail, student_temperature=1.3, vocab_size=4990, backend=backend
            ),
            student_TV,
            weights_T,
        )
    (ref_loss, ref_grad), (loss, grad) = results["torch"], results["triton"]
    assert _rel(loss, ref_loss) < 2e-5
    assert _rel(grad, ref_grad) < GRAD_TOL[dtype]


@needs_runtime
@pytest.mark.parametrize("tail", TAILS)
def test_union_support_on_the_kernel_path(tail: str) -> None:
    # Absent slots reach the kernels as local id -1 (like ids on another rank): the same loss and gradient as torch.
    student_TV, teacher_TV, weights_T = _data(5, 3000, torch.float32, seed=4)
    logp_TV = torch.log_softmax(teacher_TV[:, :2990].float(), dim=-1)
    t_lp_TK, t_ids_TK = logp_TV.topk(24, dim=-1)
    s_ids_TR = student_TV[:, :2990].topk(12, dim=-1).indices
    s_ids_TR[:, :3] = t_ids_TK[:, 5:8]  # repeated between the lists
    s_ids_TR[1, -4:] = -1  # no id
    s_lp_TR = logp_TV.gather(-1, s_ids_TR.clamp(min=0))
    results = {}
    for backend in ("torch", "triton"):
        results[backend] = _run(
            lambda x, backend=backend: union_divergence(
                x,
                t_ids_TK,
                t_lp_TK,
                s_ids_TR,
                s_lp_TR,
                "jsd",
                beta=0.3,
                tail=tail,
                coverage_weight=0.2,
                student_temperature=1.3,
                vocab_size=2990,
                backend=backend,
            ),
            student_TV,
            weights_T,
        )
    (ref_loss, ref_grad), (loss, grad) = results["torch"], results["triton"]
    assert _rel(loss, ref_loss) < 2e-5
    assert _rel(grad, ref_grad) < GRAD_TOL[torch.float32]


@needs_runtime
def test_inplace_backward_and_chunking_on_the_kernel_path() -> None:
    student_TV, teacher_TV, weights_T = _data(9, 4200, torch.float32, seed=2)
    ids_TK = torch.randperm(4200, generator=torch.Generator().manual_seed(3))[:16].repeat(9, 1).to(DEVICE)
    lp_TK = torch.full((9, 16), -4.0, device=DEVICE)
    for fn in (
        lambda x, **kw: dense_divergence(x, teacher_TV, "reverse_kl", backend="triton", **kw),
        lambda x, **kw: topk_divergence(x, ids_TK, lp_TK, "jsd", backend="triton", **kw),
    ):
        loss, grad = _run(fn, student_TV, weights_T)
        base = student_TV.clone().requires_grad_(True)
        logits = base * 1.0
        loss_inplace = fn(logits, inplace_backward=True, chunk_size=4)
        (loss_inplace * weights_T).sum().backward()
        assert _rel(loss_inplace, loss) < 1e-6
        assert _rel(base.grad, grad) < 1e-6


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda", reason="realistic shapes only on a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_shape_on_gpu(dtype: torch.dtype) -> None:
    # Qwen's vocabulary split over TP=2, 256 tokens.
    student_TV, teacher_TV, weights_T = _data(256, 75968, dtype, seed=4)
    ids_TK = torch.log_softmax(teacher_TV.float(), -1).topk(256, -1)
    for fn in (
        lambda x, backend: dense_divergence(x, teacher_TV, "forward_kl", backend=backend),
        lambda x, backend: dense_divergence(x, teacher_TV, "jsd", backend=backend),
        lambda x, backend: topk_divergence(x, ids_TK.indices, ids_TK.values, "forward_kl", backend=backend),
    ):
        ref_loss, ref_grad = _run(lambda x, fn=fn: fn(x, "torch"), student_TV, weights_T)
        loss, grad = _run(lambda x, fn=fn: fn(x, "triton"), student_TV, weights_T)
        assert _rel(loss, ref_loss) < 1e-4
        assert _rel(grad, ref_grad) < GRAD_TOL[dtype]


@needs_triton_compiler
def test_every_kernel_compiles_for_hopper_without_a_gpu() -> None:
    # Ahead-of-time compilation to sm_90 cubin (triton ships ptxas): catches what the interpreter cannot (types of
    # loop-carried values, constexpr branches, pointer arithmetic) on a machine with no GPU.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = divergence_triton
    row = {"stride_s": "i64", "n_cols": "i32", "inv_ts": "fp32"}
    for dt in ("fp32", "bf16"):
        dense = {"s_ptr": f"*{dt}", "t_ptr": f"*{dt}", "stride_t": "i64", "inv_tt": "fp32"}
        jobs = [
            (
                k._dense_jsd_kernel,
                {
                    **dense,
                    "lse_s_ptr": "*fp32",
                    "lse_t_ptr": "*fp32",
                    "out_ptr": "*fp32",
                    "log_beta": "fp32",
                    "log_1m_beta": "fp32",
                },
                {"BLOCK": 4096},
            ),
            (
                k._topk_grad_kernel,
                {"s_ptr": f"*{dt}", "out_ptr": f"*{dt}", "lse_s_ptr": "*fp32", "scale_ptr": "*fp32", "stride_o": "i64"},
                {"BLOCK": 4096},
            ),
            (
                k._scatter_ids_kernel,
                {
                    "out_ptr": f"*{dt}",
                    "ids_ptr": "*i64",
                    "vals_ptr": "*fp32",
                    "stride_o": "i64",
                    "stride_ids": "i64",
                    "stride_vals": "i64",
                    "K": "i32",
                },
                {"BLOCK_K": 256},
            ),
        ]
        for kind in (0, 1, 2):
            jobs.append((k._dense_stats_kernel, {**dense, "out_ptr": "*fp32"}, {"KIND": kind, "BLOCK": 4096}))
            jobs.append(
                (
                    k._dense_grad_kernel,
                    {
                        **dense,
                        "out_ptr": f"*{dt}",
                        "lse_s_ptr": "*fp32",
                        "lse_t_ptr": "*fp32",
                        "coef_ptr": "*fp32",
                        "scale_ptr": "*fp32",
                        "stride_o": "i64",
                        "log_beta": "fp32",
                        "log_1m_beta": "fp32",
                    },
                    {"KIND": kind, "BLOCK": 4096},
                )
            )
        for has_tail in (True, False):
            jobs.append(
                (
                    k._topk_stats_kernel,
                    {"s_ptr": f"*{dt}", "words_ptr": "*i64", "out_ptr": "*fp32", "stride_w": "i64"},
                    {"HAS_TAIL": has_tail, "BLOCK": 4096},
                )
            )
        for fn, types, constexprs in jobs:
            names = fn.arg_names
            known = {**row, **types}
            signature = {name: ("constexpr" if name in constexprs else known[name]) for name in names}
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 8},
            )
            assert "cubin" in compiled.asm, fn.__name__
