"""The gloo transport of a weight sync, independent of vLLM's classes: rendezvous, bucket send and receive.

Trainer rank 0 (the sender) hosts a TCP store and forms a gloo group of its own with every vLLM worker (never the
job's default group). A sync broadcasts packed buckets (:mod:`megatron_opd.weight_sync.buckets`) from rank 0; after
every bucket both sides all-reduce a failure flag, so a worker that cannot load a bucket stops the sender with its
error instead of leaving it blocked in the next broadcast. Used by the weight-transfer engine
(:mod:`megatron_opd.weight_sync.gloo_engine`) and by the ``reload_weights`` fallback
(:mod:`megatron_opd.weight_sync.reload_fallback`), which differ only in how the worker applies the tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_opd.dtypes import TensorMeta, dtype_name
from megatron_opd.weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    metas_from_lists,
    pack,
    plan_buckets,
    unpack,
)

logger = logging.getLogger(__name__)

_STORE_PREFIX = "megatron_opd_weight_sync"


@dataclass
class TransferGroup:
    """A gloo process group and the TCP store it rendezvoused through (which must outlive it)."""

    pg: dist.ProcessGroup
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From the sender (rank 0) to every worker."""
        self.pg.broadcast(tensor, 0).wait()


def open_gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> TransferGroup:
    """A gloo group of its own (not the job's default group): rank 0 hosts the TCP store at ``host:port``."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    elif host in ("127.0.0.1", "localhost"):
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return TransferGroup(
        dist.ProcessGroupGloo(dist.PrefixStore(_STORE_PREFIX, store), rank, world_size, options), store
    )


def exchange_status(group: TransferGroup, failed: bool) -> bool:
    """All-reduce a failure flag: True when any member failed (a sync point after every bucket)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    group.pg.allreduce([flag]).wait()
    return bool(flag.item())


@dataclass
class GlooInitInfo:
    """Worker-side init info: where the sender's store is, the workers' first rank, the bucket size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo:
    """One sync: every tensor's Hugging Face name, dtype and full shape, in stream order (JSON-safe)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = 0
    """How the sender cut this sync into buckets (0: the size agreed at init), so both ends always agree."""
    partial: bool = False
    """Only the layers that changed (a LoRA student's adapted ones): the others keep their weights
    (:mod:`megatron_opd.weight_sync.partial`)."""


def worker_rank(parallel_config, rank_offset: int) -> int:
    """A vLLM worker's rank in the transfer group (unique across vLLM's data-parallel replicas)."""
    return rank_offset + parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def receive_buckets(group: TransferGroup, info: GlooUpdateInfo, bucket_bytes: int) -> Iterator[list]:
    """Yield each received bucket as ``[(name, tensor), ...]``; the consumer loads it before asking for the next.

    A consumer that fails must ``close()`` the generator: that reports the failure at the bucket's status exchange.
    """
    metas = metas_from_lists(info.names, info.dtype_names, info.shapes)
    for bucket in plan_buckets(metas, info.bucket_bytes or bucket_bytes):
        # A fresh buffer per bucket: vLLM's layerwise reload keeps views until a layer is complete.
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        group.broadcast(buffer)
        try:
            yield list(unpack(buffer, metas, bucket))
        except BaseException:
            exchange_status(group, failed=True)
            raise
        if exchange_status(group, failed=False):
            raise RuntimeError("the trainer aborted the weight update")


def checked_pairs(source, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The source's pairs, each checked against its ``metadata()`` entry (a mismatch would split buckets wrongly)."""
    count = 0
    for name, tensor in source:
        if count >= len(metas):
            raise ValueError(f"the weight source yielded more tensors than metadata() declared; first extra: {name!r}")
        meta = metas[count]
        if name != meta.name or (
            tensor is not None and (tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape)
        ):
            got = repr(name) if tensor is None else f"{name!r} {tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(
                f"weight source tensor {count}: metadata() declared {meta.name!r} {meta.dtype} {meta.shape}, "
                f"iteration gave {got}"
            )
        count += 1
        yield name, tensor
    if count != len(metas):
        raise ValueError(f"the weight source yielded {count} tensors, metadata() declared {len(metas)}")


class GlooSender:
    """The trainer side of a sync, on every trainer rank: all iterate the source (its gathers are collectives),
    rank 0 packs and broadcasts. ``client`` is the four-method weight-sync control plane of the vLLM engine
    (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``, ``finish_weight_update``).

    ``after_bucket(index)`` runs on the sender after each bucket has been loaded (progress, fault injection).
    """

    def __init__(self, *, client, source, is_sender: bool, bucket_bytes: int, timeout_s: float) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group: TransferGroup | None = None
        self.after_bucket: Callable[[int], None] | None = None
        self.bytes_sent = 0
        self.tensors_sent = 0

    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        """Sender only: form the transfer group with the workers (they join inside ``init_weight_transfer_engine``)."""
        worker_info = GlooInitInfo(
            master_address=master_address,
            master_port=master_port,
            rank_offset=1,
            world_size=world_size,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(self.client.init_weight_transfer_engine, asdict(worker_info))
            self.group = open_gloo_group(master_address, master_port, 0, world_size, self.timeout_s)
            future.result()

    def send_weights(self, weight_version: str | None = None) -> None:
        """One full sync; on every trainer rank. ``weight_version`` is committed by ``finish_weight_update``."""
        metas = [TensorMeta(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]
        if not self.is_sender:
            for _ in self.source:  # keep in step with the sender's gathers
                pass
            return
        if self.group is None:
            raise RuntimeError("the transfer group is not connected: call connect (trainer_init) first")
        info = asdict(
            GlooUpdateInfo(
                names=[m.name for m in metas],
                dtype_names=[dtype_name(m.dtype) for m in metas],
                shapes=[list(m.shape) for m in metas],
                bucket_bytes=self.bucket_bytes,
                partial=bool(getattr(self.source, "changed_only", False)),
            )
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            # The workers receive inside update_weights while this thread broadcasts.
            future = pool.submit(self.client.update_weights, info)
            self._send(checked_pairs(self.source, metas), metas, future)
            future.result()
        finally:
            pool.shutdown(wait=False)  # never join a worker blocked in a collective that will not complete
        self.client.finish_weight_update(weight_version)

    def _send(self, pairs: Iterator, metas: list[TensorMeta], future: Future) -> None:
        """Broadcast bucket after bucket. On a failure here the workers are told to abort (a filler bucket and a
        failed status), so the engine is left partial but responsive, and the source is drained so that the other
        trainer ranks finish their gathers; then the error is raised."""
        self.bytes_sent = self.tensors_sent = 0
        buckets = plan_buckets(metas, self.bucket_bytes)
        for index, bucket in enumerate(buckets):
            stage = "pack"  # -> "sent" (broadcast done) -> "checked" (status exchanged)
            try:
                tensors = [next(pairs)[1] for _ in range(bucket.start, bucket.stop)]
                buffer = pack(tensors, bucket)
                del tensors
                if future.done():
                    future.result()  # the worker failed outside the collectives: raise its error, do not hang
                self.group.broadcast(buffer)
                stage = "sent"
                failed = exchange_status(self.group, failed=False)
                stage = "checked"
                if failed:
                    future.result()  # the worker's error
                    raise RuntimeError(f"vLLM failed to load bucket {index} of the weight update")
                self.bytes_sent += bucket.nbytes
                self.tensors_sent += bucket.stop - bucket.start
                if self.after_bucket is not None:
                    self.after_bucket(index)
            except BaseException:
                if not future.done():
                    self._abort(stage, bucket, buckets[index + 1] if index + 1 < len(buckets) else None)
                self._drain(pairs)
                raise
        for _ in pairs:  # the source's own end-of-stream check
            pass

    def _abort(self, stage: str, bucket, next_bucket) -> None:
        """Release workers waiting in a collective of this sync (best effort: a dead worker cannot be told)."""
        try:
            if stage == "checked":
                if next_bucket is None:
                    return  # the workers already left update_weights; finish_weight_update is never sent
                bucket, stage = next_bucket, "pack"
            if stage == "pack":
                self.group.broadcast(torch.zeros(bucket.nbytes, dtype=torch.uint8))
            exchange_status(self.group, failed=True)
        except Exception as err:  # noqa: BLE001
            logger.warning("could not tell the vLLM workers to abort the weight update: %s", err)

    @staticmethod
    def _drain(pairs: Iterator) -> None:
        try:
            for _ in pairs:
                pass
        except Exception:  # noqa: BLE001 - the source's own error; the original one is raised
            pass

    def shutdown(self) -> None:
        self.group = None
