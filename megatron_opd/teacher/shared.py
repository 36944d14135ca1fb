"""One rank asks a remote teacher, every rank of its tensor-parallel group gets the scores.

Every tensor-parallel rank of the student's last pipeline stage needs the same top-k (each computes the loss on
its vocabulary shard), but a server should score each sequence once, not once per TP rank. The group's source rank
holds the real back end (the fault-tolerant client); ``result()`` of the returned future is a collective over the
group that broadcasts the scores (or the source's error, so no rank waits forever). Ranks of other pipeline stages
have no loss and get empty scores without asking.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.distributed as dist

from megatron_opd.interfaces import TeacherBackend, TeacherScores, completed
from megatron_opd.teacher.capabilities import SERVER
from megatron_opd.teacher.transport import TeacherError


class LazyFuture(Future):
    """A future resolved by its first ``result()`` call (``_resolve``), for results that are collectives: every
    rank of the group calls ``result()``, in order, and every rank raises the same error."""

    def result(self, timeout: float | None = None) -> TeacherScores:
        if not self.done():
            try:
                self.set_result(self._resolve(timeout))
            except BaseException as err:  # noqa: BLE001 - surfaced by super().result()
                self.set_exception(err)
        return super().result()

    def _resolve(self, timeout: float | None) -> TeacherScores:
        raise NotImplementedError


class _BroadcastFuture(LazyFuture):
    """A future whose ``result()`` broadcasts the source rank's scores: every rank of the group must call it, in order."""

    def __init__(self, inner: Future | None, group, src: int, device: torch.device) -> None:
        super().__init__()
        self._inner, self._group, self._src, self._device = inner, group, src, device

    def _resolve(self, timeout: float | None) -> TeacherScores:
        device = self._device
        error, scores, failure = "", None, None
        if self._inner is not None:
            try:
                scores = self._inner.result(timeout)
            except Exception as err:  # noqa: BLE001 - told to the other ranks, then raised here too
                error = f"{type(err).__name__}: {err}"
                failure = err
        header = torch.zeros(6, dtype=torch.int64, device=device)
        message = error.encode("utf-8")
        if self._inner is not None:
            hidden = None if scores is None else scores.dense_hidden
            first = None if scores is None else (hidden if hidden is not None else scores.topk_ids)
            k = 0 if scores is None or hidden is not None else scores.topk_ids.shape[-1]
            r = -1 if scores is None or scores.requested_logprobs is None else scores.requested_logprobs.shape[-1]
            n, s = (0, 0) if first is None else first.shape[:2]
            h = 0 if hidden is None else hidden.shape[-1]
            header.copy_(torch.tensor([len(message), n, s, k, r, h]))
        dist.broadcast(header, src=self._src, group=self._group)
        length, n, s, k, r, h = header.tolist()
        if length:
            text = torch.zeros(length, dtype=torch.uint8, device=device)
            if self._inner is not None:
                text.copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))
            dist.broadcast(text, src=self._src, group=self._group)
            if failure is not None:
                raise failure
            raise TeacherError(f"the teacher request of rank {self._src} failed: {bytes(text.tolist()).decode()}")
        shapes = {"dense_hidden": (n, s, h)} if h else {"topk_ids": (n, s, k), "topk_logprobs": (n, s, k)}
        if r >= 0:
            shapes["requested_logprobs"] = (n, s, r)
        out = {}
        for name, shape in shapes.items():
            dtype = torch.int64 if name == "topk_ids" else torch.float32
            if self._inner is not None:
                tensor = getattr(scores, name).to(device=device, dtype=dtype).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=self._src, group=self._group)
            out[name] = tensor.cpu()
        return TeacherScores(**out)


class GroupSharedTeacher:
    """``TeacherBackend`` for every rank: ``backend`` on the group's source rank, a broadcast to the others (top-k,
    requested log-probabilities, or the final hidden states of ``teacher.transfer=hidden``)."""

    supports_dense = SERVER.dense

    def __init__(
        self,
        backend: TeacherBackend | None,
        *,
        group,
        src: int,
        active: bool = True,
        supports_requested_logprobs: bool = True,
    ) -> None:
        from megatron_opd.distributed.device import collective_device

        self.backend = backend
        self.supports_requested_logprobs = supports_requested_logprobs
        """Given, not asked: ranks without the back end must give the same answer (a vLLM teacher has none)."""
        self.group = group
        self.src = src
        self.active = active
        self.device = collective_device()
        self.shared = active and dist.is_initialized() and dist.get_world_size(group) > 1

    def score(
        self, tokens: torch.Tensor, request_ids: torch.Tensor | None = None, lengths: list[int] | None = None
    ) -> Future[TeacherScores]:
        """The scores of ``tokens`` on every active rank; ``result()`` is a collective over the group."""
        if not self.active:
            return completed(TeacherScores())
        inner = None
        if self.backend is not None:
            try:
                inner = self.backend.score(tokens, request_ids, lengths)
            except Exception as err:  # noqa: BLE001 - shared like any other failure, or the group would wait forever
                inner = Future()
                inner.set_exception(err)
        if not self.shared:
            assert inner is not None, "a group of one rank must hold the back end"
            return inner
        return _BroadcastFuture(inner, self.group, self.src, self.device)
