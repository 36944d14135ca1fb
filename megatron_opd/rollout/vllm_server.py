"""``rollout.address=host:port[,host:port]``: rollouts from separate vLLM servers, synced over vLLM's HTTP
weight-transfer routes; and ``python -m megatron_opd.rollout.vllm_server`` to start such a server.

A server is vLLM's OpenAI server with its RL routes (``VLLM_SERVER_DEV_MODE=1``: ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/update_weight_version``,
``/weight_info``) and the gloo weight-transfer back end (``--weight-transfer-config '{"backend":
"megatron_opd_gloo"}'``, registered by this launcher or by the package's ``vllm.general_plugins`` entry point).
Token ids in and out (``/v1/completions`` with ``return_tokens_as_token_ids``).

All-or-nothing versions on a server: before a sync its weight version is set to ``partial``, and only
``/finish_weight_update`` sets the new one. Before every rollout rank 0 reads each server's version; a server
that does not hold the trainer's (restarted: its transfer group is gone too; or left partial) makes every rank
reconnect and re-send the current weights before it serves anything.

Servers come and go: the group is formed of the servers that answer (waiting up to ``rollout.server_wait_s`` for at
least one). A member that stops answering (during a rollout, a sync, or the check before either) or a left-out
server that answers again makes the trainer form the group anew, so the transfer group always spans exactly the
live servers, and a server that comes back is synced before it gets a rollout.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from megatron_opd.rollout.vllm_engine import EngineGone, WeightsNotSynced
from megatron_opd.server_wait import StartupWait

logger = logging.getLogger(__name__)

PARTIAL = "partial"


class ServerDown(EngineGone):
    """A vLLM server did not answer (like a dead engine process: the trainer forms the group anew and asks again)."""


def _as_version(value: str | None) -> int | None:
    """A server's weight version as the trainer's policy version; None for ``partial``, vLLM's ``default`` etc."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class ServerClient:
    """One vLLM server: its weight-sync control plane (``VLLMWeightSyncClient``), version, and completions."""

    def __init__(self, address: str, timeout_s: float = 600.0) -> None:
        self.address = address
        self.base = address if address.startswith("http") else f"http://{address}"
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, json: dict | None = None, timeout: float | None = None) -> Any:
        import requests

        try:
            reply = requests.request(method, f"{self.base}/{path}", json=json, timeout=timeout or self.timeout_s)
        except requests.RequestException as err:
            raise ServerDown(
                f"vLLM server {self.address} is down or unreachable ({type(err).__name__}) on /{path}; start it with "
                "python -m megatron_opd.rollout.vllm_server --model STUDENT_DIR --port PORT, or fix rollout.address"
            ) from err
        if reply.status_code >= 400:
            raise RuntimeError(f"vLLM server {self.address} /{path}: HTTP {reply.status_code}: {reply.text[:2000]}")
        return reply.json() if reply.content else None

    # control plane
    def world_size(self) -> int:
        return int(self._request("GET", "get_world_size?include_dp=true", timeout=30)["world_size"])

    def version(self) -> str | None:
        return self._request("GET", "weight_info", timeout=30).get("weight_version")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._request("POST", "init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "update_weight_version", {"new_version": PARTIAL})
        self._request("POST", "start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._request("POST", "update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request("POST", "finish_weight_update", {"weight_version": weight_version})

    def sleep(self, level: int = 1) -> None:
        self._request("POST", f"sleep?level={level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._request("POST", "wake_up" + ("?" + "&".join(f"tags={t}" for t in tags) if tags else ""))

    # data plane
    def complete(self, prompt: list[int], sampling: dict, seed: int, max_tokens: int) -> dict[str, Any]:
        body = {
            "model": self.model_name(),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "top_k": sampling["top_k"],
            "seed": seed,
            "stop_token_ids": sampling["stop_token_ids"],
            "ignore_eos": True,
            **(
                {"allowed_token_ids": list(range(sampling["allowed_token_ids"]))}
                if sampling.get("allowed_token_ids")
                else {}
            ),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        (choice,) = self._request("POST", "v1/completions", body)["choices"]
        lp = choice["logprobs"]
        return {
            "tokens": [int(t.rsplit(":", 1)[1]) for t in lp["tokens"]],
            "logprobs": [float(x) for x in lp["token_logprobs"]],
            "finish_reason": "stop" if choice["finish_reason"] == "stop" else "length",
        }

    def score(self, sequence: list[int]) -> list[float]:
        """log p(token_i | tokens_<i), i >= 1 (prompt log-probabilities; the rollout start-up check)."""
        import torch

        from megatron_opd.teacher.vllm_transport import parse_completions

        body = {"model": self.model_name(), "prompt": sequence, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        reply = self._request("POST", "v1/completions", body)
        actual = torch.tensor([sequence[1:]], dtype=torch.int64)
        _, _, requested = parse_completions(reply, 1, len(sequence) - 1, 0, actual)
        return requested[0, :, 0].tolist()

    def model_name(self) -> str:
        if not hasattr(self, "_model"):
            self._model = self._request("GET", "v1/models", timeout=30)["data"][0]["id"]
        return self._model


class ServerGroup:
    """Several servers driven as one engine: the control plane fans out (each server's workers get their own
    ranks in the transfer group), rollouts are split over the servers."""

    def __init__(self, addresses: list[str], timeout_s: float, max_model_len: int, wait_s: float = 0.0) -> None:
        """The group of the servers of ``addresses`` that answer; waits up to ``wait_s`` for at least one."""
        self.max_model_len = max_model_len
        waiting = StartupWait(f"vLLM server at {','.join(addresses)}", wait_s, "rollout.server_wait_s")
        while True:
            self.servers, self.sizes, self.left_out, errors = [], [], [], []
            for client in [ServerClient(a, timeout_s) for a in addresses]:
                try:
                    self.sizes.append(client.world_size())
                    self.servers.append(client)
                except ServerDown as err:
                    self.left_out.append(client)
                    errors.append(str(err))
            if self.servers:
                break
            waiting.progress(errors[-1])
            if waiting.expired():
                raise ServerDown(
                    f"no vLLM server answered within rollout.server_wait_s={wait_s:g} s: {'; '.join(errors)}"
                )
            waiting.sleep(2.0)
        if self.left_out:
            logger.warning(
                "vLLM servers %s do not answer: rollouts go to %s until they are back",
                ",".join(c.address for c in self.left_out), ",".join(c.address for c in self.servers),
            )  # fmt: skip
        self.pool = ThreadPoolExecutor(max_workers=max(8, 2 * len(self.servers)))
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-servers")
        self.alive = True

    @property
    def workers(self) -> int:
        return sum(self.sizes)

    def membership_change(self) -> str | None:
        """Why the group must be formed anew (a member is down, a left-out server answers again), or None."""
        for client in self.servers:
            try:
                client.version()
            except ServerDown:
                return f"vLLM server {client.address} is down"
        for client in self.left_out:
            try:
                client.world_size()
                return f"vLLM server {client.address} is back"
            except ServerDown:
                pass
        return None

    def _all(self, fn) -> list:
        return [f.result() for f in [self.pool.submit(fn, s, i) for i, s in enumerate(self.servers)]]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.servers))]
        self._all(lambda s, i: s.init_weight_transfer_engine({**init_info, "rank_offset": offsets[i]}))

    def start_weight_update(self) -> None:
        self._all(lambda s, i: s.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        self._all(lambda s, i: s.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda s, i: s.finish_weight_update(weight_version))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self._calls.shutdown(wait=False)

    def submit(self, method: str, **kwargs):
        """Start a call in the background (calls run one at a time, in order, like an engine process's)."""
        return self._calls.submit(self.call, method, **kwargs)

    def wait(self, future, timeout_s: float | None = None):
        return future.result(timeout_s)

    def call(self, method: str, **kwargs):
        """The engine-process calls the rollout back end makes (``state``, ``generate``)."""
        if method == "state":
            versions = [_as_version(v) for v in self._all(lambda s, i: s.version())]
            same = len(set(versions)) == 1
            return {"version": versions[0] if same else None, "versions": versions}
        if method == "generate":
            return self._generate(**kwargs)
        if method == "score":  # every server's numbers, by address
            per_server = self._all(lambda s, i: [s.score(seq) for seq in kwargs["sequences"]])
            return {"by_engine": {c.address: lps for c, lps in zip(self.servers, per_server)}}
        if method in ("sleep", "wake_up"):  # rollout.vllm_sleep (GPU servers)
            return self._all(lambda s, i: getattr(s, method)(**kwargs))
        raise ValueError(f"servers do not support {method}")

    def _generate(self, prompts: list[list[int]], sampling: dict, n: int) -> dict:
        rows = [p for p in prompts for _ in range(n)]
        versions = {_as_version(v) for v in self._all(lambda s, i: s.version())}
        if len(versions) != 1 or None in versions:
            raise WeightsNotSynced(f"the vLLM servers hold versions {sorted(map(str, versions))}")
        futures = [
            self.pool.submit(
                self.servers[i % len(self.servers)].complete,
                p,
                sampling,
                sampling["seed"] + i,
                max(1, min(sampling["max_new_tokens"], self.max_model_len - len(p))),
            )
            for i, p in enumerate(rows)
        ]
        # The first failure (a server killed mid-rollout resets its connections) ends the wait at once.
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                raise future.exception()
        outs = [f.result() for f in futures]
        return {
            "tokens": [o["tokens"] for o in outs],
            "logprobs": [o["logprobs"] for o in outs],
            "finish_reasons": [o["finish_reason"] for o in outs],
            "version": versions.pop(),
            "topk": [],
        }


def main(argv: list[str] | None = None) -> None:
    """Start vLLM's OpenAI server with the RL routes and the gloo weight-transfer back end registered."""
    from megatron_opd.weight_sync.gloo_engine import BACKEND

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--weight-transfer-config") for a in args):
        import torch

        # The trainer's rollout.weight_transfer_backend=auto makes the same choice.
        backend = "nccl" if torch.cuda.is_available() else BACKEND
        args += ["--weight-transfer-config", json.dumps({"backend": backend})]
    from megatron_opd.weight_sync.plugin import register

    register()  # enough when the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); else the entry point
    sys.argv = ["vllm-server", *args]
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
