"""Every configuration the trainer accepts works from start to finish, and everything else is refused before any model
is built: a pairwise covering array over the dimensions users compose (``megatron_opd/testing/config_space.py``).

Each row either is refused in process (``parse_args`` -> ``validate`` -> ``check_inputs``, as ``train()`` starts) or
trains 3 steps saving at step 2, resumes from that checkpoint to step 3 (equal to the uninterrupted run at the same
layout; at ``resume=other_layout`` on another layout), evaluates and exports a folder transformers loads. Jobs run
from a folder outside the repository (``RankJob``), under a time limit: a hang fails the row with every rank's
output.
"""

from __future__ import annotations

import math
import os
import shutil
from itertools import combinations
from pathlib import Path

import pytest

from megatron_opd.testing import config_space as space
from megatron_opd.testing.multiprocess import find_free_port, run_trainer
from megatron_opd.testing.teacher_jobs import start_teacher_server, stop, train_metrics, wait_ready

ROWS = space.covering_array()
RUN = ROWS if os.environ.get("MEGATRON_OPD_ARRAY") == "all" else space.ci_rows(ROWS)


def test_the_array_covers_every_pair_that_is_not_excluded():
    """Counted here independently of covertable: every pair of values of two dimensions is in a row, unless
    excluded; no row holds an excluded pair; CI's rows hold every layout but CP's (its whole run with vLLM,
    evaluation and resume: tests/test_context_parallel.py)."""
    assert space.uncovered_pairs(ROWS) == []
    excluded = space.excluded_pairs()
    assert not [r for r in ROWS if any(frozenset(p) in excluded for p in combinations(r.items(), 2))]
    assert {r["layout"] for r in space.ci_rows(ROWS)} == set(space.DIMENSIONS["layout"]) - {"cp2"}  # CP: below


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("config_space")
    made = space.make_space_files(root / "files")
    if not any(r["teacher"] in ("server", "two_teachers") and not _refusal(r) for r in ROWS):
        yield made
        return
    log = root / "server.log"
    proc = start_teacher_server(made.teacher, port=find_free_port(), ready_file=root / "ready", log_file=log)
    try:
        yield space.SpaceFiles(**{**made.__dict__, "server": wait_ready(proc, root / "ready", str(log))})
    finally:
        stop(proc)


def _refusal(row: dict[str, str]) -> space.Refusal | None:
    held = set(row.items())
    return next((r for r in space.REFUSED if r.first in held and r.second in held), None)


def _refused_before_build(overrides: list[str]) -> str | None:
    """The trainer's refusal of ``overrides`` from its first steps (no process group, no model), or None."""
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import check_inputs

    try:
        cfg = parse_args(TrainConfig, overrides)
        cfg.validate()
        check_inputs(cfg)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("refusal", space.REFUSED, ids=lambda r: f"{r.first[1]}+{r.second[1]}")
def test_each_refused_pair_is_refused_before_any_model(refusal, files, tmp_path):
    """A row of the array with the pair put in (and no other excluded pair): refused in process, in those words."""
    row = next(r for r in _rows_with(refusal))
    message = _refused_before_build(space.command_line(space.value_overrides(row, files), tmp_path / "run"))
    assert message is not None and refusal.message in message, (row, message)
    space.record_outcome(f"{refusal.first[0]}={refusal.first[1]} + {refusal.second[0]}={refusal.second[1]}",
                         f"refused before build: {message.splitlines()[0][:160]}")  # fmt: skip


def _rows_with(refusal: space.Refusal):
    excluded = space.excluded_pairs() - {frozenset((refusal.first, refusal.second))}
    for row in ROWS:
        candidate = {**row, refusal.first[0]: refusal.first[1], refusal.second[0]: refusal.second[1]}
        if not any(frozenset(p) in excluded for p in combinations(candidate.items(), 2)):
            yield candidate


def test_no_row_is_refused(files, tmp_path):
    """The array holds no excluded pair, so the trainer accepts every row (a refusal here is one the list lacks)."""
    refused = {}
    for row in ROWS:
        message = _refused_before_build(space.command_line(space.value_overrides(row, files), tmp_path / "run"))
        if message is not None:
            refused[space.row_name(row)] = message
    assert refused == {}, "\n".join(f"{k}: {v}" for k, v in refused.items())


@pytest.mark.parametrize("row", ROWS, ids=[f"{i:02d}-{space.row_name(r)}" for i, r in enumerate(ROWS)])
def test_the_row_runs_resumes_evaluates_and_exports(row, files, tmp_path):
    from transformers import AutoModelForCausalLM

    if row not in RUN:
        space.record_outcome(space.row_name(row), "accepted (a vLLM row beyond CI's cover)")
        pytest.skip("a vLLM row beyond CI's cover (config_space.ci_rows): MEGATRON_OPD_ARRAY=all runs it")
    overrides = space.value_overrides(row, files)
    straight = tmp_path / "straight"
    refused = _refused_before_build(space.command_line(overrides, straight))
    assert refused is None, f"refused before build, but no refusal of the list names it: {refused}"
    nproc = space.world_size(row["layout"])
    compared = row["resume"] == "same_layout" and row["scheduler"] == "zero_step_off"  # same samples, same weights
    first = {**overrides, "export_hf": False, **({} if compared else {"data.eval_files": ""})}
    code, out = run_trainer(space.command_line(first, straight), nproc=nproc, timeout=300)
    assert code == 0, out[-4000:]
    steps = {r["step"]: r for r in train_metrics(straight) if "loss" in r}
    assert sorted(steps) == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in steps.values())

    # resume from the step-2 checkpoint (a copy), at this layout or another, then evaluate and export
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    layout = row["layout"] if row["resume"] == "same_layout" else space.RESUME_AT[row["layout"]]
    at = space.value_overrides(row, files, layout=layout)
    code, out = run_trainer(space.command_line(at, resumed), nproc=space.world_size(layout), timeout=300)
    assert code == 0, out[-4000:]
    assert "(step 2)" in out, out[-3000:]
    after = {r["step"]: r for r in train_metrics(resumed) if "loss" in r}
    assert sorted(after) == [3] and math.isfinite(after[3]["loss"])
    if compared:
        assert after[3]["loss"] == pytest.approx(steps[3]["loss"], rel=1e-5, abs=1e-7)
        evals = [_last_eval(straight), _last_eval(resumed)]
        assert evals[1] == pytest.approx(evals[0], rel=1e-5, abs=1e-7), "the resumed run evaluates otherwise"
    if row["eval"] != "off":
        assert any(k.startswith("eval/") for r in train_metrics(resumed) for k in r), "no evaluation logged"
    assert AutoModelForCausalLM.from_pretrained(resumed / "hf") is not None
    space.record_outcome(space.row_name(row), "ran, resumed, evaluated, exported")


def test_chat_records_need_the_template_of_each_tokenizer_that_encodes_them(files, tmp_path):
    """A cross-tokenizer teacher re-tokenizes each chat prompt with its own template: one without is refused before
    any model (it stopped the run at its first batch)."""
    import json

    row = next(r for r in ROWS if r["teacher"] == "other_tokenizer" and r["loss"] != "sft")
    bare = tmp_path / "bare_teacher"
    shutil.copytree(files.other_teacher, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    overrides = {**space.value_overrides({**row, "records": "messages"}, files), "teacher.path": str(bare)}
    message = _refused_before_build(space.command_line(overrides, tmp_path / "run"))
    assert message is not None and "(the tokenizer of teacher.tokenizer)" in message and "no chat template" in message


def _last_eval(run) -> dict[str, float]:
    rows = [r for r in train_metrics(run) if any(k.startswith("eval/") for k in r)]
    return {k: v for k, v in rows[-1].items() if k.startswith("eval/")} if rows else {}


def test_the_docs_show_the_dimensions_refusals_and_rows():
    text = (Path(__file__).resolve().parents[1] / "docs" / "configurations.md").read_text()
    assert space.markdown() in text, "docs/configurations.md is out of date: paste config_space.markdown()"
