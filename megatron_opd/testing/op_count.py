"""Count the operators a region launches, the CPU-visible measure of a launch-bound layer.

A small layer on a GPU costs about one kernel launch per operator, whatever its FLOPs: a Mixture-of-Experts layer's
router and token permutation are dozens of tiny operators. :func:`count_ops` records every aten operator that
reaches a kernel (views, ``empty`` allocations and metadata operators are left out: they launch nothing), so a test
can pin a layer's count and a fusion can show what it saves, on CPU.

A ``torch.library.custom_op`` (``megatron_opd::...``: the MoE router, permutation, activation and combine) is
counted as one operator: the counter sees it and not the torch operators its CPU implementation runs inside. That
is the launch count on CUDA only because each such operator's CUDA implementation is one Triton kernel
(``kernels/moe_router_triton.py``, ``kernels/moe_dispatch_triton.py``); a custom operator that launched several
kernels would be under-counted here.
"""

from __future__ import annotations

import contextlib
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = frozenset(
    {
        "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::detach", "aten::lift_fresh",
        "aten::_to_copy_no_op", "aten::set_", "aten::resize_", "aten::_reshape_alias", "aten::alias", "aten::_unsafe_view",
        "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "aten::sym_size", "aten::sym_numel",
        "aten::sym_stride", "aten::sym_storage_offset", "aten::is_pinned", "aten::record_stream",
    }
)  # fmt: skip
"""aten operators that launch no device kernel (allocation, aliasing, metadata)."""


def launches_kernel(func) -> bool:
    """Whether the aten operator ``func`` launches a kernel: neither a view nor one of :data:`NO_KERNEL`."""
    return not func.is_view and func._schema.name not in NO_KERNEL


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            self.counts[func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **kwargs or {})


@contextlib.contextmanager
def count_ops(counts: Counter | None = None):
    """Yields a ``Counter`` of operator name -> calls, filled while active (forward and, when ``backward()`` runs
    inside, the autograd engine's operators too)."""
    counts = Counter() if counts is None else counts
    with _OpCounter(counts):
        yield counts
