"""Turn records into token ids: a ``prompt`` text or a chat of ``messages``, and the ``response`` for SFT.

The student samples from exactly these ids, and the teacher scores them, so they must match what the
model saw in training: text prompts get the tokenizer's usual special tokens (BOS), chats are rendered by
the tokenizer's own chat template (with ``data.chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``), and a BOS
is never doubled. Rollout, evaluation and the teacher's re-tokenization all render through :func:`render_chat`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from megatron_opd.data.records import DataError, read_record_files

logger = logging.getLogger(__name__)


def _input_ids(encoded: Any) -> list[int]:
    """``input_ids`` from whatever a tokenizer call returned (list, nested list, dict or BatchEncoding)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise ValueError(f"expected one tokenized sequence, got a batch of {len(encoded)}")
        encoded = encoded[0]
    return [int(i) for i in encoded]


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any], tokenize: bool
) -> Any:
    """The chat template applied with the generation prompt and the run's template variables (the one call site)."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=tokenize, **dict(template_kwargs)
    )


class PromptEncoder:
    """Encodes records with one tokenizer; field names come from ``data.*_key``.

    A record with both a prompt text and messages uses the text. ``chat_template_kwargs``: extra variables of the
    chat template (``data.chat_template_kwargs``).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_key: str = "prompt",
        messages_key: str = "messages",
        response_key: str = "response",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.prompt_key = prompt_key
        self.messages_key = messages_key
        self.response_key = response_key
        self._bos_id: int | None = getattr(tokenizer, "bos_token_id", None)

    @classmethod
    def for_data(cls, tokenizer: Any, data: Any) -> PromptEncoder:
        """The encoder a run uses with ``tokenizer`` (student's or teacher's): field names and template variables
        from its ``data`` config, so every tokenizer renders a chat alike."""
        return cls(tokenizer, data.prompt_key, data.messages_key, data.response_key, data.chat_template_kwargs)

    def _dedupe_bos(self, ids: list[int]) -> list[int]:
        # A template (or pre-rendered text) that writes the BOS itself, plus the tokenizer adding one.
        bos = self._bos_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            return ids[1:]
        return ids

    def _text(self, record: Mapping[str, Any], where: str) -> str | None:
        text = record.get(self.prompt_key)
        if text is None:
            return None
        if not isinstance(text, str):
            raise DataError(f"{where}: field {self.prompt_key!r} must be a string, got a {type(text).__name__}")
        return text

    def _messages(self, record: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
        messages = record.get(self.messages_key)
        if messages is None:
            raise DataError(
                f"{where}: the record has neither {self.prompt_key!r} (text) nor {self.messages_key!r} (chat); "
                f"fields present: {sorted(record)}. Set data.prompt_key / data.messages_key to the right fields"
            )
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
            raise DataError(
                f"{where}: field {self.messages_key!r} must be a list of {{role, content}} objects, "
                f"got {type(messages).__name__}"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                f"{where}: the record is a chat ({self.messages_key!r}) but the tokenizer has no chat template; "
                f"use a tokenizer with one (student.tokenizer) or give {self.prompt_key!r} text instead"
            )
        return [dict(m) for m in messages]

    def prompt_ids(self, record: Mapping[str, Any], where: str) -> list[int]:
        """The prompt's token ids; ``where`` (e.g. ``"train.jsonl record 3"``) names the record in errors."""
        text = self._text(record, where)
        if text is not None:
            ids = _input_ids(self.tokenizer(text, add_special_tokens=True))
        else:
            messages = self._messages(record, where)
            # The template writes every special token itself (transformers tokenizes it without adding any).
            rendered = render_chat(self.tokenizer, messages, self.chat_template_kwargs, tokenize=True)
            ids = _input_ids(rendered)
        return self._dedupe_bos(ids)

    def prompt_text(self, record: Mapping[str, Any], where: str = "record") -> str:
        """The prompt as text, for reward functions and scorers (a chat is the rendered template)."""
        text = self._text(record, where)
        if text is not None:
            return text
        messages = self._messages(record, where)
        return render_chat(self.tokenizer, messages, self.chat_template_kwargs, tokenize=False)

    def response_ids(self, record: Mapping[str, Any], where: str) -> list[int]:
        """The SFT target: ``response`` tokenized without special tokens, then EOS so the model learns to stop."""
        response = record.get(self.response_key)
        if response is None:
            raise DataError(
                f"{where}: loss.kind=sft needs a target response in field {self.response_key!r}, "
                f"but the record has only {sorted(record)}; set data.response_key to the right field"
            )
        if not isinstance(response, str):
            raise DataError(f"{where}: field {self.response_key!r} must be a string, got a {type(response).__name__}")
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            raise DataError("loss.kind=sft needs an EOS token to end each response, but the tokenizer has none")
        return _input_ids(self.tokenizer(response, add_special_tokens=False)) + [int(eos)]


def load_prompts(
    paths: list[str] | str, encoder: PromptEncoder, key: str = "data.train_files"
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Read ``paths`` and encode every prompt: the raw records and their prompt ids, index for index."""
    records: list[dict[str, Any]] = []
    prompt_ids: list[list[int]] = []
    for path, file_records in read_record_files(paths, key):
        for i, record in enumerate(file_records):
            prompt_ids.append(encoder.prompt_ids(record, where=f"{path} record {i}"))
            records.append(record)
    return records, prompt_ids
