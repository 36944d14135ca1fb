"""``teacher.backend=vllm``: a vLLM OpenAI-compatible server scores the student's samples, behind the one client.

One request per piece of a batch: ``POST {base}/v1/completions`` with token-id prompts, ``max_tokens=1``,
``temperature=0`` and ``prompt_logprobs=k``. vLLM's reply, and how it becomes a ``ScoreReply``:

- ``prompt_logprobs[j]`` scores prompt token ``j`` given the tokens before it (entry 0 is null), so our position
  ``i`` (the distribution of the token after ``tokens[i]``) is entry ``i + 1``. Each prompt is sent with one more
  token (the last position's requested id, else 0), so every position is a prompt position.
- Each entry has k or k+1 items (vLLM adds the actual token when it is outside the top-k), keyed by the token id
  as a string: we keep the k most probable, and the actual token's is the log-probability at the token each
  position predicts, the one requested id a step needs (teacher-confidence weights, metrics). Other requested ids
  (the student's top-k of ``loss.support=union``) cannot be scored: vLLM scores only the prompt's own tokens.
- vLLM refuses k above its ``--max-logprobs`` (default 20) and applies no temperature to prompt log-probabilities
  (``teacher.temperature`` must be 1; a top-k cannot be re-tempered exactly).
- vLLM normalises over every embedding row of the teacher: with padded embeddings an id at or above the
  tokenizer's size may enter the top-k; that reply is refused (use ``teacher.backend=server``).

vLLM publishes no vocabulary listing, so the vocabulary check reads the teacher's tokenizer files
(``teacher.tokenizer`` or ``teacher.path``) and every hello confirms the server tokenizes probe texts, special
tokens included, exactly as those files do.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from megatron_opd.teacher.capabilities import VLLM
from megatron_opd.teacher.transport import (
    RequestRefusedError,
    ScoreReply,
    ScoreRequest,
    ServerInfo,
    TransportError,
)
from megatron_opd.teacher.vocabulary import fingerprint, tokenizer_summary

PROBE_TEXTS = (
    "On-policy distillation: the teacher scores every token.",
    "  leading spaces, tabs\tand\nnew lines; digits 0123456789; punctuation !?,.:;'\"()[]{}",
    "ünïcödé 漢字 emoji 🙂 café",
)
"""Texts tokenized by the server and locally at every hello: the two tokenizers must agree on each."""


def base_url(address: str) -> str:
    """``teacher.address`` entry -> the server's base URL (``host:port`` gets ``http://``; a trailing ``/v1`` goes)."""
    url = address.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    return url[: -len("/v1")] if url.endswith("/v1") else url


def max_logprobs_advice(base: str, k: int) -> str:
    return (
        f"the vLLM teacher at {base} refuses prompt_logprobs={k} (its --max-logprobs, 20 by default, is lower): "
        f"start it with `python -m vllm.entrypoints.openai.api_server --model TEACHER --max-logprobs {k}` "
        f"(or `vllm serve TEACHER --max-logprobs {k}`), or lower loss.topk"
    )


def _entry_items(entry: Any, k: int, where: str) -> dict[int, float]:
    """One position's ``{"id": {"logprob": x, ...}}`` mapping -> ``{id: log-prob}`` (at least ``k`` items)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object of log-probabilities, got {type(entry).__name__}")
    items = {}
    for key, value in entry.items():
        logprob = value.get("logprob") if isinstance(value, dict) else value
        try:
            items[int(key)] = float(logprob)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: entry {key!r}: {value!r} is not a token id and a log-probability") from None
    if len(items) < k:
        raise ValueError(f"{where}: {len(items)} log-probabilities, the request needs {k}")
    return items


def parse_completions(
    body: Any, n: int, s: int, k: int, actual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """vLLM's ``/v1/completions`` JSON for ``n`` prompts of ``s + 1`` tokens -> top-k ids and log-probs ``[n, s, k]``
    of positions ``0..s-1``, and with ``actual`` (``[n, s]``, the prompt's tokens ``1..s``) their log-probs ``[n, s, 1]``.

    A ``ValueError`` names the first thing that is missing or malformed.
    """
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise ValueError(f"the reply has {got} choices, the request sent {n} prompts")
    ids = torch.empty(n, s, k, dtype=torch.int64)
    logprobs = torch.empty(n, s, k, dtype=torch.float32)
    requested = None if actual is None else torch.empty(n, s, 1, dtype=torch.float32)
    seen = set()
    for choice in choices:
        row = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(row, int) or not 0 <= row < n or row in seen:
            raise ValueError(f"a choice has index {row!r}: expected each of 0..{n - 1} once")
        seen.add(row)
        prompt = choice.get("prompt_logprobs")
        if not isinstance(prompt, list) or len(prompt) != s + 1:
            got = len(prompt) if isinstance(prompt, list) else type(prompt).__name__
            raise ValueError(f"choice {row}: prompt_logprobs has {got} positions, the prompt has {s + 1} tokens")
        for i in range(s):  # entry 0 (null) scores nothing
            items = _entry_items(prompt[i + 1], k, f"choice {row}, position {i}")
            top = sorted(items.items(), key=lambda item: -item[1])[:k]
            ids[row, i] = torch.tensor([t for t, _ in top])
            logprobs[row, i] = torch.tensor([v for _, v in top])
            if requested is not None:
                token = int(actual[row, i])
                if token not in items:
                    raise ValueError(f"choice {row}, position {i}: no log-probability for the prompt's token {token}")
                requested[row, i, 0] = items[token]
    return ids, logprobs, requested


class VLLMTransport:
    """``Transport`` to one vLLM OpenAI-compatible server (thread-confined: one HTTP session)."""

    def __init__(self, address: str, factory: VLLMTransportFactory) -> None:
        import requests

        self.address = address
        self.base = base_url(address)
        self.factory = factory
        self._session = requests.Session()
        if factory.api_key:
            self._session.headers["Authorization"] = f"Bearer {factory.api_key}"
        self._model: str | None = None

    def _call(self, method: str, path: str, body: dict | None, timeout_s: float) -> Any:
        import requests

        try:
            with self._session.request(
                method, f"{self.base}/{path}", json=body, timeout=timeout_s, stream=True
            ) as reply:
                content = reply.raw.read(self.factory.max_message_bytes + 1, decode_content=True)
        except requests.Timeout:
            raise TransportError(f"vLLM teacher {self.base} did not answer /{path} within {timeout_s:g} s") from None
        except requests.RequestException as err:
            raise TransportError(f"vLLM teacher {self.base} is unreachable ({type(err).__name__}) on /{path}") from None
        if len(content) > self.factory.max_message_bytes:
            raise TransportError(
                f"vLLM teacher {self.base}: the /{path} reply exceeds teacher.max_message_bytes="
                f"{self.factory.max_message_bytes}; lower teacher.max_batch_tokens or raise the limit"
            )
        text = content.decode("utf-8", errors="replace")
        if reply.status_code in (401, 403):
            raise RequestRefusedError(
                f"vLLM teacher {self.base} refused the API key (HTTP {reply.status_code}): put the server's --api-key "
                "in the file named by teacher.token_file"
            )
        if 400 <= reply.status_code < 500:
            if "logprobs" in text and "max allowed" in text:
                raise RequestRefusedError(max_logprobs_advice(self.base, self.factory.topk))
            raise RequestRefusedError(f"vLLM teacher {self.base} /{path}: HTTP {reply.status_code}: {text[:1000]}")
        if reply.status_code >= 500:
            raise TransportError(f"vLLM teacher {self.base} /{path}: HTTP {reply.status_code}: {text[:1000]}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise TransportError(f"vLLM teacher {self.base} /{path}: the reply is not JSON: {text[:200]!r}") from None

    def _completions(self, prompts: list[list[int]], timeout_s: float) -> Any:
        body = {
            "model": self._model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": self.factory.topk,
        }
        return self._call("POST", "v1/completions", body, timeout_s)

    def hello(self, *, with_tokenizer: bool, timeout_s: float) -> ServerInfo:
        """The served model and its context; checks k is allowed and the server tokenizes like our files."""
        models = self._call("GET", "v1/models", None, timeout_s)
        try:
            served = models["data"][0]
            self._model, context = str(served["id"]), int(served.get("max_model_len") or 0)
        except (KeyError, IndexError, TypeError, ValueError):
            raise TransportError(f"vLLM teacher {self.base}: /v1/models lists no model: {str(models)[:200]}") from None
        self.factory.confirm_tokenizer(self, timeout_s)
        self._completions([[0, 0]], timeout_s)  # refused here, with advice, when k > --max-logprobs
        f = self.factory
        return ServerInfo(
            protocol=0,
            vocab_size=f.vocab_size,
            embedding_rows=f.embedding_rows,
            max_topk=f.topk,
            max_seq_len=max(context - 2, 1),  # room for the appended token and the one generated token
            max_batch_tokens=f.max_batch_tokens,
            max_message_bytes=f.max_message_bytes,
            max_requested=1,  # the token each position predicts
            vocab_fingerprint=f.fingerprint,
            model=f"vLLM {self._model}",
            tokenizer=f.summary if with_tokenizer else None,
        )

    def tokenize(self, text: str, timeout_s: float) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        reply = self._call("POST", "tokenize", body, timeout_s)
        if not isinstance(reply, dict) or not isinstance(reply.get("tokens"), list):
            raise TransportError(f"vLLM teacher {self.base} /tokenize: malformed reply {str(reply)[:200]}")
        return [int(t) for t in reply["tokens"]]

    def score(self, request: ScoreRequest, timeout_s: float) -> ScoreReply:
        tokens, actual = request.tokens.to(torch.int64), None
        if request.request_ids is not None:
            actual = request.request_ids[..., 0].to(torch.int64)
            if request.num_requested != 1 or not torch.equal(actual[:, :-1], tokens[:, 1:]):
                raise RequestRefusedError(
                    "a vLLM teacher scores only the token each position predicts, not other requested ids "
                    "(loss.support=union needs teacher.backend=server or inprocess)"
                )
        if request.temperature != 1.0:
            raise RequestRefusedError(
                f"vLLM applies no temperature to prompt log-probabilities: teacher.temperature={request.temperature} "
                "needs teacher.backend=server or inprocess"
            )
        if request.k != self.factory.topk:
            raise RequestRefusedError(f"k={request.k} differs from the k={self.factory.topk} this transport checked")
        n, s = request.shape
        last = actual[:, -1:] if actual is not None else torch.zeros(n, 1, dtype=torch.int64)
        body = self._completions(torch.cat([tokens, last], dim=1).tolist(), timeout_s)
        try:
            ids, logprobs, requested = parse_completions(body, n, s, request.k, actual)
        except ValueError as err:
            raise TransportError(f"vLLM teacher {self.base} sent a malformed reply: {err}") from None
        if ids.numel() and int(ids.max()) >= self.factory.vocab_size:
            raise RequestRefusedError(
                f"the vLLM teacher at {self.base} put id {int(ids.max())} (a padded embedding row: the tokenizer has "
                f"{self.factory.vocab_size} tokens) in a top-k; vLLM cannot leave padded rows out of its "
                "normalisation: use teacher.backend=server"
            )
        return ScoreReply(ids.to(torch.int32), logprobs, requested)

    def close(self) -> None:
        self._session.close()


class VLLMTransportFactory:
    """Builds ``VLLMTransport``s; holds the teacher's local tokenizer, its summary, and the request's k."""

    supports_requested_logprobs = VLLM.requested_logprobs
    """Not at arbitrary ids: vLLM's completions API scores only the prompt's own tokens (each position's next)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        topk: int,
        embedding_rows: int | None = None,
        api_key: str = "",
        max_batch_tokens: int = 16384,
        max_message_bytes: int = 256 << 20,
        tokenizer_name: str = "teacher.tokenizer",
    ) -> None:
        self.tokenizer, self.tokenizer_name = tokenizer, tokenizer_name
        self.summary = tokenizer_summary(tokenizer)
        self.fingerprint = fingerprint(self.summary)
        self.vocab_size = len(tokenizer)
        self.embedding_rows = max(embedding_rows or 0, self.vocab_size)
        self.topk, self.api_key = topk, api_key
        self.max_batch_tokens, self.max_message_bytes = max_batch_tokens, max_message_bytes

    def __call__(self, address: str) -> VLLMTransport:
        return VLLMTransport(address, self)

    def probes(self) -> list[str]:
        special = [str(t) for t in (self.tokenizer.bos_token, self.tokenizer.eos_token) if t]
        return [*PROBE_TEXTS, " ".join(special) + " after special tokens"]

    def confirm_tokenizer(self, transport: VLLMTransport, timeout_s: float) -> None:
        """Refuse a server whose tokenizer differs from ``teacher.tokenizer`` on any probe (first differing id)."""
        for text in self.probes():
            local = self.tokenizer.encode(text, add_special_tokens=False)
            remote = transport.tokenize(text, timeout_s)
            if local != remote:
                at = next((i for i, (a, b) in enumerate(zip(local, remote)) if a != b), min(len(local), len(remote)))
                raise RequestRefusedError(
                    f"the vLLM teacher at {transport.base} tokenizes {text!r} differently from {self.tokenizer_name} "
                    f"(first difference at token {at}: server {remote[at : at + 1]}, local {local[at : at + 1]}): "
                    f"point {self.tokenizer_name} at the tokenizer of the model the server runs"
                )
