"""The typed micro-batch the loss sees (``trainer.loss_batch.LossBatch``) and the objective the config picks
(``trainer.objective.objective_for``): the config, not the micro-batch's keys, decides the loss; a micro-batch
without the configured teacher signal is refused by name; the fused output layer's flatten/select keeps each
token's fields together. The losses themselves are checked against float64 references in test_losses.py,
test_fused_output.py, test_sampled_loss.py and test_aligned_loss.py."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.loss_batch import LossBatch
from megatron_opd.trainer.objective import (
    AlignedObjective,
    DenseObjective,
    SampledObjective,
    SftObjective,
    TopkObjective,
    make_loss_fn,
    objective_for,
)

B, S, V, K = 2, 5, 12, 3


def _micro_batch(gen: torch.Generator) -> dict:
    logits = torch.randn(B, S, V, generator=gen)
    top = torch.log_softmax(logits, -1).topk(K, dim=-1)
    return {
        "tokens": torch.randint(0, V, (B, S), generator=gen),
        "loss_mask": torch.ones(B, S),
        "labels": torch.randint(0, V, (B, S), generator=gen),
        "seq_weights": torch.tensor([1.0, 0.5]),
        "teacher_logits": logits,
        "teacher_topk_ids": top.indices,
        "teacher_topk_logprobs": top.values,
    }


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (LossConfig(kind="sft"), SftObjective),
        (LossConfig(mode="dense"), DenseObjective),
        (LossConfig(mode="topk"), TopkObjective),
        (LossConfig(mode="topk", support="union"), TopkObjective),
        (LossConfig(mode="sampled"), SampledObjective),
        (LossConfig(mode="sampled", cross_tokenizer="sampled"), SampledObjective),
        (LossConfig(mode="topk", cross_tokenizer="aligned"), AlignedObjective),
    ],
)
def test_the_config_picks_the_objective(cfg, expected):
    assert type(objective_for(cfg, vocab_size=V, teacher_temperature=1.0)) is expected


def test_the_config_not_the_keys_decides_the_loss():
    """A micro-batch holding both a dense teacher's logits and its top-k trains what the config asks for: each loss
    equals the one given only its own columns, and the two differ."""
    gen = torch.Generator().manual_seed(0)
    mb = _micro_batch(gen)
    logits = torch.randn(B, S, V, generator=gen)
    common = dict(vocab_size=V, teacher_temperature=1.0, normalizer=float(B * S), scale=1.0)
    losses = {}
    for mode, drop in (("dense", ("teacher_topk_ids", "teacher_topk_logprobs")), ("topk", ("teacher_logits",))):
        fn = make_loss_fn(LossConfig(mode=mode, topk=K), **common)
        both, _ = fn(logits.clone(), mb)
        own, _ = fn(logits.clone(), {k: v for k, v in mb.items() if k not in drop})
        assert float(both) == float(own)
        losses[mode] = float(both)
    assert losses["dense"] != pytest.approx(losses["topk"], rel=1e-3)


def test_a_micro_batch_without_the_configured_signal_is_refused_by_name():
    gen = torch.Generator().manual_seed(1)
    mb = _micro_batch(gen)
    common = dict(vocab_size=V, teacher_temperature=1.0, normalizer=1.0, scale=1.0)
    dense_only = {k: v for k, v in mb.items() if not k.startswith("teacher_topk")}
    with pytest.raises(ValueError, match="TopkObjective.*no teacher_topk_ids, teacher_topk_logprobs"):
        make_loss_fn(LossConfig(mode="topk", topk=K), **common)(torch.randn(B, S, V), dense_only)
    with pytest.raises(ValueError, match="SampledObjective.*no teacher_label_logprobs"):
        make_loss_fn(LossConfig(mode="sampled"), **common)(torch.randn(B, S, V), mb)
    with pytest.raises(ValueError, match="neither the teacher's logits nor its hidden states"):
        make_loss_fn(LossConfig(mode="dense"), **common)(torch.randn(B, S, V), {**dense_only, "teacher_logits": None})


def test_flatten_and_select_keep_each_tokens_fields_together():
    gen = torch.Generator().manual_seed(2)
    mb = _micro_batch(gen)
    batch = LossBatch.of({**mb, "token_weights": torch.rand(B, S, generator=gen)})
    assert batch.weights is not None and batch.teacher_hidden is None  # "tokens" is the model's, not a field
    index = torch.tensor([6, 0, 9])
    chunk = batch.flatten().select(index)
    b, s = index // S, index % S
    torch.testing.assert_close(chunk.teacher_logits, mb["teacher_logits"][b, s], rtol=0, atol=0)
    torch.testing.assert_close(chunk.teacher_topk_ids, mb["teacher_topk_ids"][b, s], rtol=0, atol=0)
    torch.testing.assert_close(chunk.labels, mb["labels"][b, s], rtol=0, atol=0)
    torch.testing.assert_close(chunk.weights, batch.weights[b, s], rtol=0, atol=0)


def test_only_the_objectives_and_the_config_compare_loss_settings():
    """The loss is chosen in one place: ``loss.kind``/``mode``/``cross_tokenizer``/``support`` are compared only in
    the objectives' module and the config's cross-checks (the rest of the package asks the objective: ``samples``,
    ``needs_teacher``, ``teacher_request``, ...). The issue's grep, over every file of the package."""
    import re
    from pathlib import Path

    import megatron_opd

    pattern = re.compile(r"(loss|cfg)\.(kind|mode|cross_tokenizer|support) *(==|!=|in )")
    package = Path(megatron_opd.__file__).parent
    matching = {
        path.relative_to(package.parent).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and pattern.search(path.read_text(errors="ignore"))
    }
    assert matching <= {"megatron_opd/trainer/objective.py", "megatron_opd/trainer/config.py"}, sorted(matching)
    assert "megatron_opd/trainer/objective.py" in matching  # the pattern finds what it looks for


@pytest.mark.parametrize(
    "cfg, teacher, samples, asked",
    [
        (LossConfig(kind="sft"), False, False, None),
        (LossConfig(mode="dense", topk=8), True, True, ("dense", 8, 0, False, False)),
        (LossConfig(mode="topk", topk=8), True, True, ("topk", 8, 0, False, False)),
        (LossConfig(mode="topk", topk=8, support="union", student_topk=4), True, True, ("topk", 8, 4, False, False)),
        (LossConfig(mode="sampled", topk=8), True, True, ("topk", 1, 0, True, False)),
        (LossConfig(mode="topk", topk=8, cross_tokenizer="aligned"), True, True, ("topk", 8, 0, True, True)),
    ],
)
def test_the_objective_declares_what_the_trainer_asks_of_the_loss(cfg, teacher, samples, asked):
    """Whether a teacher scores the batch, whether the student samples it and what the teacher must return are the
    objective's to say (``setup``, ``train``, the evaluator and the launcher ask it, not the config's keys)."""
    objective = objective_for(cfg)
    assert (objective.needs_teacher, objective.samples) == (teacher, samples)
    got = objective.teacher_request
    if asked is None:
        assert got is None
    else:
        assert (got.mode, got.topk, got.student_topk, got.label_logprobs, got.mapped_topk) == asked
