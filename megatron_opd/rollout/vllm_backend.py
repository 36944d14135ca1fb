"""``rollout.backend=vllm``: rollouts from a vLLM engine, weights synced from the TP/PP-sharded student.

Rank 0 owns the engine (:class:`~megatron_opd.rollout.vllm_engine.EngineProcess`, a process of its own); every rank
takes part in a sync, since the student's shards are gathered from the ranks that hold them
(:class:`~megatron_opd.weight_sync.source.MegatronWeightSource`). The transfer goes through vLLM's weight-transfer
API (a trainer engine from ``WeightTransferTrainerFactory``: vLLM's NCCL engine with packed buffers on GPU, our
gloo engine on CPU) or, with ``weight_sync="reload"``, through ``collective_rpc`` + ``reload_weights``. With
``rollout.vllm_sleep`` (GPU) the engine sleeps while the trainer trains (:mod:`megatron_opd.rollout.sleep`).

A LoRA student's frozen base never changes: once the engine holds a complete sync, later syncs send only the
adapted layers (``MegatronWeightSource.changed_only``); a new or restarted engine gets the whole model first.

Versions are all-or-nothing: the engine tags rollouts with the version of its last *complete* sync. Before every
``generate`` rank 0 checks that the engine holds exactly the trainer's current version (a restarted or partially
updated engine does not) and, if not, all ranks re-send the current weights first. A sync that fails midway is
retried once on a fresh engine. ``generate`` is collective: every rank passes its data-parallel replica's prompts,
rank 0 samples them all in one engine call and hands each rank its replica's rollouts.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from megatron_opd.interfaces import DeferredFuture, Rollouts, SamplingParams
from megatron_opd.models.hf_config import load_architecture
from megatron_opd.rollout.sleep import SleepCycle
from megatron_opd.rollout.vllm_engine import (
    EngineGone,
    EngineOptions,
    EngineProcess,
    WeightsNotSynced,
    check_vllm_config,
)
from megatron_opd.weight_sync.buckets import DEFAULT_BUCKET_BYTES
from megatron_opd.weight_sync.source import check_against, hf_metadata

logger = logging.getLogger(__name__)


def _broadcast(value, src: int = 0):
    """``value`` of global rank ``src`` on every rank (a collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class VLLMRollout:
    """:class:`~megatron_opd.interfaces.RolloutBackend` on a vLLM engine owned by rank 0."""

    asynchronous = True
    """It samples in the background (an engine process or servers), so a scheduler can train meanwhile."""

    def __init__(
        self,
        source,
        options: EngineOptions,
        *,
        dp_rank: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_address: str = "127.0.0.1",
        timeout_s: float = 600.0,
        policy_version: int = 0,
        addresses: list[str] | None = None,
        allowed_token_ids: int | None = None,
        server_wait_s: float = 60.0,
    ) -> None:
        """``source``: this rank's weight source; ``options``: how rank 0 builds the engine (``options.model`` is
        the student's config folder); ``dp_rank``: this rank's data-parallel replica (its prompts); ``addresses``:
        separate vLLM servers (``host:port``) to use instead of an engine process of rank 0; ``server_wait_s``: how long
        to wait for one of them to answer (at the start, and when every server is down)."""
        self.addresses = list(addresses or [])
        self.server_wait_s = server_wait_s
        self.allowed_token_ids = allowed_token_ids
        """Servers of a padded student: sample only ids below this (their log-probs still normalise over every row)."""
        self.source = source
        self.options = options
        self.dp_rank = dp_rank
        self.bucket_bytes = bucket_bytes
        self.sync_address = sync_address
        self.timeout_s = timeout_s
        self.policy_version = policy_version
        self.rank = dist.get_rank()
        self.engine: EngineProcess | None = None
        self.transfer = None
        self.client: VersionedClient | None = None  # rank 0: the engine's control plane, as the transfer sees it
        self.sleep: SleepCycle | None = None  # rank 0: when the engine sleeps (rollout.vllm_sleep, GPU)
        self._fresh = False  # rank 0: the engine was just started and has never been sent weights
        self._complete = False  # every rank: the engine got one complete sync since it started (LoRA: partial next)
        self._outstanding = 0  # rollouts asked for and not yet collected (the same on every rank)
        self._in_flight: list[Future] = []  # rank 0: the engine's replies to those rollouts
        self.on_bucket = None  # rank 0: called after each bucket of a sync lands (tests inject faults here)
        self.sync_seconds = 0.0
        self.bytes_synced = 0
        self.tensors_synced = 0  # rank 0: how many tensors the last sync sent (a LoRA student's partial ones fewer)
        self.syncs = 0
        error = None
        if self.rank == 0:
            try:
                if not source.is_sender:
                    raise ValueError("global rank 0 must be the weight source's sender (DP 0, PP stage 0, TP rank 0)")
                # The engine's model must take exactly the tensors the student sends (names and shapes).
                engine_arch = load_architecture(options.model)
                check_vllm_config(options.model)
                check_against(
                    hf_metadata(source.arch, source.dtype),
                    hf_metadata(engine_arch, source.dtype),
                    f"vLLM model {options.model}",
                )
            except ValueError as err:
                error = str(err)
        error = _broadcast(error)
        if error is not None:
            raise ValueError(error)
        self._start_engine()

    # ---- engine life cycle (the engine lives on rank 0; every rank builds its side of the transfer) -------------
    def _start_engine(self) -> None:
        """(Re)start the engine on rank 0 and form the transfer; collective. The new engine holds no version."""
        from megatron_opd.distributed.ports import find_free_port

        error, port, workers = None, None, 1
        if self.rank == 0:
            try:
                if self.engine is not None:
                    self.engine.close()
                    self.engine = None
                started = time.perf_counter()
                if self.addresses:
                    from megatron_opd.rollout.vllm_server import ServerGroup

                    self.engine = ServerGroup(
                        self.addresses, self.timeout_s, self.options.max_model_len, self.server_wait_s
                    )
                    workers = self.engine.workers
                    logger.info("vLLM servers %s: %d workers", ",".join(self.addresses), workers)
                else:
                    self.engine = EngineProcess(self.options, start_timeout_s=self.timeout_s)
                    pid = self.engine.process.pid
                    logger.info("vLLM engine started in %.1f s (pid %d)", time.perf_counter() - started, pid)
                self._fresh = True
                self.sleep = SleepCycle(self.engine.call, enabled=self.options.enable_sleep_mode)
                port = find_free_port()
            except Exception as err:  # noqa: BLE001 - every rank must learn it before anyone raises
                error = err
        error_text, port, workers = _broadcast((None if error is None else str(error), port, workers))
        if error is not None:
            raise error
        if error_text is not None:
            raise RuntimeError(f"rank 0 could not start or reach the vLLM engine: {error_text}")
        self._complete = False  # a new engine (or servers' group) needs the whole model first
        self.transfer = self._transfer_engine(port, workers)

    def _transfer_engine(self, port: int, workers: int):
        """This rank's side of the transfer: a trainer engine from vLLM's factory (NCCL on GPU, our gloo engine on
        CPU), or the reload fallback's sender."""
        is_sender = self.rank == 0
        self.client = VersionedClient(self.engine)
        if self.options.weight_sync == "transfer_api":
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            info = transfer_init_info(
                self.options.backend,
                master_address=self.sync_address,
                master_port=port,
                world_size=1 + workers,  # the sender and every vLLM worker
                bucket_bytes=self.bucket_bytes,
                timeout_s=self.timeout_s,
                rank=0 if is_sender else max(self.rank, 1),
            )
            return WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)
        from megatron_opd.weight_sync.transport import GlooSender

        sender = GlooSender(
            client=self.client, source=self.source, is_sender=is_sender, bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
        )  # fmt: skip
        if is_sender:
            sender.connect(self.sync_address, port, 1 + workers)
        return sender

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ---- weight sync --------------------------------------------------------------------------------------------
    def _send(self, policy_version: int) -> str | None:
        """One sync attempt on every rank; the sender's error text (None on success), known to every rank."""
        from megatron_opd.faults import fault_point

        error = None
        if self.rank == 0:

            def after_bucket(index: int) -> None:
                # Fault injection (tests): MEGATRON_OPD_FAULT=kill_during_sync:V kills the trainer after the first
                # bucket of version V has landed, leaving the engine with a partial update.
                fault_point("kill_during_sync", policy_version)
                if self.on_bucket is not None:
                    self.on_bucket(index)

            self.transfer.after_bucket = after_bucket  # our gloo engine calls it; vLLM's NCCL engine does not
            self.client.version = str(policy_version)
        # LoRA: only the adapted layers once the engine holds the frozen base (the same decision on every rank).
        self.source.changed_only = self._complete and getattr(self.source, "frozen_base", False)
        try:
            if self.rank == 0:
                self.sleep.before_sync()
            self.transfer.send_weights()
        except Exception as err:  # noqa: BLE001 - every rank must learn the outcome before anyone raises
            error = f"{type(err).__name__}: {err}"
            logger.error("weight sync to vLLM failed: %s", error)
        finally:
            self.source.changed_only = False
        return _broadcast(error)

    def _membership_change(self) -> str | None:
        """Rank 0: why the servers' group must be formed anew (None for an engine process, or no change)."""
        check = getattr(self.engine, "membership_change", None)
        return check() if check is not None else None

    def sync_weights(self, policy_version: int) -> None:
        """Send the student's weights to the engine as ``policy_version`` (collective; all-or-nothing). Rollouts in
        flight finish first with the weights they were asked of; a server that went down or came back since the
        last sync makes the group form anew first (so the restarted one gets these weights)."""
        change = None
        if self.rank == 0:
            self.wait_in_flight()
            change = self._membership_change()
        change = _broadcast(change)
        if change is not None:
            logger.warning("forming the vLLM servers' group anew before the sync: %s", change)
            self._start_engine()
        started = time.perf_counter()
        self._fresh = False
        error = self._send(policy_version)
        if error is not None:
            # The engine may hold a partial update: replace it and re-send once.
            self._start_engine()
            error = self._send(policy_version)
            if error is not None:
                raise RuntimeError(f"weight sync to vLLM failed twice (version {policy_version}): {error}")
        self.policy_version = policy_version
        self._complete = True
        self.sync_seconds = time.perf_counter() - started
        self.syncs += 1
        if self.rank == 0:
            self.bytes_synced = getattr(self.transfer, "bytes_sent", 0)
            self.tensors_synced = getattr(self.transfer, "tensors_sent", 0)

    def _why_resync(self) -> tuple[str | None, bool]:
        """Rank 0: why the engine must be sent the current version again (None: it holds it), and whether it must
        be restarted (servers: the group formed anew) first."""
        if self.engine is None or not self.engine.alive:
            return "the engine process is not running", True
        change = self._membership_change()
        if change is not None:
            return change, True
        try:
            version = self.engine.call("state")["version"]
        except EngineGone as err:  # died since the check above (a server: went down)
            return str(err), True
        if version is None and self._fresh:
            return "the engine was never synced", False
        if version is None:  # partial: vLLM's reload state is mid-way, start from a clean engine
            return "the engine's weights are partial (a sync did not finish)", True
        if version != self.policy_version:
            return f"the engine holds version {version}, the trainer {self.policy_version}", False
        return None, False

    def _ensure_synced(self) -> None:
        """Re-send the current version when the engine does not hold it complete (restarted, partial); collective."""
        reason, restart = self._why_resync() if self.rank == 0 else (None, False)
        reason, restart = _broadcast((reason, restart))
        if reason is None:
            return
        logger.warning("re-syncing vLLM before sampling: %s", reason)
        if restart:
            self._start_engine()
        self.sync_weights(self.policy_version)

    def score(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        """Rank 0: each engine's log p(token_i | tokens_<i), i >= 1, of ``sequences``, by engine (the engine
        process, or each server by address); for the start-up check (``rollout.fidelity``)."""
        out = self.engine.call("score", sequences=sequences)
        return out.get("by_engine") or {"engine process": out["logprobs"]}

    # ---- sampling -----------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int) -> Future[Rollouts]:
        """Sample ``n`` responses per prompt of this rank's replica; returns at once while the engine samples.

        Collective over every rank of the job, and so is the handle's ``result()`` (rank 0 collects the engine's
        reply and scatters each replica's rollouts): every rank calls both in the same order. Several rollouts may
        be in flight; the engine samples them in order, and a weight sync first waits for all of them, so each is
        sampled by exactly the weights it is tagged with. An engine that died is restarted, re-synced with the
        current weights and asked again (the rollouts then carry that version).
        """
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("generate needs at least one prompt, and no empty prompt")
        if not self._outstanding:  # outstanding rollouts were checked when asked for, and nothing synced since
            self._ensure_synced()
        world = dist.get_world_size()
        asked = [None] * world if self.rank == 0 else None
        dist.gather_object((self.dp_rank, [list(p) for p in prompt_token_ids]), asked, dst=0)
        params = _params(sampling, self.options)
        if self.allowed_token_ids:
            params["allowed_token_ids"] = self.allowed_token_ids
        self._outstanding += 1
        request = {"pending": self._submit(asked, params, n), "version": self.policy_version}

        def collect() -> Rollouts:
            self._outstanding -= 1
            for attempt in range(2):
                replies, error = None, None
                if self.rank == 0:
                    try:
                        replies = self._split(asked, self._reply(request["pending"], request["version"]), n)
                        self.sleep.rollouts_collected(self._outstanding)
                    except Exception as err:  # noqa: BLE001 - every rank must learn it, or they would wait forever
                        error = err
                # A dead engine or server, or one whose weights are not the trainer's: sync afresh and ask again.
                died = isinstance(error, (EngineGone, WeightsNotSynced))
                error_text, died = _broadcast((None if error is None else f"{type(error).__name__}: {error}", died))
                if error_text is None:
                    box = [None]
                    dist.scatter_object_list(box, replies, src=0)
                    return box[0]
                if attempt == 0 and died:
                    logger.warning(
                        "the vLLM engine or a server failed a rollout (%s); re-syncing and asking again", error_text
                    )
                    self._ensure_synced()
                    request.update(pending=self._submit(asked, params, n), version=self.policy_version)
                    continue
                if error is not None:
                    raise error
                raise RuntimeError(f"rank 0's vLLM rollout failed: {error_text}")
            raise AssertionError("unreachable")

        return DeferredFuture(collect)

    def _submit(self, asked: list | None, params: dict, n: int) -> Future | None:
        """Rank 0: hand every replica's prompts to the engine (a failure is kept for ``result()`` to raise)."""
        if self.rank != 0:
            return None
        try:
            self.sleep.before_rollout()
            pending = self.engine.submit("generate", prompts=_prompts(asked), sampling=params, n=n)
        except Exception as err:  # noqa: BLE001 - raised by result(), where every rank learns of it
            pending = Future()
            pending.set_exception(err)
        self._in_flight.append(pending)
        return pending

    def _reply(self, pending: Future, version: int) -> dict:
        """Rank 0: the engine's answer to a submitted generate, checked to come from ``version``."""
        try:
            out = pending.result() if pending.done() else self.engine.wait(pending, self.timeout_s)
        finally:
            if pending in self._in_flight:
                self._in_flight.remove(pending)
        if out["version"] != version:
            raise RuntimeError(f"vLLM sampled with version {out['version']}, the trainer asked at {version}")
        return out

    def wait_in_flight(self) -> None:
        """Rank 0: let every submitted rollout finish before the weights change (their results are kept)."""
        for pending in list(self._in_flight):
            if not pending.done():
                try:
                    self.engine.wait(pending, self.timeout_s)
                except Exception:  # noqa: BLE001 - raised again by the rollout's own result()
                    pass

    def _split(self, asked: list, out: dict, n: int) -> list[Rollouts]:
        """Rank 0: the engine's rows -> the rollouts each rank must get."""
        replicas = _replicas(asked)
        by_replica, row = {}, 0
        for dp, prompts in replicas.items():
            by_replica[dp] = _rollouts(prompts, out, row, len(prompts) * n, n)
            row += len(prompts) * n
        return [by_replica[dp] for dp, _ in asked]


class VersionedClient:
    """The engine's weight-sync control plane as a trainer-side transfer engine sees it, committing ``version`` at
    ``finish_weight_update`` (vLLM's own trainer engines, NCCL's among them, finish without one)."""

    def __init__(self, client) -> None:
        self.client = client
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version if weight_version is not None else self.version)


def transfer_init_info(backend: str, *, bucket_bytes: int, timeout_s: float, **common):
    """The trainer-side init info of vLLM's weight-transfer ``backend``: ``nccl`` (vLLM's own engine; packed
    buffers of ``bucket_bytes``, two in rotation) or our gloo engine (buckets of ``bucket_bytes``)."""
    from megatron_opd.weight_sync.plugin import register

    register()
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, **common)
    from megatron_opd.weight_sync.gloo_engine import BACKEND, GlooTrainerInitInfo

    if backend != BACKEND:
        raise ValueError(f"unknown weight-transfer back end {backend!r}: nccl or {BACKEND}")
    return GlooTrainerInitInfo(bucket_bytes=bucket_bytes, timeout_s=timeout_s, **common)


def _replicas(asked: list) -> dict[int, list[list[int]]]:
    """Every data-parallel replica's prompts once, in replica order (its tensor/pipeline ranks repeat them)."""
    replicas: dict[int, list[list[int]]] = {}
    for dp, prompts in asked:
        replicas.setdefault(dp, prompts)
    return dict(sorted(replicas.items()))


def _prompts(asked: list) -> list[list[int]]:
    return [p for prompts in _replicas(asked).values() for p in prompts]


def _params(sampling: SamplingParams, options: EngineOptions) -> dict:
    """The engine's sampling arguments."""
    if sampling.return_topk > options.max_logprobs:
        raise ValueError(f"return_topk={sampling.return_topk} exceeds the engine's max_logprobs={options.max_logprobs}")
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "seed": sampling.seed,
        "return_topk": sampling.return_topk,
    }


def _rollouts(prompts: list[list[int]], out: dict, start: int, count: int, n: int) -> Rollouts:
    responses = [torch.tensor(t, dtype=torch.int64) for t in out["tokens"][start : start + count]]
    return Rollouts(
        prompt_ids=[torch.tensor(prompts[i // n], dtype=torch.int64) for i in range(count)],
        response_ids=responses,
        response_mask=[torch.ones_like(r) for r in responses],
        logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in out["logprobs"][start : start + count]],
        finish_reasons=list(out["finish_reasons"][start : start + count]),
        prompt_index=[i // n for i in range(count)],
        policy_version=int(out["version"]),
        topk_ids=[torch.tensor(t, dtype=torch.int64).reshape(len(t), -1) for t in out["topk"][start : start + count]]
        if out["topk"]
        else None,
        drawn_logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in out["drawn"][start : start + count]]
        if out.get("drawn")
        else None,
    )
