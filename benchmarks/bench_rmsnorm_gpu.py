"""torch.nn.RMSNorm against the Triton RMSNorm (``kernels/rmsnorm_triton.py``), forward + backward, bf16, one GPU.

    python benchmarks/bench_rmsnorm_gpu.py            # needs CUDA and triton

Shapes: [4096, 2048] (Qwen3-1.7B's layer norms at 4096 tokens), [65536, 128] (its query QK-norm: 4096 tokens x 16
heads of 128), [4096, 5120] (a 14B/32B-wide layer norm). Each time is the median of 20 CUDA-event timings of GPU time
after warm-up (see ``_median_ms``); gradients come from ``torch.autograd.grad`` (no accumulation into ``.grad``). The error columns give, for
each of y, dx and dw, max |a - ref| / max |ref| against float64 from the same bf16 inputs: torch's, then the kernel's.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((4096, 2048), (65536, 128), (4096, 5120))
EPS = 1e-6
WARMUP, REPEATS = 5, 20
SLEEP_CYCLES = 100_000_000  # ~50 ms at H100 clocks: longer than the host needs to queue the 20 timed calls


def _torch_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _median_ms(fn) -> float:
    """Median GPU time of ``fn``: the timed calls queue behind a GPU sleep, so the host's launch overhead (hidden in
    a training step, where the GPU runs behind the host) does not count, as in a profile's kernel times."""
    for _ in range(WARMUP):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPEATS)]
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _forward_backward(norm, x, w, dy):
    y = norm(x, w)
    return (y, *torch.autograd.grad(y, (x, w), dy))


def _errors(norm, x, w, dy) -> str:
    mine = _forward_backward(norm, x, w, dy)
    ref = _forward_backward(_torch_norm, *(t.detach().double().requires_grad_(True) for t in (x, w)), dy.double())
    return "/".join(
        f"{float((a.detach().double() - r.detach()).abs().max() / r.detach().abs().max()):.1e}"
        for a, r in zip(mine, ref)
    )


def _row(norm, x, w, dy) -> tuple[float, float, str]:
    """Forward and forward + backward times in microseconds, and the errors."""
    with torch.no_grad():
        fwd = _median_ms(lambda: norm(x, w))
    return 1e3 * fwd, 1e3 * _median_ms(lambda: _forward_backward(norm, x, w, dy)), _errors(norm, x, w, dy)


def main() -> None:
    from megatron_opd.kernels import rmsnorm_triton

    if not torch.cuda.is_available() or rmsnorm_triton.triton is None:
        sys.exit("bench_rmsnorm_gpu.py needs a CUDA GPU and triton; none here, nothing timed")
    print(f"{torch.cuda.get_device_name()}, bf16, eps={EPS}; GPU times in us, errors y/dx/dw vs float64\n")
    print(
        "| shape | torch fwd | triton fwd | torch fwd+bwd | triton fwd+bwd | speed-up fwd+bwd | torch error | triton error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in SHAPES:
        x = torch.randn(shape, generator=g, device="cuda").bfloat16().requires_grad_(True)
        w = (1 + 0.5 * torch.randn(shape[-1], generator=g, device="cuda")).bfloat16().requires_grad_(True)
        dy = torch.randn(shape, generator=g, device="cuda").bfloat16()
        t_fwd, t_both, t_err = _row(_torch_norm, x, w, dy)
        k_fwd, k_both, k_err = _row(lambda x, w: rmsnorm_triton.rms_norm(x, w, EPS), x, w, dy)
        print(
            f"| {list(shape)} | {t_fwd:.1f} | {k_fwd:.1f} | {t_both:.1f} | {k_both:.1f} | {t_both / k_both:.2f}x "
            f"| {t_err} | {k_err} |"
        )


if __name__ == "__main__":
    main()
