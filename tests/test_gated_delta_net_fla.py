"""fla's fused Gated DeltaNet kernels (``build.gated_delta_net_kernel=fla``) against our PyTorch forms, through the
mixer: a whole sequence over two chunks, two packed sequences (one fla call with ``cu_seqlens``), a prefill then
decode steps from the sampler's state (``fused_recurrent_gated_delta_rule``), and the gradients of a chunked pass.
This pins the argument mapping of ``models.gated_delta_kernels`` (grouped value heads, L2 norm in the kernel, log
decay, state layout, keyword arguments).

Skipped where fla is not installed (CI does not install it: ``pip install --no-deps flash-linear-attention fla-core``
to run it). On CUDA the kernels run compiled; on CPU the test runs itself again in a process with
``TRITON_INTERPRET=1`` (read when kernels are defined), under two shims for triton's interpreter: autotuning keeps one
config (the interpreter has no benchmarker), and a plain ``range`` in fla's kernels yields ints with ``.to``.
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.models.gated_delta_kernels import fla_installed

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_HERE = torch.cuda.is_available() or INTERPRETED

pytestmark = pytest.mark.skipif(not fla_installed(), reason="fla (flash-linear-attention) is not installed")


def test_fla_matches_torch_under_triton_interpreter():
    """On CPU: this file's kernel tests in a process with ``TRITON_INTERPRET=1``."""
    if RUNS_HERE:
        pytest.skip("the kernel tests run in this process")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "4 passed" in out.stdout, out.stdout[-2000:]


def _interpreter_shims() -> None:
    """Let fla's kernels run under triton's interpreter (test-only)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import _implicit_cvt

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    class _Int(int):
        def to(self, *args, **kwargs):
            return _implicit_cvt(int(self)).to(*args, **kwargs)

    def _range(*args):
        return (_Int(i) for i in builtins.range(*args))

    import fla.ops.gated_delta_rule  # noqa: F401 - loads the kernel modules to patch

    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops"):
            module.range = _range


@pytest.fixture(scope="module")
def mixers():
    """The same tiny mixer (2 key heads with 2 value heads each, as ``test_gated_delta_net``) with each kernel."""
    if not RUNS_HERE:
        pytest.skip("fla's kernels need CUDA or TRITON_INTERPRET=1")
    if INTERPRETED:
        _interpreter_shims()
    from megatron.core.transformer import TransformerConfig

    from megatron_opd.models.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                               linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
    one = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    built = {}
    for kernel in ("torch", "fla"):
        torch.manual_seed(0)
        module = GatedDeltaNet(config, GatedDeltaNetSubmodules(_Linear, _Linear), layer_number=1,
                               pg_collection=SimpleNamespace(tp=one), kernel=kernel)  # fmt: skip
        with torch.no_grad():
            module.out_norm_weight.add_(torch.randn(16) * 0.1)
            module.dt_bias.add_(torch.randn(4) * 0.1)
        built[kernel] = module.to(device)
    return built


class _Linear(torch.nn.Linear):
    def __init__(self, input_size: int, output_size: int, **_) -> None:
        super().__init__(input_size, output_size, bias=False)

    def forward(self, x):
        return super().forward(x), None


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(
        "cuda" if torch.cuda.is_available() else "cpu"
    )


def test_whole_sequence(mixers):
    """70 positions (two chunks of 64, the second partial), batch 2."""
    x = _x(70, 2, 32)
    with torch.no_grad():
        torch.testing.assert_close(mixers["fla"](x)[0], mixers["torch"](x)[0], atol=2e-5, rtol=1e-5)


def test_packed_sequences(mixers):
    """Three packed sequences (an empty one between them) and padding: one fla call with ``cu_seqlens``."""
    x = _x(76, 1, 32)
    cu = torch.tensor([0, 40, 40, 72], dtype=torch.int32, device=x.device)
    packed = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=None)
    with torch.no_grad():
        got, want = (mixers[k](x, packed_seq_params=packed)[0] for k in ("fla", "torch"))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_prefill_then_decode(mixers):
    """A 6-token prefill (chunked, final state out) then 2 decode steps (fused recurrent, from the state)."""
    x = _x(8, 2, 32)
    outs = {}
    with torch.no_grad():
        for kernel, mixer in mixers.items():
            context = SimpleNamespace()
            steps = [mixer(x[:6], inference_context=context)[0]]
            steps += [mixer(x[i : i + 1], inference_context=context)[0] for i in (6, 7)]
            outs[kernel] = (torch.cat(steps), context.gated_delta_states[1].recurrent)
    torch.testing.assert_close(outs["fla"][0], outs["torch"][0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(outs["fla"][1], outs["torch"][1], atol=2e-5, rtol=1e-5)


def test_gradients(mixers):
    """The backward of fla's chunked kernel: the input's and the parameters' gradients equal ours."""
    x = _x(20, 1, 32)
    grads = {}
    for kernel, mixer in mixers.items():
        mixer.zero_grad()
        xi = x.clone().requires_grad_(True)
        (mixer(xi)[0] ** 2).sum().backward()
        grads[kernel] = [xi.grad] + [p.grad for p in mixer.parameters()]
    for got, want in zip(grads["fla"], grads["torch"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
