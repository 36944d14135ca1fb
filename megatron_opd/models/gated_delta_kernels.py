"""Which implementation runs the gated delta rule of :class:`~megatron_opd.models.gated_delta_net.GatedDeltaNet`:
our PyTorch forms, or fla's (flash-linear-attention) fused Triton kernels.

``build.gated_delta_net_kernel``: ``auto`` runs fla's kernels when fla is importable and the tensors are on CUDA
(else the PyTorch forms), ``torch`` always the PyTorch forms, ``fla`` always fla's (refused by name where fla is not
installed; on CPU its kernels run only under ``TRITON_INTERPRET=1``, which is how the tests compare them here).
fla is optional: megatron-opd never installs it.

fla's conventions, as this module maps them (checked against our forms in ``tests/test_gated_delta_net_fla.py``):
tensors are ``[b, s, heads, d]``; queries and keys keep their key heads (fla's grouped value heads: value head ``j``
reads key head ``j // ratio``, as our ``repeat_interleave``); ``use_qk_l2norm_in_kernel=True`` is our
:func:`~megatron_opd.models.gated_delta_net.l2norm` (same ``eps``); ``scale`` defaults to ``dk ** -0.5`` as ours;
``g`` is the log decay (``<= 0``) and ``beta`` the post-sigmoid step, both ``[b, s, h]``; states are
``[b, h, dk, dv]`` in float32 (``state_v_first=False``); packed sequences are one row with ``cu_seqlens``, each
from a zero state. ``fused_recurrent_gated_delta_rule`` takes ``gk``/``gv`` between ``g`` and ``beta``: every
argument after ``v`` is passed by name.
"""

from __future__ import annotations

import importlib.util
import os

import torch

KERNELS = ("auto", "torch", "fla")
"""The values of ``build.gated_delta_net_kernel``."""


def fla_installed() -> bool:
    """fla (PyPI ``flash-linear-attention`` / ``fla-core``) is importable; a cheap check that imports nothing."""
    return importlib.util.find_spec("fla") is not None


def check_kernel(kernel: str) -> None:
    """Refuse an unknown value, or ``fla`` where fla is not installed, naming the field and the fix."""
    if kernel not in KERNELS:
        raise ValueError(f"build.gated_delta_net_kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "fla" and not fla_installed():
        raise ValueError(
            "build.gated_delta_net_kernel=fla but fla (flash-linear-attention) is not installed: "
            "pip install flash-linear-attention, or set build.gated_delta_net_kernel=auto (fla where installed and on "
            "CUDA, else PyTorch) or torch"
        )


def uses_fla(kernel: str, device: torch.device) -> bool:
    """Whether a call on ``device`` runs fla's kernels under ``kernel``."""
    if kernel == "torch":
        return False
    if kernel == "fla":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"build.gated_delta_net_kernel=fla on {device.type} tensors: fla's Triton kernels need CUDA (or "
                "TRITON_INTERPRET=1, for tests); set build.gated_delta_net_kernel=auto or torch"
            )
        return True
    return device.type == "cuda" and fla_installed()


def fla_chunk(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    """fla's ``chunk_gated_delta_rule``: ``q``/``k`` ``[b, s, n, dk]`` (not yet L2-normed), ``v`` ``[b, s, h, dv]``,
    ``g``/``beta`` ``[b, s, h]``; returns ``[b, s, h, dv]`` and the final state(s) ``[b or sequences, h, dk, dv]``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )


def fla_recurrent(q, k, v, g, beta, initial_state):
    """fla's ``fused_recurrent_gated_delta_rule`` (decoding), same shapes as :func:`fla_chunk`."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
