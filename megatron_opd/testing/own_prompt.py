"""A teacher's own prompt (``teacher.prompt_template``) through a remote teacher, for the server and vLLM tests.

``own_prompt_case`` builds a student batch from a fixture's records (the student's prompts, random responses) and the
reprompter's request for it (a template that puts a hint before the prompt; one record's hint is empty, so its
sequence is the student's); ``assert_own_prompt_scores`` checks the teacher's scores, moved back by
``Reprompter.scores``, against log-probabilities of the teacher's own sequences (transformers', float64): at the
student's position ``s`` of a response token, the reference's at ``s + shift``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import torch

TEMPLATE = "{hint}{prompt}"
HINTS = ["answer {answer}. ", "", "the answer is {answer}, reversed: ", "answer {answer}. "]
"""Each record's privileged text (before its prompt); the second is empty: that sample's teacher sequence is the
student's."""


@dataclass
class OwnPromptCase:
    batch: object
    """The student's ``TrainBatch``."""
    request: object
    """The ``ReprompterRequest``: the teacher's sequences and requested ids."""
    records: list[dict]


def own_prompt_case(tokenizer, records_file: str, vocab: int, seed: int = 0) -> OwnPromptCase:
    """The first ``len(HINTS)`` records of ``records_file`` with a ``hint`` field, the student's batch (responses of
    3 to 6 random ids below ``vocab``) and the reprompter's request (the template rendered with ``tokenizer``)."""
    from megatron_opd.data.batch import pack
    from megatron_opd.data.prompts import PromptEncoder
    from megatron_opd.data.teacher_prompt import TemplatePromptEncoder
    from megatron_opd.teacher.reprompt import Reprompter

    with open(records_file) as f:
        lines = [json.loads(line) for line, _ in zip(f, HINTS)]
    records = [{**r, "hint": h.format(**r)} for r, h in zip(lines, HINTS)]
    student = PromptEncoder(tokenizer)
    prompts = [torch.tensor(student.prompt_ids(r, f"record {i}")) for i, r in enumerate(records)]
    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(0, vocab, (3 + i % 4,), generator=g) for i in range(len(records))]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = pack(prompts, responses, [torch.ones(r.numel()) for r in responses], pad_token_id=pad)
    reprompter = Reprompter(TemplatePromptEncoder(tokenizer, TEMPLATE), pad_token_id=pad)
    request = reprompter.request(batch, SimpleNamespace(prompt_index=list(range(len(records)))), records)
    return OwnPromptCase(batch, request, records)


def assert_own_prompt_scores(scores, case: OwnPromptCase, ref_NSV: torch.Tensor, atol: float, what: str) -> None:
    """``scores`` (``Reprompter.scores`` of the teacher's reply to ``case.request``) hold, at each response token's
    student position, ``ref_NSV``'s (log-probabilities of ``case.request.tokens``) at the teacher's position: the
    requested log-probability of the token, and the top-k's log-probabilities and ids (up to ties within ``atol``)."""
    batch, request = case.batch, case.request
    assert sorted(request.shifts)[0] == 0 < max(request.shifts), f"{what}: the case needs hinted and bare samples"
    for i, (p, n, shift) in enumerate(zip(batch.prompt_lengths, batch.lengths, request.shifts)):
        assert torch.equal(request.tokens[i, p + shift : n + shift], batch.tokens[i, p:n]), f"{what}: response moved"
        ref = ref_NSV[i, p - 1 + shift : n - 1 + shift].double()  # the teacher's positions predicting the response
        where = f"{what}, sample {i}"
        labels = batch.tokens[i, p:n, None]
        got = scores.requested_logprobs[i, p - 1 : n - 1, :1].double()
        torch.testing.assert_close(got, ref.gather(-1, labels), atol=atol, rtol=0, msg=where)
        if scores.topk_ids is None:
            continue
        ids, logprobs = scores.topk_ids[i, p - 1 : n - 1], scores.topk_logprobs[i, p - 1 : n - 1].double()
        values = ref.topk(ids.shape[-1], dim=-1).values
        torch.testing.assert_close(logprobs, values, atol=atol, rtol=0, msg=f"{where}, top-k")
        torch.testing.assert_close(ref.gather(-1, ids), values, atol=2 * atol, rtol=0, msg=f"{where}, top-k ids")
