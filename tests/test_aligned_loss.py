"""``loss.cross_tokenizer=aligned``: the top-k divergence on the tokens both vocabularies share, the sampled group
loss elsewhere (``losses.aligned``, ``CrossTokenizer`` with ``topk``).

With one tokenizer it is today's top-k loss (value and gradient, every kind and tail, ≤ 1e-6 fp32), also through
the trainer's loss function and the re-tokenizer; a mix of aligned and sampled positions against a float64
reference written from the definitions; vocab-parallel at TP=2 equal to TP=1 (in the same spawn: the sampled
reverse KL at TP=2 against tests/test_sampled_loss.py's float64 reference); and which positions of the
cross-tokenizer quick start's tokenizers (one token per digit vs a token per doubled digit) take the top-k loss,
with the teacher's ids mapped.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
from megatron_opd.data.prompts import PromptEncoder
from megatron_opd.interfaces import TeacherScores
from megatron_opd.losses.aligned import aligned_divergence
from megatron_opd.losses.sampled import SAMPLED_KINDS, label_logprobs, sampled_divergence
from megatron_opd.losses.topk import TAILS, topk_divergence
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.objective import make_loss_fn, teacher_columns
from tests.test_cross_tokenizer import _batch
from tests.test_sampled_loss import TEMPERATURES
from tests.test_sampled_loss import VOCAB as SAMPLED_VOCAB
from tests.test_sampled_loss import V as SAMPLED_V
from tests.test_sampled_loss import _inputs as sampled_inputs
from tests.test_sampled_loss import _reference as sampled_reference

T, V, VOCAB, K = 12, 26, 23, 5  # V - VOCAB padded columns never enter
KINDS = ("forward_kl", "reverse_kl", "jsd")


def _inputs(seed: int = 0, dtype=torch.float32):
    """Logits, labels, a teacher top-k (distinct ids, log-probs normalised over the vocabulary), group scores."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g, dtype=dtype) * 2
    labels = torch.randint(0, VOCAB, (T,), generator=g)
    teacher = torch.log_softmax(torch.randn(T, VOCAB, generator=g, dtype=torch.float64) * 2, -1)
    logprobs, ids = teacher.topk(K, dim=-1)
    group_logp = -torch.rand(T, generator=g, dtype=torch.float64) * 4
    return logits, labels, ids, logprobs.float(), group_logp.float()


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_position_aligned_is_the_topk_loss(kind, tail):
    logits, labels, ids, logprobs, group_logp = _inputs()
    support = torch.ones(T, K, dtype=torch.bool)
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, divergence = aligned_divergence(
        x, labels, torch.ones(T, dtype=torch.bool), ids, logprobs, support, group_logp, torch.zeros(T, dtype=torch.long),
        kind, vocab_size=VOCAB, tail=tail, beta=0.3,
    )  # fmt: skip
    want = topk_divergence(y, ids, logprobs, kind, tail=tail, beta=0.3, vocab_size=VOCAB)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(divergence, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)
    assert x.grad.abs().max() > 0


def _mixed():
    """Rows 0-5 aligned (row 2 with empty slots: unmapped teacher ids), rows 6-11 sampled in groups of 1-3."""
    aligned = torch.tensor([1] * 6 + [0] * 6, dtype=torch.bool)
    support = torch.ones(T, K, dtype=torch.bool)
    support[2, 1:3] = False
    offset = torch.tensor([0] * 6 + [0, -1, -2, 0, 0, -1])
    return aligned, support, offset


def _reference(logits, labels, ids, logprobs, support, group_logp, aligned, offset, kind, beta):
    """float64, from the definitions: at aligned rows the divergence between the teacher's and the student's
    distributions coarsened to the supported ids plus one bucket for the rest; at the others the surrogate
    ``sg(w) * log q(label)`` of the same kind, ``w`` from ``r = log q(group) - log p(group)``: ``r`` (reverse KL, and
    for jsd), ``1 - exp(-r)`` (forward KL)."""
    x = logits.detach().double().requires_grad_()
    logq_TV = torch.log_softmax(x[:, :VOCAB], dim=-1)
    terms = []
    for t in range(T):
        if aligned[t]:
            kept = support[t]
            p = logprobs[t][kept].double().exp()
            q = logq_TV[t, ids[t][kept]].exp()
            p, q = torch.cat([p, (1 - p.sum()).reshape(1)]), torch.cat([q, (1 - q.sum()).reshape(1)])
            kl = lambda a, b: (a * (a.log() - b.log())).sum()  # noqa: E731
            m = beta * p + (1 - beta) * q
            terms.append(
                {"forward_kl": kl(p, q), "reverse_kl": kl(q, p), "jsd": beta * kl(p, m) + (1 - beta) * kl(q, m)}[kind]
            )
        else:
            first = t + int(offset[t])
            members = [u for u in range(T) if not aligned[u] and u + int(offset[u]) == first]
            logq_group = sum(logq_TV[u, labels[u]] for u in members)
            log_ratio = (logq_group - group_logp[t].double()).detach()
            weight = 1 - (-log_ratio).exp() if kind == "forward_kl" else log_ratio  # jsd: the reverse KL's
            terms.append(weight * logq_TV[t, labels[t]])
    loss = torch.stack(terms)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), grad


@pytest.mark.parametrize("kind", KINDS)
def test_aligned_and_sampled_positions_against_float64(kind):
    logits, labels, ids, logprobs, group_logp = _inputs(1, torch.float64)
    aligned, support, offset = _mixed()
    x = logits.clone().requires_grad_()
    got, _ = aligned_divergence(x, labels, aligned, ids, logprobs.double(), support, group_logp, offset, kind,
                                vocab_size=VOCAB, beta=0.3)  # fmt: skip
    got.sum().backward()
    want, grad = _reference(logits, labels, ids, logprobs, support, group_logp, aligned, offset, kind, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(x.grad, grad, rtol=1e-9, atol=1e-12)
    assert x.grad[:, VOCAB:].abs().max() == 0  # padded columns get nothing


def _tp2_body():
    """At TP=2, each rank's loss and its shard of the gradient: the aligned loss, and the sampled divergences
    (``losses.sampled``, both kinds at every temperature of tests/test_sampled_loss.py; one spawn for all)."""
    import torch.distributed as dist

    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=2))
    logits, labels, ids, logprobs, group_logp = _inputs(2)
    aligned, support, offset = _mixed()
    rank, width = dist.get_rank(), V // 2
    x = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    loss, _ = aligned_divergence(x, labels, aligned, ids, logprobs, support, group_logp, offset, "jsd",
                                 vocab_size=VOCAB, beta=0.3)  # fmt: skip
    loss.sum().backward()
    sampled = []
    s_logits, s_labels, s_teacher = sampled_inputs()
    for kind in SAMPLED_KINDS:
        for temperature in TEMPERATURES:
            z = s_logits[:, rank * (SAMPLED_V // 2) : (rank + 1) * (SAMPLED_V // 2)].clone().requires_grad_()
            logq = label_logprobs(z, s_labels, vocab_size=SAMPLED_VOCAB, temperature=temperature)
            surrogate, _ = sampled_divergence(logq, s_teacher, kind)
            surrogate.sum().backward()
            sampled.append((float(surrogate.sum()), z.grad))
    return (loss.detach(), x.grad), sampled


def test_tp2_shards_give_the_tp1_loss_and_gradient():
    """The aligned loss at TP=2 equals TP=1's; both sampled divergences at TP=2 equal their float64 references."""
    ((loss0, grad0), sampled0), ((loss1, grad1), sampled1) = run_distributed(_tp2_body, 2)
    logits, labels, ids, logprobs, group_logp = _inputs(2)
    aligned, support, offset = _mixed()
    x = logits.clone().requires_grad_()
    want, _ = aligned_divergence(x, labels, aligned, ids, logprobs, support, group_logp, offset, "jsd",
                                 vocab_size=VOCAB, beta=0.3)  # fmt: skip
    want.sum().backward()
    torch.testing.assert_close(loss0, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([grad0, grad1], dim=1), x.grad, rtol=1e-6, atol=1e-7)
    cases = [(kind, temperature) for kind in SAMPLED_KINDS for temperature in TEMPERATURES]
    for (kind, temperature), (s0, g0), (s1, g1) in zip(cases, sampled0, sampled1, strict=True):
        ref_loss, ref_grad = sampled_reference(*sampled_inputs(), temperature, kind=kind)
        assert s0 == s1 == pytest.approx(ref_loss, rel=1e-12), f"{kind} at temperature {temperature}"
        torch.testing.assert_close(torch.cat([g0, g1], dim=1), ref_grad, rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def tokenizers(digit_tokenizers):
    return digit_tokenizers["none"], digit_tokenizers["doubles"]


def _teacher_topk(tokens: torch.Tensor, vocab: int, k: int, seed: int):
    """A teacher's top-k at every position of ``tokens`` ``[N, S]``: distinct ids, log-probabilities normalised
    over ``vocab``, and the log-probability of the next token."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(*tokens.shape, vocab, generator=g) * 3, dim=-1)
    values, ids = logp.topk(k, dim=-1)
    following = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    return TeacherScores(topk_ids=ids, topk_logprobs=values, requested_logprobs=logp.gather(-1, following[..., None]))


@pytest.mark.parametrize("kind", KINDS)
def test_one_tokenizer_through_the_retokenizer_and_the_trainers_loss_is_the_topk_loss(tokenizers, kind):
    tok, _ = tokenizers
    batch, rollouts, records = _batch(tok, ["21904", "19", "0"])
    cross = CrossTokenizer(tok, tok, PromptEncoder(tok), (tok.eos_token_id,), topk=True)
    request = cross.request(batch, rollouts, records)
    vocab = len(tok)
    scored = _teacher_topk(request.tokens, vocab, 6, seed=3)
    aligned_scores = cross.scores(scored, request, batch)
    w = request.tokens.shape[1]
    assert request.metrics["cross_tokenizer/topk_share"] == 1.0
    assert request.metrics["cross_tokenizer/mapped_teacher_mass"] == pytest.approx(
        request.metrics["cross_tokenizer/teacher_topk_mass"]
    )
    g = torch.Generator().manual_seed(4)
    n, s = batch.tokens.shape
    hidden = torch.randn(n, s, 8, generator=g, requires_grad=True)
    weight = torch.randn(vocab + 3, 8, generator=g)  # a padded output layer
    mb = {"loss_mask": batch.loss_mask, "labels": batch.next_tokens(), "seq_weights": torch.ones(n)}
    columns = torch.arange(s).clamp(max=w - 1)  # the batch is wider: its last columns repeat (never trained)
    plain = TeacherScores(topk_ids=scored.topk_ids[:, columns], topk_logprobs=scored.topk_logprobs[:, columns])
    common = dict(vocab_size=vocab, teacher_temperature=1.0, normalizer=float((batch.loss_mask != 0).sum()), scale=1.0)
    results = []
    for cross_mode, scores in (("off", plain), ("aligned", aligned_scores)):
        hidden.grad = None
        cfg = LossConfig(kind=kind, mode="topk", topk=6, cross_tokenizer=cross_mode, fused_output="off")
        loss, stats = make_loss_fn(cfg, **common)(hidden @ weight.t(), {**mb, **teacher_columns(scores)})
        loss.backward()
        results.append((float(loss.detach()), hidden.grad.clone(), stats))
    (loss, grad, stats), (loss_x, grad_x, stats_x) = results
    assert loss_x == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(grad_x, grad, rtol=1e-6, atol=1e-7)
    assert stats_x.agree_sum == stats.agree_sum and stats_x.divergence_sum == pytest.approx(stats.divergence_sum)
    assert stats_x.top1_tokens == stats.top1_tokens == stats.tokens > 0  # one tokenizer: every token has a twin


def test_a_groups_first_position_takes_the_topk_its_teacher_tokens_begin_with(tokenizers):
    """Student "3" "3" against the teacher's "33": the group's first position is a common boundary, so it takes the
    mapped top-k, the teacher's "33" credited to the student's "3" (what the student writes first), and "44" to
    "4"; the group's second position keeps the sampled loss (issue #41: a map of identical bytes left "33"'s mass
    unmapped while EOS mapped whole)."""
    student, teacher = tokenizers
    cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,), topk=True)
    batch, rollouts, records = _batch(student, ["21904", "3345"])
    request = cross.request(batch, rollouts, records)
    id_of = teacher.convert_tokens_to_ids
    t_ids = torch.tensor([id_of("33"), id_of("3"), teacher.eos_token_id, id_of("4"), id_of("44")])
    logprobs = torch.log(torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05]))
    n, st = request.tokens.shape
    scored = TeacherScores(topk_ids=t_ids.expand(n, st, 5).clone(), topk_logprobs=logprobs.expand(n, st, 5).clone(),
                           requested_logprobs=torch.full((n, st, 1), -1.0))  # fmt: skip
    scores = cross.scores(scored, request, batch)
    aligned = scores.extras["aligned_mask"]
    first = batch.prompt_lengths[1] - 1  # sample 1: "3" "3" | "4" "5" EOS against teacher "33" | "4" "5" EOS
    assert aligned[1, first : first + 5].tolist() == [True, False, True, True, True]
    assert aligned[0].sum() == 6 and (aligned <= (batch.loss_mask != 0)).all()  # "21904" EOS: all 1:1
    s_id = student.convert_tokens_to_ids
    for row in (first, first + 2):
        support = scores.extras["teacher_topk_support"][1, row]
        kept = dict(zip(scores.topk_ids[1, row][support].tolist(), scores.topk_logprobs[1, row][support].tolist()))
        assert kept == pytest.approx(
            {s_id("3"): math.log(0.7), student.eos_token_id: math.log(0.1), s_id("4"): math.log(0.15)}
        )
    m = request.metrics
    assert m["cross_tokenizer/topk_share"] == pytest.approx(10 / 11)
    assert m["cross_tokenizer/sampled_share"] == pytest.approx(1 / 11)
    assert m["cross_tokenizer/mapped_teacher_mass"] == pytest.approx(0.95)
    assert m["cross_tokenizer/teacher_topk_mass"] == pytest.approx(0.95)
    # The sampled group keeps its sum over the teacher's tokens: "33" is one teacher token, log p = -1.
    assert scores.requested_logprobs[1, first : first + 2, 0].tolist() == [-1.0, -1.0]
    assert scores.extras["group_offset"][1, first : first + 2].tolist() == [0, -1]


REFUSED = [
    (dict(mode="sampled", cross_tokenizer="aligned"), "loss.cross_tokenizer=aligned maps the teacher's top-k"),
    (dict(mode="topk", support="union", cross_tokenizer="aligned"), "set loss.mode=topk, a divergence loss.kind"),
    (dict(mode="topk", cross_tokenizer="aligned", fused_output="on"), "cannot be used with loss.cross_tokenizer=al"),
    (dict(mode="topk", cross_tokenizer="sampled"), "for a top-k loss on the tokens both vocabularies share"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_config_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)
    LossConfig(kind="jsd", mode="topk", tail="renorm", cross_tokenizer="aligned")
