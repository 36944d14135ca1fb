"""``data.*``: the prompt files and the record fields read from them (a section of ``trainer.config.TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_CHAT_TEMPLATE_ARGUMENTS = frozenset(
    ("conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
     "return_assistant_tokens_mask")
)  # fmt: skip
"""Arguments of ``apply_chat_template`` itself, which ``data.chat_template_kwargs`` may not name."""


@dataclass
class DataConfig:
    """Prompts: JSONL or Parquet records with ``prompt`` (text) or ``messages`` (chat)."""

    train_files: list[str] | str = field(default_factory=list)
    """One path or a list of paths (.jsonl, .json lines, .parquet)."""
    eval_files: list[str] | str = field(default_factory=list)
    """Held-out prompts for periodic evaluation (optional)."""
    prompt_key: str = "prompt"
    """Record field holding the prompt text."""
    messages_key: str = "messages"
    """Record field holding a chat (list of {role, content}); rendered with the tokenizer's chat template."""
    answer_key: str = "answer"
    """Record field with the reference answer (evaluation scorers receive the whole record)."""
    response_key: str = "response"
    """Record field with the target response (``loss.kind=sft``)."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (deterministically from ``seed`` and the epoch)."""
    teacher_key: str = "teacher"
    """With ``teachers.*``: record field naming the teacher that scores the record's samples."""
    default_teacher: str | None = None
    """With ``teachers.*``: the teacher of records without ``data.teacher_key`` (unset: such records are refused)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template, the same for rollout, evaluation and the teacher's re-tokenization,
    e.g. ``{enable_thinking: false}`` for Qwen3 (CLI: ``data.chat_template_kwargs.enable_thinking=false``)."""

    def __post_init__(self) -> None:
        reserved = sorted(set(map(str, self.chat_template_kwargs)) & _CHAT_TEMPLATE_ARGUMENTS)
        if reserved or not all(isinstance(k, str) for k in self.chat_template_kwargs):
            raise ValueError(
                f"data.chat_template_kwargs must map template variable names to values; {reserved or 'non-string keys'}"
                " are set by the trainer itself (it renders each prompt with add_generation_prompt=true)"
            )
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files] if self.train_files else []
        if isinstance(self.eval_files, str):
            self.eval_files = [self.eval_files] if self.eval_files else []
