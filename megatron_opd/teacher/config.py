"""``teacher.*``: the frozen model that scores the student's samples, and how to reach it (a section of
``trainer.config.TrainConfig``; each key's doc line is what ``--help`` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class TeacherConfig:
    """The frozen model that scores the student's samples."""

    path: str = ""
    """Hugging Face or dist_ckpt folder of the teacher (not needed with ``loss.kind=sft`` or a teacher server)."""
    backend: Literal["inprocess", "server", "vllm"] = "inprocess"
    """``inprocess``: a frozen GPTModel in this job, same parallel layout as the student. ``server``: a teacher
    server in its own job and layout (``torchrun -m megatron_opd.teacher.serve``) at ``teacher.address``.
    ``vllm``: a vLLM OpenAI-compatible server at ``teacher.address`` (top-k from its prompt log-probabilities)."""
    address: str = ""
    """``backend=server``: ``host:port`` of the teacher server, or of several replicas ``host:port,host:port``.
    ``backend=vllm``: the server's base URL (``http://host:port``; replicas comma-separated)."""
    token_file: str | None = None
    """``backend=server``: file holding the server's ``--token-file`` secret (needed when it is not on loopback).
    ``backend=vllm``: file holding the server's ``--api-key``, if it has one."""
    timeout_s: float = 300.0
    """``backend=server``: seconds to wait for one reply before the request is retried (elsewhere if possible)."""
    retries: int = 8
    """``backend=server``: retries of a request before the run stops with an error naming the servers and batch."""
    backoff_s: float = 1.0
    """``backend=server``: wait after a server fails, doubled at each further failure of that server."""
    backoff_max_s: float = 30.0
    """``backend=server``: the longest wait before a failed server is tried again (how soon a restart is noticed)."""
    connect_timeout_s: float = 600.0
    """``backend=server``: how long start-up waits for a server to answer (it may still be loading)."""
    wire_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """``backend=server``: dtype of the log-probabilities (or hidden states) on the wire (ids are int32); bf16/fp16
    halve them."""
    transfer: Literal["topk", "hidden"] = "topk"
    """``backend=server``: what the server sends. ``topk``: its top-k log-probabilities (``loss.mode=topk``).
    ``hidden``: its final hidden states; the trainer loads the teacher's output layer from ``teacher.path``, sharded
    like the student's, and forms the teacher's logits chunk by chunk inside the loss: exact ``loss.mode=dense``
    from a teacher of another layout, at ``H`` values per token on the wire."""
    max_message_bytes: int = 256 << 20
    """``backend=server``: largest reply accepted; batches are split so every reply fits (and the server's limits).
    ``backend=vllm``: largest JSON reply accepted (bound the batches with ``teacher.max_batch_tokens``)."""
    max_batch_tokens: int = 16384
    """``backend=vllm``: most positions (sequences x length) in one HTTP request; larger batches are split."""
    temperature: float = 1.0
    """The teacher's logits are divided by this before its log-probabilities or top-k are taken."""
    offload: bool = False
    """Two-phase memory mode: the teacher scores the whole step, its scores are cached in host memory and its
    weights leave the accelerator while the student trains (a no-op on CPU)."""
    cuda_graphs: bool = False
    """``backend=inprocess`` on CUDA: replay the teacher's forward as a CUDA graph captured per (rows, length) bucket
    (``teacher.cuda_graph_lengths``; rows and positions padded at the end, real tokens' scores unchanged). Needs
    ``train.packing=false``, one pipeline stage, no context or expert parallelism, no ``teacher.offload``, and for an
    MoE teacher ``build.moe_fused_routing=true`` (no host sync in the forward). A teacher server: ``--cuda-graphs``."""
    cuda_graph_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192])
    """``teacher.cuda_graphs``: the length buckets (increasing, at most 8); a micro-batch is padded to the next,
    and one longer than the last runs eagerly. Each bucket holds a captured graph per row bucket; their shared memory
    pool (about one forward's activations at the largest bucket) stays reserved between steps."""
    tokenizer: str | None = None
    """Folder with the teacher's tokenizer files (for the vocabulary check); default as for the student."""
    prompt_template: str | None = None
    """The teacher's own prompt, a format string over the record's fields (``"{prompt} Answer: {solution}\\n"``):
    the teacher scores the student's response after it (privileged context; ``data.teacher_prompt``). A text
    record's whole prompt, or a chat's extra first (system) message. Same tokenizer: exact positions; another:
    ``loss.cross_tokenizer``. Costs a teacher pass over the longer prompts. Self-distillation: ``teacher.path`` =
    ``student.path``. None: the student's prompt."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"teacher.temperature must be > 0, got {self.temperature}")
        for name in ("timeout_s", "connect_timeout_s", "max_message_bytes", "max_batch_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"teacher.{name} must be > 0, got {getattr(self, name)}")
        if self.cuda_graphs:
            from megatron_opd.teacher.graphs import check_lengths

            check_lengths(self.cuda_graph_lengths)
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError(
                f"teacher.retries and teacher.backoff_s must be >= 0, got {self.retries}, {self.backoff_s}"
            )
