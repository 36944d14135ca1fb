"""Progress reporting for conversions: the library reports bytes and tensors, the caller decides how to show them."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives a rank's total once, then each tensor as it is written."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def advance(self, nbytes: int, tensors: int) -> None: ...


class TqdmProgress:
    """A tqdm bar of bytes written with a running tensor count (``enabled=False`` shows nothing)."""

    def __init__(self, desc: str, enabled: bool = True) -> None:
        self.desc, self.enabled = desc, enabled
        self.bar = None
        self.total_tensors = 0
        self.tensors = 0

    def start(self, total_bytes: int, total_tensors: int) -> None:
        from tqdm import tqdm

        self.total_tensors = total_tensors
        self.bar = tqdm(
            desc=self.desc, total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not self.enabled
        )

    def advance(self, nbytes: int, tensors: int) -> None:
        self.tensors += tensors
        if self.bar is not None:
            self.bar.set_postfix_str(f"tensors {self.tensors}/{self.total_tensors}", refresh=False)
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
