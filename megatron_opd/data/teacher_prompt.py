"""A teacher's own prompt (``teacher.prompt_template``): privileged context the student does not see.

The template is a Python format string over the record's fields (``"{prompt}\\nReference answer: {solution}\\n"``).
On a text record it is the teacher's whole prompt text, encoded as the student's prompt is (the tokenizer's special
tokens); on a chat record (``data.messages_key``) it is the text of a system message put before the chat, which the
teacher's chat template then renders. The response tokens are the student's either way: the teacher scores them after
its longer prompt (``teacher.reprompt``, same tokenizer) or after its own re-tokenization
(``cross_tokenizer.retokenize``, another one).

Self-distillation is the student's own starting weights as the teacher (``teacher.path`` = ``student.path``) with a
template that adds what the student lacks (a hint, the reference solution, retrieved documents).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from megatron_opd.data.prompts import PromptEncoder
from megatron_opd.data.records import DataError, read_record_files


def template_fields(template: str) -> list[str]:
    """The record fields ``template`` names, in order of first use (``{a.b}`` / ``{a[0]}`` name field ``a``)."""
    names: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if not base or base.isdigit():
            raise ValueError(
                f"teacher.prompt_template={template!r}: every placeholder must name a record field ({{solution}}), "
                "not a position ({} or {0}); write literal braces as {{ and }}"
            )
        if base not in names:
            names.append(base)
    return names


def render(template: str, record: Mapping[str, Any], where: str) -> str:
    """``template`` filled from ``record``; a missing field is refused by its name."""
    missing = [name for name in template_fields(template) if name not in record]
    if missing:
        raise DataError(
            f"{where}: teacher.prompt_template names field {missing[0]!r}, which the record lacks (fields present: "
            f"{sorted(record)}); add it to every record or change teacher.prompt_template"
        )
    return template.format(**record)


def check_records(template: str, files: list[str] | str, key: str) -> None:
    """Refuse the first record of ``files`` that lacks a field the template names (before any model is built)."""
    for path, records in read_record_files(files, key):
        for i, record in enumerate(records):
            render(template, record, f"{key} {path} record {i}")


class TemplatePromptEncoder(PromptEncoder):
    """A ``PromptEncoder`` whose prompt is ``template`` rendered from the record (see the module docstring)."""

    def __init__(self, tokenizer: Any, template: str, **kwargs) -> None:
        super().__init__(tokenizer, **kwargs)
        template_fields(template)  # a malformed template fails here, not at the first batch
        self.template = template

    @classmethod
    def for_data(cls, tokenizer: Any, data: Any, template: str | None = None) -> PromptEncoder:
        """The teacher's encoder: the run's field names and chat variables, and the template when there is one."""
        if template is None:
            return PromptEncoder.for_data(tokenizer, data)
        keys = dict(prompt_key=data.prompt_key, messages_key=data.messages_key, response_key=data.response_key)
        return cls(tokenizer, template, chat_template_kwargs=data.chat_template_kwargs, **keys)

    def teacher_record(self, record: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The record as the teacher sees it: the rendered text as its prompt, or before its chat as a system
        message."""
        text = render(self.template, record, where)
        if record.get(self.prompt_key) is not None or record.get(self.messages_key) is None:
            return {**record, self.prompt_key: text}
        messages = [{"role": "system", "content": text}, *record[self.messages_key]]
        return {**record, self.messages_key: messages}

    def prompt_ids(self, record: Mapping[str, Any], where: str) -> list[int]:
        return super().prompt_ids(self.teacher_record(record, where), where)

    def prompt_text(self, record: Mapping[str, Any], where: str = "record") -> str:
        return super().prompt_text(self.teacher_record(record, where), where)
