"""The configurations users compose, as one pairwise covering array: each generated config either is refused before
any model is built (``parse_args`` -> ``validate`` -> ``check_inputs``) or runs, resumes, evaluates and exports.

Everything the covering test (tests/test_config_space.py) knows lives here, in three parts:

- ``DIMENSIONS``: what a user chooses, each value a named set of trainer overrides (``value_overrides``);
- ``REFUSED``: the pairs of values the trainer refuses, each with the words of its message (docs/configuration.md
  lists them); they are kept out of the array, and each is checked to be refused before any model exists;
- ``NOT_APPLICABLE``: pairs that say nothing together (an SFT run has no teacher to serve or rollouts to schedule).

``covering_array()`` draws the rows with ``covertable`` (maintained, deterministic, constraint-aware pairwise
generation; allpairspy is unmaintained and its filters cannot prune ahead): every pair of values not excluded meets
in at least one row. Adding a feature adds a dimension value here, not a test file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

DIMENSIONS: dict[str, tuple[str, ...]] = {
    # world size <= 2 on a two-core CI machine; the 4-rank layouts (TP2xPP2, ETP) are tests/test_resume_layouts.py's
    "layout": ("tp1", "tp2_sp", "dp2", "pp2_vp2", "cp2", "ep2"),
    # moe_fused: the MoE student with build.moe_fused_routing (megatron_opd.moe; Megatron's forward where it declines)
    "student": ("dense_tied", "dense_untied", "moe", "moe_fused", "windowed"),
    "rollout": ("builtin", "vllm"),
    "teacher": ("inprocess", "server", "two_teachers", "other_tokenizer"),
    "loss": ("dense", "topk", "union", "sampled", "sft"),
    "fused_output": ("off", "on"),
    "scheduler": ("zero_step_off", "one_step_off_prefix", "two_step_off_lag_lr"),
    "optimizer": ("plain", "distributed_bf16"),
    "recompute": ("none", "full"),
    "packing": ("off", "micro_batch_tokens"),
    "samples_per_prompt": ("1", "2"),
    "tools": ("off", "calculator"),
    "records": ("prompt", "messages"),
    "eval": ("off", "teacher_responses", "own_samples"),
    "resume": ("same_layout", "other_layout"),
}


@dataclass(frozen=True)
class Refusal:
    """``first`` with ``second`` (``(dimension, value)`` each) is refused before any model; ``message``: words of the
    trainer's message."""

    first: tuple[str, str]
    second: tuple[str, str]
    message: str


REFUSED: tuple[Refusal, ...] = (
    Refusal(("layout", "cp2"), ("rollout", "builtin"), "the built-in sampler's decode steps cannot split the sequence"),
    Refusal(("layout", "cp2"), ("packing", "micro_batch_tokens"), "packed sequences are not split over context-para"),
    Refusal(("layout", "cp2"), ("teacher", "two_teachers"), "does not split its micro-batches over context-parallel"),
    Refusal(("layout", "pp2_vp2"), ("rollout", "builtin"), "use rollout.backend=vllm to sample from a pipeline-par"),
    Refusal(("layout", "pp2_vp2"), ("teacher", "two_teachers"), "teachers.* with pipeline parallelism needs train.pac"),
    Refusal(("rollout", "builtin"), ("scheduler", "one_step_off_prefix"), "which needs rollouts outside the trainer"),
    Refusal(("rollout", "builtin"), ("scheduler", "two_step_off_lag_lr"), "which needs rollouts outside the trainer"),
    Refusal(("scheduler", "one_step_off_prefix"), ("fused_output", "on"), "loss.staleness_correction=prefix weights"),
    Refusal(("scheduler", "one_step_off_prefix"), ("teacher", "other_tokenizer"), "loss.staleness_correction=prefix w"),
    Refusal(("teacher", "other_tokenizer"), ("tools", "calculator"), "cannot align tool outputs yet"),
    Refusal(("teacher", "other_tokenizer"), ("fused_output", "on"), "cannot be used with loss.cross_tokenizer"),
    Refusal(("loss", "sft"), ("fused_output", "on"), "loss.kind=sft keeps the logits"),
    Refusal(("teacher", "other_tokenizer"), ("loss", "dense"), "loss.cross_tokenizer"),
    Refusal(("teacher", "other_tokenizer"), ("loss", "union"), "loss.cross_tokenizer"),
)

# Pairs with no meaning together (not refusals: the trainer would run them, ignoring one side).
NOT_APPLICABLE: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = (
    *(((("loss", "sft"), ("teacher", t))) for t in ("server", "two_teachers", "other_tokenizer")),
    *(((("loss", "sft"), ("scheduler", s))) for s in ("one_step_off_prefix", "two_step_off_lag_lr")),
    (("loss", "sft"), ("tools", "calculator")),
    (("loss", "sft"), ("samples_per_prompt", "2")),
    (("loss", "sft"), ("eval", "teacher_responses")),
    # expert parallelism of a model without experts is data parallelism (dp2's rows)
    *(((("layout", "ep2"), ("student", s))) for s in ("dense_tied", "dense_untied", "windowed")),
)


def excluded_pairs() -> set[frozenset[tuple[str, str]]]:
    return {frozenset((r.first, r.second)) for r in REFUSED} | {frozenset(p) for p in NOT_APPLICABLE}


def covering_array() -> list[dict[str, str]]:
    """The rows: every pair of values of two dimensions, unless excluded, in at least one row (deterministic)."""
    from covertable import make

    def never(pair) -> dict:
        (k1, v1), (k2, v2) = sorted(pair)
        both = [{"operator": "eq", "left": k1, "value": v1}, {"operator": "eq", "left": k2, "value": v2}]
        return {"operator": "not", "condition": {"operator": "and", "conditions": both}}

    rows = make({k: list(v) for k, v in DIMENSIONS.items()}, constraints=[never(p) for p in excluded_pairs()])
    return [{k: row[k] for k in DIMENSIONS} for row in rows]


def uncovered_pairs(rows: list[dict[str, str]]) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """Pairs of values (not excluded) that no row holds: what the covering test asserts empty."""
    held = {frozenset(p) for row in rows for p in combinations(row.items(), 2)}
    excluded = excluded_pairs()
    missing = []
    for (d1, vs1), (d2, vs2) in combinations(DIMENSIONS.items(), 2):
        for v1 in vs1:
            for v2 in vs2:
                pair = frozenset(((d1, v1), (d2, v2)))
                if pair not in held and pair not in excluded:
                    missing.append(((d1, v1), (d2, v2)))
    return missing


def row_name(row: dict[str, str]) -> str:
    return "-".join(row[k] for k in ("layout", "student", "rollout", "teacher", "loss"))


# ---- from a row to the trainer's command line -------------------------------------------------------------------


@dataclass(frozen=True)
class SpaceFiles:
    """The models, tokenizers and records the rows run on (``make_space_files``); ``server``: a teacher server's
    address (None where a row needing it is refused before it is asked for)."""

    teacher: str
    other_teacher: str  # the teacher with another tokenizer
    students: dict[str, str]
    prompts: str
    messages: str
    eval_prompts: str
    server: str | None = None


LAYOUTS: dict[str, dict[str, object]] = {
    "tp1": {},
    "tp2_sp": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True},
    "dp2": {},
    "pp2_vp2": {"parallel.pipeline_model_parallel_size": 2, "parallel.virtual_pipeline_model_parallel_size": 2},
    "cp2": {"parallel.context_parallel_size": 2},
    "ep2": {"parallel.expert_model_parallel_size": 2},
}
WORLD = {"tp1": 1, "tp2_sp": 2, "dp2": 2, "pp2_vp2": 2, "cp2": 2, "ep2": 2}
RESUME_AT = {"tp1": "tp2_sp", "tp2_sp": "tp1", "dp2": "tp1", "pp2_vp2": "tp2_sp", "cp2": "tp1", "ep2": "tp1"}
"""``resume=other_layout``: the layout the run resumes at (CP=2 -> CP=1, EP=2 -> EP=1, PP -> TP)."""


def world_size(layout: str) -> int:
    return WORLD[layout]


def value_overrides(row: dict[str, str], files: SpaceFiles, layout: str | None = None) -> dict[str, object]:
    """The trainer overrides of ``row`` (at ``layout``, default the row's own)."""
    layout = layout or row["layout"]
    out: dict[str, object] = {
        "student.path": files.students[row["student"].removesuffix("_fused")],
        "build.moe_fused_routing": row["student"] == "moe_fused",
        "data.train_files": files.messages if row["records"] == "messages" else files.prompts,
        "data.eval_files": "" if row["eval"] == "off" else files.eval_prompts,
        "data.shuffle": False,
        "train.steps": 3,
        "train.max_seq_len": 64,
        "train.prompts_per_step": 4,
        "train.micro_batch_size": 2,
        "rollout.max_new_tokens": 6,
        "rollout.n": int(row["samples_per_prompt"]),
        "rollout.backend": row["rollout"],
        "optim.lr": 1e-3,
        "eval.max_prompts": 2,
        "eval.teacher_responses": row["eval"] == "teacher_responses",
        "logging.progress_bar": False,
        "checkpoint.every": 2,
        **LAYOUTS[layout],
    }
    teacher = row["teacher"]
    if teacher == "inprocess":
        out["teacher.path"] = files.teacher
    elif teacher == "server":
        out.update({"teacher.backend": "server", "teacher.address": files.server, "teacher.path": files.teacher})
        if row["loss"] == "dense":  # the server's final hidden states, the output layer here: exact dense
            out["teacher.transfer"] = "hidden"
    elif teacher == "two_teachers":  # records alternate between them (their "teacher" field)
        out.update({"teachers.a.path": files.teacher, "teachers.b.backend": "server", "teachers.b.address": files.server,
                    "teachers.b.loss.mode": "topk", "data.default_teacher": "a"})  # fmt: skip
    else:  # another tokenizer: the trainer re-tokenizes for it
        out.update({"teacher.path": files.other_teacher,
                    "loss.cross_tokenizer": "sampled" if row["loss"] == "sampled" else "aligned"})  # fmt: skip
    out.update(LOSSES[row["loss"]])
    if row["loss"] == "sft":
        out.pop("teacher.path", None)
    out["loss.fused_output"] = row["fused_output"]
    if row["scheduler"] == "one_step_off_prefix":
        out.update({"scheduler.mode": "one_step_off", "loss.staleness_correction": "prefix"})
    elif row["scheduler"] == "two_step_off_lag_lr":
        out.update({"scheduler.mode": "two_step_off", "optim.lag_lr_target": 0.1})
    if row["optimizer"] == "distributed_bf16":
        out.update({"optim.use_distributed_optimizer": True, "optim.bf16": True})
    if row["recompute"] == "full":
        out["build.recompute_granularity"] = "full"
    if row["packing"] == "off":
        out["train.packing"] = False
    else:
        out.update({"train.packing": True, "train.micro_batch_tokens": 64})
    if row["tools"] == "calculator":  # a one-letter stop string: the untrained student calls it in most turns
        out.update({"rollout.tool_fn": "megatron_opd.tasks.calculator:calculate", "rollout.tool_stop": "e",
                    "rollout.max_turns": 2})  # fmt: skip
    return out


LOSSES: dict[str, dict[str, object]] = {
    "dense": {"loss.kind": "forward_kl", "loss.mode": "dense"},
    "topk": {"loss.kind": "reverse_kl", "loss.mode": "topk", "loss.topk": 8},
    "union": {"loss.kind": "forward_kl", "loss.mode": "topk", "loss.topk": 8, "loss.support": "union"},
    "sampled": {"loss.kind": "reverse_kl", "loss.mode": "sampled"},
    "sft": {"loss.kind": "sft"},
}


def command_line(overrides: dict[str, object], output_dir: str | os.PathLike) -> list[str]:
    return [f"{k}={v}" for k, v in {**overrides, "output_dir": str(output_dir)}.items()]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen's tokenizers carry it: the ``messages`` records' prompts."""


def make_space_files(root: str | os.PathLike) -> SpaceFiles:
    """Tiny models sharing one tokenizer (the teacher, four students), a teacher with another tokenizer, prompts
    as text and as chat messages (half of them naming teacher ``b``), held-out prompts."""
    import json

    from megatron_opd.models.families import llama, mistral, qwen3, qwen3_moe
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

    root = Path(root)
    four = {"num_hidden_layers": 4}  # PP=2 x VP=2: a layer per model chunk
    specs = {
        "teacher": (qwen3, 0, {**four, "tie_word_embeddings": False}),  # the in-process one: the student's layout
        "dense_tied": (qwen3, 1, {**four, "tie_word_embeddings": True}),
        "dense_untied": (llama, 2, {**four, "tie_word_embeddings": False}),
        "moe": (qwen3_moe, 3, four),
        # a window longer than any sequence the rows make: it cannot bite, so no layout may refuse it
        "windowed": (mistral, 4, {**four, "sliding_window": 4096}),
    }
    dirs = {}
    for name, (family, seed, overrides) in specs.items():
        dirs[name] = str(make_tiny_hf_model(family.FAMILY.name, root / name, seed=seed, vocab_size=1000, **overrides))
        make_tiny_tokenizer(dirs[name], vocab_size=1000)
        config = json.loads((Path(dirs[name]) / "tokenizer_config.json").read_text())
        (Path(dirs[name]) / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    other = make_tiny_hf_model(qwen3.FAMILY.name, root / "other_teacher", seed=5, vocab_size=1000, **four)
    make_tiny_tokenizer(other, vocab_size=700)  # other merges: the pair's tokens differ
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    words = ("tensor", "pipeline", "teacher", "student", "vocabulary", "divergence", "sample", "token")
    records = []
    for i in range(16):
        text = f"{words[i % len(words)]} {i} {words[(i * 3 + 1) % len(words)]}"
        records.append((text, {"teacher": "b"} if i % 2 else {}))
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": text, "response": " ok", **extra}) + "\n" for text, extra in records)
    with open(root / "messages.jsonl", "w") as f:
        for text, extra in records:
            messages = [{"role": "user", "content": text}]  # the prompt; SFT's target is "response"
            f.write(json.dumps({"messages": messages, "response": " ok", **extra}) + "\n")
    with open(root / "eval.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"{w} {100 + i}", "answer": str(i)}) + "\n" for i, w in enumerate(words))
    students = {k: v for k, v in dirs.items() if k != "teacher"}
    return SpaceFiles(dirs["teacher"], str(other), students, str(root / "prompts.jsonl"), str(root / "messages.jsonl"),
                      str(root / "eval.jsonl"))  # fmt: skip


def ci_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows CI runs from start to finish: each built-in-sampler row, and a pipeline-parallel (PP x VP) vLLM row
    that distils and evaluates. A vLLM row starts two engines (~20 s each on a CI core): all 20 would add ~12
    CPU-minutes to CI (CP's whole run with vLLM, evaluation and resume is tests/test_context_parallel.py's);
    ``MEGATRON_OPD_ARRAY=all`` runs every row."""
    chosen = [r for r in rows if r["rollout"] != "vllm"]
    pipeline = [r for r in rows if r["rollout"] == "vllm" and r["layout"] == "pp2_vp2"]
    chosen.append(next((r for r in pipeline if r["loss"] != "sft" and r["eval"] != "off"), pipeline[0]))
    return [r for r in rows if r in chosen]  # the array's order


def outcomes_file() -> Path:
    """Where this pytest session's rows write their outcomes (one file per session: pytest-xdist's workers are
    children of the session's process), for the session's closing summary (tests/conftest.py)."""
    import tempfile

    session = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    return Path(tempfile.gettempdir()) / f"megatron-opd-config-space-{session}.tsv"


def record_outcome(name: str, outcome: str) -> None:
    with open(outcomes_file(), "a") as f:
        f.write(f"{name}\t{outcome}\n")


def markdown() -> str:
    """The dimensions, the refusal list and the rows as docs/configurations.md shows them (a test keeps it equal)."""
    lines = ["| dimension | values |", "| --- | --- |"]
    lines += [f"| {d} | {', '.join(f'`{v}`' for v in vs)} |" for d, vs in DIMENSIONS.items()]
    lines += ["", "| refused together | the trainer's message says |", "| --- | --- |"]
    lines += [f"| `{r.first[0]}={r.first[1]}` + `{r.second[0]}={r.second[1]}` | {r.message}... |" for r in REFUSED]
    lines += ["", "| not composed (one side would be ignored) |", "| --- |"]
    lines += [f"| `{a[0]}={a[1]}` + `{b[0]}={b[1]}` |" for a, b in NOT_APPLICABLE]
    rows, ci = covering_array(), ci_rows(covering_array())
    lines += ["", f"| # | {' | '.join(DIMENSIONS)} | CI |", "| " + " | ".join(["---"] * (len(DIMENSIONS) + 2)) + " |"]
    lines += [f"| {i} | {' | '.join(r.values())} | {'runs' if r in ci else 'all'} |" for i, r in enumerate(rows)]
    return "\n".join(lines)
