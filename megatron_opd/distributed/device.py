"""Which accelerator this process runs on, decided at run time.

CUDA uses NCCL, Ascend NPUs (``torch_npu``) use HCCL, and everything else runs on the CPU with gloo.
Nothing here imports an optional accelerator package unless it is installed, so
``import megatron_opd`` works on a machine with neither CUDA nor ``torch_npu``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

DeviceType = Literal["cuda", "npu", "cpu"]


@dataclass(frozen=True)
class Accelerator:
    """The device type of this process and the collective back end that goes with it."""

    type: DeviceType
    backend: str

    def device(self, local_rank: int = 0) -> torch.device:
        """The ``torch.device`` this process should place tensors on."""
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, local_rank)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its local accelerator (no-op on CPU)."""
        if self.type == "cuda":
            torch.cuda.set_device(local_rank)
        elif self.type == "npu":
            torch.npu.set_device(local_rank)  # type: ignore[attr-defined]


def npu_available() -> bool:
    """True when ``torch_npu`` is installed and sees at least one Ascend device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


@cache
def detect_accelerator(preferred: str | None = None) -> Accelerator:
    """Pick the accelerator: ``preferred`` ("cuda", "npu", "cpu") if given, else CUDA, NPU, CPU in order."""
    if preferred not in (None, "auto", "cuda", "npu", "cpu"):
        raise ValueError(f"device must be one of auto, cuda, npu, cpu; got {preferred!r}")
    if preferred in (None, "auto"):
        if torch.cuda.is_available():
            preferred = "cuda"
        elif npu_available():
            preferred = "npu"
        else:
            preferred = "cpu"
    if preferred == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but torch.cuda.is_available() is False")
    if preferred == "npu" and not npu_available():
        raise RuntimeError("device='npu' was requested but torch_npu is not installed or sees no device")
    backend = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[preferred]
    return Accelerator(type=preferred, backend=backend)  # type: ignore[arg-type]


def has_transformer_engine() -> bool:
    """True when TransformerEngine can be imported *and* used (it raises RuntimeError without cuDNN)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install must never break the package
        return False
    return True


def collective_device() -> torch.device:
    """Where small tensors for collectives must live: NCCL/HCCL need the accelerator, gloo takes the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "npu") and npu_available():
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")
