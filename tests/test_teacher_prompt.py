"""A teacher's own prompt (``teacher.prompt_template``): the template's fields, the teacher's record and ids, the
same-tokenizer reprompter's moves of every score kind against a loop, and the refusals (a record missing a field
the template names, by name, before any model is built; a malformed template; SFT). The in-process teacher's scores
after the longer prompt are checked against transformers at TP=1, TP=2 and packed in ``test_packing``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.data.batch import pack
from megatron_opd.data.records import DataError
from megatron_opd.data.teacher_prompt import TemplatePromptEncoder, check_records, template_fields
from megatron_opd.interfaces import TeacherScores
from megatron_opd.teacher.reprompt import Reprompter

TEMPLATE = "answer {answer}. {prompt}"


def test_template_fields_and_the_teacher_record():
    assert template_fields("{prompt} hint: {hint} {hint} {doc[0]} {meta.source} {{literal}}") == [
        "prompt", "hint", "doc", "meta"
    ]  # fmt: skip
    for bad in ("{} and {prompt}", "{0}"):
        with pytest.raises(ValueError, match="must name a record field"):
            template_fields(bad)
    encoder = TemplatePromptEncoder(tokenizer=None, template=TEMPLATE)
    text = {"prompt": "reverse 123 =", "answer": "321"}
    assert encoder.teacher_record(text, "r")["prompt"] == "answer 321. reverse 123 ="
    chat = {"messages": [{"role": "user", "content": "reverse 123"}], "answer": "321"}
    system = TemplatePromptEncoder(tokenizer=None, template="The answer is {answer}.").teacher_record(chat, "r")
    assert system["messages"] == [{"role": "system", "content": "The answer is 321."}, *chat["messages"]]
    assert chat["messages"] == [{"role": "user", "content": "reverse 123"}], "the student's record was changed"
    with pytest.raises(DataError, match="names field 'answer', which the record lacks"):
        encoder.teacher_record({"prompt": "reverse 123 ="}, "r")


def test_a_record_missing_a_template_field_is_refused_by_name(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(DataError, match=r"data.train_files .*train.jsonl record 1: .*names field 'answer'"):
        check_records(TEMPLATE, [str(path)], "data.train_files")
    check_records("{prompt}", [str(path)], "data.train_files")


def test_the_trainer_refuses_a_missing_field_before_any_model_is_built(tiny_model_dirs, tmp_path, monkeypatch):
    """``check_inputs`` (no process group, no model) names the teacher's key and the field; ``teachers.NAME``
    inherits the key; SFT with a template is refused by the config."""
    from megatron_opd.config import parse_args
    from megatron_opd.trainer import setup
    from megatron_opd.trainer.config import TrainConfig

    monkeypatch.setattr(setup, "build_and_load", None)  # building a model here would fail loudly
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "reverse 12 ="}) + "\n")
    model = tiny_model_dirs["llama"]
    base = [f"student.path={model}", f"data.train_files={path}", f"output_dir={tmp_path / 'run'}"]
    cfg = parse_args(TrainConfig, [*base, f"teacher.path={model}", f"teacher.prompt_template={TEMPLATE}"])
    cfg.validate()
    with pytest.raises(DataError, match="teacher.prompt_template names field 'answer'"):
        setup.check_inputs(cfg)
    named = parse_args(TrainConfig, [*base, "teachers.a.backend=server", "teachers.a.address=127.0.0.1:1",
                                     f"teachers.a.prompt_template={TEMPLATE}", "teachers.b.backend=server",
                                     "teachers.b.address=127.0.0.1:2", "loss.mode=topk", "train.packing=false"])  # fmt: skip
    assert named.teacher_views()["a"].teacher.prompt_template == TEMPLATE
    assert named.teacher_views()["b"].teacher.prompt_template is None
    with pytest.raises(ValueError, match="loss.kind=sft has no teacher"):
        parse_args(TrainConfig, [*base, "loss.kind=sft", f"teacher.prompt_template={TEMPLATE}"]).validate()
    with pytest.raises(ValueError, match="must name a record field"):
        parse_args(TrainConfig, [*base, f"teacher.path={model}", "teacher.prompt_template=hint {0}"]).validate()


def test_reprompter_moves_every_score_kind_to_the_student_positions():
    """Sequences of hint + prompt + response; a fake teacher whose score at each of its positions encodes (sample,
    position); mapped back, position ``s`` of the student holds the teacher's ``s + len(hint)`` (loop reference),
    for top-k, requested log-probabilities, dense logit shards and hidden states."""
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    responses = [torch.tensor([7, 8]), torch.tensor([9, 10, 11]), torch.tensor([12])]
    batch = pack(prompts, responses, [torch.ones(r.numel()) for r in responses], pad_token_id=0, seq_len=8)
    hints = [[20, 21], [], [22, 23, 24, 25]]
    records = [{"ids": h + p.tolist()} for h, p in zip(hints, prompts)]
    encoder = SimpleNamespace(prompt_ids=lambda record, where: record["ids"])
    request = Reprompter(encoder, pad_token_id=0).request(batch, SimpleNamespace(prompt_index=[0, 1, 2]), records)
    for i, (h, p, r) in enumerate(zip(hints, prompts, responses)):
        assert request.tokens[i, : request.lengths[i]].tolist() == h + p.tolist() + r.tolist()
        # The position before each response token asks for it.
        start = len(h) + p.numel() - 1
        assert request.request_ids[i, start : start + r.numel(), 0].tolist() == r.tolist()
    # Every position asks for the token it predicts, as a vLLM teacher requires.
    assert torch.equal(request.request_ids[:, :-1, 0], request.tokens[:, 1:])
    n, width = request.tokens.shape
    code = (torch.arange(n)[:, None] * 100 + torch.arange(width)[None]).float()  # sample * 100 + teacher position
    scores = TeacherScores(
        topk_ids=code.long()[..., None].expand(n, width, 2), topk_logprobs=code[..., None].expand(n, width, 2),
        requested_logprobs=code[..., None], dense_hidden=code[..., None].expand(n, width, 3),
        extras={"kept": torch.ones(1)},
    )  # fmt: skip
    moved = Reprompter.scores(scores, request, batch)
    for i, (p, length) in enumerate(zip(batch.prompt_lengths, batch.lengths)):
        for s in range(p - 1, length - 1):  # the positions predicting a response token
            want = i * 100 + s + len(hints[i])
            assert moved.requested_logprobs[i, s, 0] == want and (moved.topk_ids[i, s] == want).all()
            assert (moved.topk_logprobs[i, s] == want).all() and (moved.dense_hidden[i, s] == want).all()
    assert moved.requested_logprobs.shape == (3, 8, 1) and moved.extras == scores.extras
    dense = Reprompter.scores(TeacherScores(dense_logits=code[..., None].expand(n, width, 5)), request, batch)
    assert dense.dense_logits[2, 1, 4] == 200 + 1 + 4  # sample 2: prompt 2, hint 4
