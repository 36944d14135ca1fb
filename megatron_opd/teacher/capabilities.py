"""What each teacher back end can give the loss, declared once.

The config check (``TrainConfig.validate``) refuses a loss a back end cannot serve from these declarations, before
anything is built; the built back ends carry the same flags (``TeacherBackend.supports_dense``,
``supports_requested_logprobs``), which the set-up and the scheduler check again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TeacherCapabilities:
    """One back end's declaration."""

    dense: bool
    """The whole distribution (logit shards, or hidden states and the output layer): ``loss.mode=dense``."""
    requested_logprobs: bool
    """Log-probabilities at any requested ids (``loss.support=union`` asks at the student's top-k ids)."""
    temperature: bool
    """Applies ``teacher.temperature`` to its distribution."""


INPROCESS = TeacherCapabilities(dense=True, requested_logprobs=True, temperature=True)
"""A frozen GPTModel on the trainer's ranks (``teacher.inprocess``)."""
SERVER = TeacherCapabilities(dense=False, requested_logprobs=True, temperature=True)
"""A teacher server sending its top-k (``teacher.transfer=topk``)."""
SERVER_HIDDEN = TeacherCapabilities(dense=True, requested_logprobs=True, temperature=True)
"""A teacher server sending hidden states, the trainer holding its output layer (``teacher.transfer=hidden``)."""
VLLM = TeacherCapabilities(dense=False, requested_logprobs=False, temperature=False)
"""vLLM's prompt log-probabilities: a top-k at the unscaled distribution, no other ids."""


def declared(backend: str, transfer: str = "topk") -> TeacherCapabilities:
    """The declaration of ``teacher.backend`` / ``teacher.transfer``."""
    if backend == "inprocess":
        return INPROCESS
    if backend == "vllm":
        return VLLM
    return SERVER_HIDDEN if transfer == "hidden" else SERVER


def refusal(backend: str, transfer: str, *, mode: str, support: str, temperature: float) -> str | None:
    """Why the back end cannot serve the loss (``loss.mode``, ``loss.support``, ``teacher.temperature``), or None."""
    caps, name = declared(backend, transfer), f"teacher.backend={backend}"
    if mode == "dense" and not caps.dense:
        fix = "teacher.transfer=hidden with a teacher server (exact dense distillation from its hidden states)"
        return f"{name} sends the teacher's top-k, not its logits: set loss.mode=topk, or {fix}"
    if temperature != 1.0 and not caps.temperature:
        return (
            f"teacher.temperature={temperature} cannot be applied by {name}: vLLM applies no temperature to prompt "
            "log-probabilities and a top-k cannot be re-tempered exactly; use teacher.backend=server or inprocess, "
            "or teacher.temperature=1"
        )
    if support == "union" and not caps.requested_logprobs:
        return (
            f"loss.support=union needs the teacher's log-probabilities at the student's top-k ids, which {name} "
            "cannot give (vLLM's prompt_logprobs: a top-k only): use teacher.backend=server or inprocess, or "
            "loss.support=teacher_topk"
        )
    return None
