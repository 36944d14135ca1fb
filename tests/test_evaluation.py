"""The held-out evaluator (``megatron_opd.trainer.evaluation``) with an in-process teacher at pipeline parallelism.

The built-in sampler cannot decode across pipeline stages, so a PP=2 run's evaluation skips the fixed teacher
responses with one log line and still measures the divergence on the student's own samples: equal to the same
evaluation at PP=1 (where the teacher's responses are measured too). The student's samples come from a fixed fake
rollout (a pipeline-parallel run samples with vLLM, not installed here), the same at both layouts.
"""

from __future__ import annotations

import logging

import pytest

from megatron_opd.testing.distill_fixture import make_distill_fixture
from megatron_opd.testing.multiprocess import run_distributed


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_distill_fixture(tmp_path_factory.mktemp("distill"))


def _evaluate_body(overrides: list[str]):
    """Build the evaluator as ``train()`` does (student and teacher chunks, this layout) and run it once; its metrics
    and the evaluation's log lines."""
    from types import SimpleNamespace

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.config import parse_args
    from megatron_opd.data.prompts import PromptEncoder
    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.testing.scheduler_fakes import RecordingRollout
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.evaluation import build_evaluator
    from megatron_opd.trainer.setup import build_teacher, load_vocabulary, max_seq_len

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    evaluation_log = logging.getLogger("megatron_opd.trainer.evaluation")
    evaluation_log.addHandler(Collect(logging.INFO))
    evaluation_log.setLevel(logging.INFO)
    cfg = parse_args(TrainConfig, overrides)
    cfg.validate()
    vocab = load_vocabulary(cfg)
    accel = initialize_distributed(cfg.parallel, "cpu", seed=cfg.seed)
    _, chunks = build_and_load(cfg.student.path, cfg.parallel, cfg.build, trainable=False, field="student.path")
    student = SimpleNamespace(chunks=chunks)
    teacher = build_teacher(cfg, accel, vocab.teacher_vocab_size, student)
    seq_len = max_seq_len(cfg)
    encoder = PromptEncoder.for_data(vocab.tokenizer, cfg.data)
    evaluator = build_evaluator(cfg, vocab, encoder, student, teacher, RecordingRollout([]),
                                seq_len - cfg.rollout.max_new_tokens, seq_len)  # fmt: skip
    return evaluator.run(), lines


def test_pipeline_parallel_evaluation_skips_teacher_responses_and_measures_the_rest(pair, tmp_path):
    common = pair.overrides(tmp_path, **{"build.dtype": "fp32", "train.max_seq_len": 64})
    (ref, ref_lines) = run_distributed(_evaluate_body, 1, args=(common,))[0]
    pp2 = [*common, "parallel.pipeline_model_parallel_size=2", "rollout.backend=vllm"]
    ranks = run_distributed(_evaluate_body, 2, args=(pp2,))
    assert "eval/divergence_teacher_samples" in ref and ref["eval/divergence_own_samples"] > 0
    assert not any("eval.teacher_responses" in line for line in ref_lines)
    for got, lines in ranks:  # every rank returns the global metrics
        assert "eval/divergence_teacher_samples" not in got
        assert got["eval/divergence_own_samples"] == pytest.approx(ref["eval/divergence_own_samples"], rel=1e-5)
        assert got["eval/response_length"] == ref["eval/response_length"] == 2.0
        skipped = [line for line in lines if "eval.teacher_responses" in line]
        assert len(skipped) == 1 and "pipeline_model_parallel_size=1" in skipped[0], lines
