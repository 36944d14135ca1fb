"""Find host syncs: every place a forward or a step makes the host wait for the device.

On a GPU a host sync stalls the launch queue (the layers after it cannot be queued while the device catches up) and
breaks CUDA graphs, so the project's hot loops must not sync. On CPU nothing waits, so the tests look for the
*calls* that would: :func:`count_host_reads` catches Python code reading a tensor's values (``.item()``,
``.tolist()``, ``float(t)``, ``if t:``), :func:`count_sync_ops` the operators whose output size depends on the
values (``nonzero``, ``masked_select``, a boolean-mask index), which make the host wait for the device to size
their result.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Every way Python code reads a tensor's values to the host (on a GPU, a device-to-host sync), and nonzero, whose
# output size the host must wait for.
HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "nonzero")
HOST_COPIES = ("cpu",)
"""A device tensor copied to the host: a no-op on a CPU tensor, so only the call shows it."""


@contextlib.contextmanager
def count_host_reads(reads: list[str], names: tuple[str, ...] = HOST_READS):
    """Appends to ``reads`` the caller's file, line and function of every host read of a tensor's values while
    active: the fake wraps ``torch.Tensor``'s readers, so tensors still compute as usual."""
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name):
        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            reads.append(f"{name} at {caller.filename}:{caller.lineno} in {caller.name}")
            return originals[name](self, *args, **kwargs)

        return read

    try:
        for name in names:
            setattr(torch.Tensor, name, counting(name))
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item() and every Python scalar conversion
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique_dim",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::bincount",  # sizes its output by the input's maximum
        "aten::equal",
        "aten::is_nonzero",
    }
)
"""aten operators that make the host wait for the device on a GPU (their result's size or value goes to the host)."""


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def sync_op_name(func, args, kwargs) -> str | None:
    """The aten operator's name when it syncs the host on a GPU, else None."""
    name = func._schema.name
    if name in SYNC_OPS:
        return name
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_") and _bool_index(args):
        return f"{name} (boolean mask)"
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
        if len(args) < 2 or isinstance(args[1], torch.Tensor):  # repeats given as a tensor: the total is read
            return f"{name} (no output_size)"
    return None


class _SyncOps(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_op_name(func, args, kwargs)
        if name is not None:
            caller = next(
                (f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename),
                None,
            )
            where = f" at {caller.filename}:{caller.lineno} in {caller.name}" if caller else ""
            self.found.append(name + where)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_sync_ops(found: list[str]):
    """Appends to ``found`` every syncing aten operator (:data:`SYNC_OPS`, boolean-mask indexing,
    ``repeat_interleave`` without an output size) run while active, with the first caller outside torch."""
    with _SyncOps(found):
        yield found


@contextlib.contextmanager
def count_host_syncs(found: list[str]):
    """Both: Python reads of tensor values and host copies (:func:`count_host_reads`), and syncing operators
    (:func:`count_sync_ops`)."""
    with count_host_reads(found, HOST_READS + HOST_COPIES), count_sync_ops(found):
        yield found
