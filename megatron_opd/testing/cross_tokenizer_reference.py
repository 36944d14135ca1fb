"""An exact float64 reference for the cross-tokenizer objective, by enumerating every response of a tiny student.

A tiny pair (:func:`pair_matrix`): two tokenizers of tens of tokens (byte-level BPE, :func:`tiny_tokenizer`, or
SentencePiece-style, :func:`sentencepiece_tokenizer`), a student that is a table of float64 logits, one row per
response prefix (:class:`TinyStudent`, the parameters the gradients are taken against), and a teacher that is
``teacher_fakes.ToyScorer`` over its own tokens. :class:`CodePath` runs the same responses through the trainer's
data path and losses, for the tests (tests/test_cross_tokenizer_reference.py) to compare; ``python -m
megatron_opd.testing.cross_tokenizer_reference`` prints the gap table of docs/losses.md. Every student response of at most
``max_tokens`` tokens (ending in EOS, or cut at the bound) is listed with its probability, so expectations are sums.

What is computed here, from the tokenizers and the two models alone (none of ``megatron_opd.cross_tokenizer``):

- The teacher's probability of a response, as its fine-tuning saw it: the prompt and the answer tokenized apart,
  the answer's canonical tokens, EOS where the student stopped. Where the text ends without EOS (cut at the bound)
  the last token is scored as the prefix it is: the teacher's probability of any of its tokens that begin with those
  bytes. ``canonical``: the response text as the student wrote it (what the code scores); ``boundary sum``: the
  answer (one leading space taken off) summed over both boundary variants, with and without the leading space.
- (a) The sequence-level divergence between the student's distribution over texts (its tokenizations of one text
  summed) and the teacher's probability of the same texts, reverse ``sum Q log(Q/P)`` or forward
  ``sum P log(P/Q) - P + Q`` (over the texts the student can write; ``P`` need not sum to 1 there), and its gradient.
- (b) Its fixed-prefix (per-position) part, on the canonical teacher: the response's text cut into groups at the byte
  offsets where both tokenizations have a boundary (EOS with EOS); each group's divergence ``d_g`` from
  ``log q(group) - log p(group)`` (``r = p/q``: ``log 1/r`` reverse, ``r log r - r + 1`` forward); the last text token
  scored as a prefix and EOS given the rest where the student stopped. The value is ``E_q[sum_g d_g]``, the gradient
  ``E_q[sum_t w_g(t) grad log q(y_t | y_<t)]`` with ``w = log 1/r`` (reverse) or ``1 - r`` (forward): the sequence
  gradient without its cross terms (a group's weight on other groups' tokens).

Shape legend: ``N`` responses, ``L`` response positions (``max_tokens + 1``), ``V`` student vocabulary, ``G`` groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_opd.testing.real_tokenizers import byte_level_tokenizer
from megatron_opd.testing.teacher_fakes import ToyScorer
from megatron_opd.tokenizer import bytes_to_unicode

EOS = "<eos>"
"""Every tiny tokenizer's EOS (id 0)."""
_BYTE_CHARS = bytes_to_unicode()
_CHAR_BYTES = {char: byte for byte, char in _BYTE_CHARS.items()}
_SPACE = "\u2581"
"""SentencePiece's space."""
_RULED_OUT = -30.0
"""The student's logit of a token it never writes (a lone byte of "é"): a probability under 1e-12 that the
enumeration leaves out, as a trained student gives such a token little but not nothing (a loss's tail sees it)."""


def _chars(text: str | bytes) -> str:
    """``text`` (or raw bytes) in the byte-level alphabet."""
    return "".join(_BYTE_CHARS[b] for b in (text.encode() if isinstance(text, str) else text))


def tiny_tokenizer(alphabet: str, merges: list[tuple[str | bytes, str | bytes]], split_words: bool):
    """A byte-level BPE of the bytes of ``alphabet``, EOS and one token per merge (texts or raw bytes, in merge
    order).
    ``split_words``: GPT-2's word split first (no merge crosses a space); else merges may cross spaces."""
    pairs = [(_chars(a), _chars(b)) for a, b in merges]
    return byte_level_tokenizer(pairs, split_words, alphabet=_chars(alphabet), eos=EOS)


def sentencepiece_tokenizer(alphabet: str, merges: list[tuple[str, str]]):
    """A SentencePiece-style BPE ("▁" for a space, a dummy prefix "▁" put before every text, stripped when decoding)
    of the characters of ``alphabet``, EOS and one token per merge (texts)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0}
    for char in alphabet.replace(" ", _SPACE):
        vocab.setdefault(char, len(vocab))
    pairs = [(a.replace(" ", _SPACE), b.replace(" ", _SPACE)) for a, b in merges]
    for a, b in pairs:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)


def byte_table(tokenizer) -> list[bytes]:
    """Each id's bytes, read off its vocabulary string (byte-level characters, or "▁" for a space; EOS: none)."""
    byte_level = _SPACE not in "".join(tokenizer.get_vocab())
    table = [b""] * len(tokenizer.get_vocab())
    for token, i in tokenizer.get_vocab().items():
        if token != EOS:
            table[i] = bytes(_CHAR_BYTES[c] for c in token) if byte_level else token.replace(_SPACE, " ").encode()
    return table


@dataclass(frozen=True)
class TinyPair:
    """A (student, teacher) tokenizer pair and the responses the student can write."""

    name: str
    student: Any
    teacher: Any
    prompt: str
    student_tokens: tuple[str, ...]
    """The texts of the tokens the student writes (besides EOS); it gives the others no probability."""
    max_tokens: int
    teacher_seed: int = 0
    teacher_temperature: float = 3.0
    """Softens ``ToyScorer``'s logits (a teacher of a few nats per token, not one that rules almost all out)."""


def pair_matrix() -> dict[str, TinyPair]:
    """The tiny pairs, by name:

    - ``same``: one tokenizer (the control: every group one token, every sample its own canonical tokenization).
    - ``cross_space``: a word-level student against a teacher whose merges cross spaces (" 1 2", "1 2"), with merges
      across the prompt/answer boundary ("= 1") that tokenizing the two apart never uses; answers with and without
      a leading space.
    - ``space_answer``: the student always starts its answer with a space (" 1"), the teacher has no token with a
      leading space but a doubled digit ("11"): the stop lands on a lone "1" the teacher writes only last.
    - ``multibyte``: "é" one student token, two bytes for the teacher, one of them merged with a digit ("\\xa91").
    - ``student_longer``: the student's tokens span digits and spaces ("12", " 21"), the teacher is per character.
    - ``sentencepiece``: a SentencePiece-style teacher (a dummy-prefix space before every answer, "▁1▁2" across
      spaces) for the word-level student.
    """
    digits = "12 ="
    word = tiny_tokenizer(digits, [(" ", "1"), (" ", "2")], split_words=True)
    return {
        "same": TinyPair("same", word, word, "2 1 =", ("1", "2", " 1", " 2"), max_tokens=4),
        "cross_space": TinyPair(
            "cross_space",
            tiny_tokenizer(digits, [(" ", "1"), (" ", "2")], split_words=True),
            tiny_tokenizer(digits, [(" ", "1"), (" ", "2"), (" 1", " 2"), ("1", " 2"), ("=", " 1")], split_words=False),
            "2 1 =",
            ("1", "2", " 1", " 2", " ", "="),
            max_tokens=4,
            teacher_seed=4,
        ),
        "space_answer": TinyPair(
            "space_answer",
            tiny_tokenizer(digits, [(" ", "1"), (" ", "2")], split_words=True),
            tiny_tokenizer(digits, [("1", "1"), ("2", "1")], split_words=False),
            "1 2 =",
            (" 1", " 2", "1", "2", " ", "="),
            max_tokens=3,
            teacher_seed=1,
        ),
        "multibyte": TinyPair(
            "multibyte",
            tiny_tokenizer("1é =", [(b"\xc3", b"\xa9"), (" ", "1"), (" ", "é")], split_words=True),
            tiny_tokenizer("1é =", [(b"\xa9", "1"), (" ", "1")], split_words=False),
            "é 1 =",
            ("é", "1", " 1", " é", " ", "="),
            max_tokens=3,
            teacher_seed=2,
        ),
        "student_longer": TinyPair(
            "student_longer",
            tiny_tokenizer(digits, [("1", "2"), (" ", "2"), (" 2", "1"), (" ", "1")], split_words=False),
            tiny_tokenizer(digits, [], split_words=False),
            "2 1 =",
            ("1", "2", "12", " 21", " 1", " 2", " ", "="),
            max_tokens=3,
            teacher_seed=3,
        ),
        "sentencepiece": TinyPair(
            "sentencepiece",
            word,
            sentencepiece_tokenizer(digits, [(" ", "1"), (" ", "2"), (" 1", " 2"), ("2", " 1")]),
            "2 1 =",
            ("1", "2", " 1", " 2", " ", "="),
            max_tokens=3,
            teacher_seed=5,
        ),
    }


@dataclass
class Responses:
    """Every response of the student, its ids and where each position's logits come from."""

    ids: list[list[int]]
    """Per response, its student ids (EOS last where it stopped)."""
    stopped: list[bool]
    nodes_NL: torch.Tensor
    """The prefix (a row of the student's table) each response position is predicted from; 0 past the end."""
    labels_NL: torch.Tensor
    mask_NL: torch.Tensor
    """1 at the positions of the response's tokens."""


def enumerate_responses(pair: TinyPair) -> tuple[Responses, int, torch.Tensor]:
    """Every response, the number of prefixes (rows of the student's table) and ``[V]`` which ids it writes."""
    student = pair.student
    eos = student.eos_token_id
    vocab = student.get_vocab()
    writes = [vocab[_chars(t)] for t in pair.student_tokens]
    prefixes = [p for n in range(pair.max_tokens) for p in itertools.product(writes, repeat=n)]
    row = {p: k for k, p in enumerate(prefixes)}
    ids, stopped = [], []
    for n in range(pair.max_tokens + 1):
        for body in itertools.product(writes, repeat=n):
            if n < pair.max_tokens:
                ids.append([*body, eos])
                stopped.append(True)
            else:
                ids.append(list(body))
                stopped.append(False)
    width = pair.max_tokens + 1
    nodes = torch.zeros(len(ids), width, dtype=torch.int64)
    labels = torch.full((len(ids), width), eos, dtype=torch.int64)
    mask = torch.zeros(len(ids), width, dtype=torch.float64)
    for i, response in enumerate(ids):
        for k, token in enumerate(response):
            nodes[i, k] = row[tuple(response[:k])]
            labels[i, k] = token
            mask[i, k] = 1.0
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    allowed[writes + [eos]] = True
    return Responses(ids, stopped, nodes, labels, mask), len(prefixes), allowed


class TinyStudent:
    """A causal student given as its logits: one float64 row per prefix, ``-1e4`` at the ids it never writes."""

    def __init__(self, rows: int, allowed_V: torch.Tensor, seed: int = 0, scale: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.allowed_V = allowed_V
        self.table = (torch.randn(rows, allowed_V.numel(), generator=g, dtype=torch.float64) * scale).requires_grad_()

    def logits(self) -> torch.Tensor:
        """``[rows, V]`` (differentiable in :attr:`table`)."""
        return torch.where(self.allowed_V, self.table, _RULED_OUT)

    def token_logprobs(self, responses: Responses) -> torch.Tensor:
        """``[N, L]`` ``log q(y_t | y_<t)`` (0 past the end)."""
        logq = torch.log_softmax(self.logits(), -1)[responses.nodes_NL].gather(-1, responses.labels_NL[..., None])
        return logq[..., 0] * responses.mask_NL


@dataclass
class TeacherView:
    """What the reference knows of each response from the teacher: per response, its groups and their log-prob."""

    group_NL: torch.Tensor
    """Each response position's group index (within its response); -1 past the end."""
    group_logp: list[list[float]]
    """Per response, ``log p`` of each group (canonical tokens, the stop handled)."""
    canonical_logp: torch.Tensor
    """``[N]`` log P of the response as the code scores it (the groups' sum)."""
    boundary_logp: torch.Tensor
    """``[N]`` log of the sum over both boundary variants of the answer."""
    text_key: list[tuple[bytes, bool]]
    answer_key: list[tuple[bytes, bool]]


@dataclass
class Reference:
    """The enumerated pair: the student, the responses, the teacher's view of them."""

    pair: TinyPair
    responses: Responses
    student: TinyStudent
    teacher: ToyScorer
    view: TeacherView = field(init=False)

    def __post_init__(self):
        self.view = _teacher_view(self.pair, self.responses, self.teacher)

    @classmethod
    def build(cls, pair: TinyPair, student_seed: int = 0) -> Reference:
        responses, rows, allowed = enumerate_responses(pair)
        size = len(pair.teacher.get_vocab())
        teacher = ToyScorer(vocab=size, width=size, hidden=8, seed=pair.teacher_seed)
        return cls(pair, responses, TinyStudent(rows, allowed, seed=student_seed), teacher)

    def probabilities(self) -> torch.Tensor:
        """``[N]`` q of each response (differentiable); they sum to 1."""
        return self.student.token_logprobs(self.responses).sum(-1).exp()

    def sequence_divergence(self, kind: str, teacher: str = "boundary") -> torch.Tensor:
        """(a): the divergence between the student's and the teacher's distributions over texts (``teacher``:
        ``boundary`` sums both boundary variants of each answer, ``canonical`` scores the text as written;
        ``tokens``: over the student's token sequences instead of texts, the canonical teacher, as if each
        tokenization were a text of its own)."""
        if teacher == "tokens":
            keys = list(range(len(self.responses.ids)))
        else:
            keys = self.view.answer_key if teacher == "boundary" else self.view.text_key
        logp = self.view.boundary_logp if teacher == "boundary" else self.view.canonical_logp
        index, first = {}, []
        for i, key in enumerate(keys):
            if key not in index:
                index[key] = len(index)
                first.append(i)
        text_N = torch.tensor([index[k] for k in keys])
        q_X = torch.zeros(len(index), dtype=torch.float64).index_add(0, text_N, self.probabilities())
        logp_X = logp[first]
        if kind == "reverse_kl":
            return (q_X * (q_X.log() - logp_X)).sum()
        p_X = logp_X.exp()
        return (p_X * (logp_X - q_X.log()) - p_X + q_X).sum()

    def fixed_prefix(self, kind: str, ratio_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(b): its value and a surrogate whose gradient is its gradient (``ratio_clip``: forward KL's cap on
        ``p/q`` in the weight, as ``loss.sampled_ratio_clip``)."""
        logq_NL = self.student.token_logprobs(self.responses)
        q_N = logq_NL.detach().sum(-1).exp()
        value = torch.zeros((), dtype=torch.float64)
        weight_NL = torch.zeros_like(logq_NL)
        for i, logp_G in enumerate(self.view.group_logp):
            groups_L = self.view.group_NL[i]
            trained = groups_L >= 0
            logq_G = torch.zeros(len(logp_G), dtype=torch.float64).index_add(
                0, groups_L[trained], logq_NL.detach()[i, trained]
            )
            log_ratio_G = logq_G - torch.tensor(logp_G, dtype=torch.float64)
            if kind == "reverse_kl":
                d_G, w_G = log_ratio_G, log_ratio_G
            else:
                r_G = (-log_ratio_G).exp()
                d_G = r_G * -log_ratio_G - r_G + 1
                w_G = 1 - (r_G.clamp(max=ratio_clip) if ratio_clip else r_G)
            value = value + q_N[i] * d_G.sum()
            weight_NL[i, trained] = w_G[groups_L[trained]]
        return value, (q_N[:, None] * weight_NL * logq_NL).sum()

    def gradient(self, objective: torch.Tensor) -> torch.Tensor:
        """``d objective / d table`` (zero at the ids the student never writes)."""
        (grad,) = torch.autograd.grad(objective, self.student.table)
        return torch.where(self.student.allowed_V, grad, 0.0)


def _scored_texts(pair: TinyPair, scorer: ToyScorer, texts: list[tuple[bytes, bool]]):
    """Per (text, stopped): the teacher's canonical ids of the text, each answer token's log p (EOS last where it
    stopped) with the last text token scored as the prefix it is (the teacher's probability of any of its tokens
    that begin with those bytes) and EOS given the rest, or (cut) the last a prefix and nothing else; and the total.
    One batched scorer call."""
    teacher, teacher_bytes = pair.teacher, byte_table(pair.teacher)
    prompt = teacher(pair.prompt, add_special_tokens=True)["input_ids"]
    encoded = teacher([t.decode() for t, _ in texts], add_special_tokens=False)["input_ids"]
    sequences = [prompt + ids + [teacher.eos_token_id] * stop for ids, (_, stop) in zip(encoded, texts)]
    width = max(map(len, sequences))
    tokens_NS = torch.tensor([s + [0] * (width - len(s)) for s in sequences])  # causal: padding after is not read
    logp_NSV = scorer.logprobs(tokens_NS, pair.teacher_temperature)
    extends = {v: [u for u, b in enumerate(teacher_bytes) if b and b.startswith(teacher_bytes[v])]
               for v in range(len(teacher_bytes))}  # fmt: skip
    out = {}
    first = len(prompt) - 1
    for n, (ids, key) in enumerate(zip(encoded, texts)):
        answer = sequences[n][len(prompt) :]
        terms = [float(logp_NSV[n, first + j, token]) for j, token in enumerate(answer)]
        if ids:
            last = len(ids) - 1
            prefix = float(torch.logsumexp(logp_NSV[n, first + last, extends[ids[last]]], 0))
            if key[1]:
                terms[last + 1] += terms[last] - prefix
            terms[last] = prefix
        out[key] = (ids, terms, math.fsum(terms))
    return out


def _teacher_view(pair: TinyPair, responses: Responses, scorer: ToyScorer) -> TeacherView:
    student_bytes, teacher_bytes = byte_table(pair.student), byte_table(pair.teacher)
    texts, answers = [], []
    for ids, stop in zip(responses.ids, responses.stopped):
        text = b"".join(student_bytes[t] for t in ids)
        texts.append((text, stop))
        answers.append((text[1:] if text.startswith(b" ") else text, stop))
    variants = {(t, s) for a, s in answers for t in (a, b" " + a)}
    scored = _scored_texts(pair, scorer, sorted(set(texts) | variants))
    group_NL = torch.full(responses.nodes_NL.shape, -1, dtype=torch.int64)
    group_logp, canonical, boundary = [], [], []
    for i, (ids, stop) in enumerate(zip(responses.ids, responses.stopped)):
        body = ids[:-1] if stop else ids
        answer_ids, terms, total = scored[texts[i]]
        # Groups: cut at the byte offsets both sides end a token at; EOS is a group of its own.
        s_ends = list(itertools.accumulate(len(student_bytes[t]) for t in body))
        dummy = b"".join(teacher_bytes[t] for t in answer_ids) == b" " + texts[i][0]  # SentencePiece's prefix
        t_ends = [max(end - dummy, 0) for end in itertools.accumulate(len(teacher_bytes[t]) for t in answer_ids)]
        cuts = sorted(set(s_ends) & set(t_ends))
        logp_G = [0.0] * (len(cuts) + stop)
        for j, end in enumerate(t_ends):
            logp_G[next(g for g, c in enumerate(cuts) if end <= c)] += terms[j]
        for k, end in enumerate(s_ends):
            group_NL[i, k] = next(g for g, c in enumerate(cuts) if end <= c)
        if stop:
            logp_G[-1] = terms[-1]
            group_NL[i, len(body)] = len(cuts)
        group_logp.append(logp_G)
        canonical.append(total)
        answer, _ = answers[i]
        totals = torch.tensor([scored[t, stop][2] for t in (answer, b" " + answer)], dtype=torch.float64)
        boundary.append(float(torch.logsumexp(totals, 0)))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return TeacherView(group_NL, group_logp, as_tensor(canonical), as_tensor(boundary), texts, answers)


@dataclass
class CodePath:
    """The trainer's data path on every response at once: the batch and the teacher's scores mapped back to it."""

    ref: Reference
    mode: str
    batch: Any
    scores: Any

    @classmethod
    def run(cls, ref: Reference, mode: str, stop_prefix_ids: int = 16, response: str | None = None) -> CodePath:
        """Every response as one batch of rollouts, ``CrossTokenizer.request``, the teacher's scores of its own
        tokens (float32, as the wire carries them; its top-k all but its least likely token), ``CrossTokenizer.scores``.
        ``response``: the record's response (the student's template: a leading space there is the answer's)."""
        from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
        from megatron_opd.data.batch import pack_rollouts
        from megatron_opd.data.prompts import PromptEncoder
        from megatron_opd.interfaces import Rollouts

        pair, responses = ref.pair, ref.responses
        student, teacher = pair.student, pair.teacher
        record = {"prompt": pair.prompt} if response is None else {"prompt": pair.prompt, "response": response}
        prompt = PromptEncoder(student).prompt_ids(record, "reference")
        n = len(responses.ids)
        rollouts = Rollouts(
            prompt_ids=[torch.tensor(prompt)] * n,
            response_ids=[torch.tensor(r) for r in responses.ids],
            response_mask=[torch.ones(len(r)) for r in responses.ids],
            logprobs=[torch.zeros(len(r)) for r in responses.ids],
            finish_reasons=["stop" if s else "length" for s in responses.stopped],
            prompt_index=[0] * n,
        )
        batch = pack_rollouts(rollouts, pad_token_id=student.eos_token_id)
        if batch.prompt_lengths != [len(prompt)] * n:
            raise AssertionError("every response shares the prompt")
        cross = CrossTokenizer(student, teacher, PromptEncoder(teacher), (student.eos_token_id,), stop_prefix_ids,
                               topk=mode == "aligned")  # fmt: skip
        request = cross.request(batch, rollouts, [record])
        # The top-k one short of the vocabulary: the tail bucket holds a token of each side, not float32 rounding.
        k = len(teacher.get_vocab()) - 1
        teacher_scores = ref.teacher.score(request.tokens, request.request_ids, k, pair.teacher_temperature)
        return cls(ref, mode, batch, cross.scores(teacher_scores, request, batch))

    def objective(self, kind: str, ratio_clip: float = 0.0, credit: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
        """The expected reported divergence and the expected loss (its gradient: the expected gradient) of
        ``losses.sampled.sampled_divergence`` (``mode="sampled"``, ``credit`` as ``loss.sampled_credit``) or
        ``losses.aligned.aligned_divergence`` (``"aligned"``), each response's per-token values summed over its
        trained positions."""
        from megatron_opd.losses.aligned import aligned_divergence
        from megatron_opd.losses.sampled import label_logprobs, sampled_divergence

        ref, batch, scores = self.ref, self.batch, self.scores
        first, width = batch.prompt_lengths[0] - 1, ref.responses.nodes_NL.shape[1]
        nodes_NS = torch.zeros(batch.tokens.shape, dtype=torch.int64)
        nodes_NS[:, first : first + width] = ref.responses.nodes_NL
        logits_NSV = ref.student.logits()[nodes_NS]
        labels_NS = torch.cat([batch.tokens[:, 1:], batch.tokens[:, -1:]], 1)
        group_logp_NS, offset_NS = scores.requested_logprobs[..., 0], scores.extras["group_offset"]
        vocab = logits_NSV.shape[-1]
        if self.mode == "sampled":
            logq_NS = label_logprobs(logits_NSV, labels_NS, vocab_size=vocab)
            per_token_NS, divergence_NS = sampled_divergence(
                logq_NS, group_logp_NS, kind, offset_NS, ratio_clip=ratio_clip, credit=credit,
                loss_mask_T=batch.loss_mask,
            )  # fmt: skip
        else:
            per_token_NS, divergence_NS = aligned_divergence(
                logits_NSV, labels_NS, scores.extras["aligned_mask"], scores.topk_ids, scores.topk_logprobs,
                scores.extras["teacher_topk_support"], group_logp_NS, offset_NS, kind, vocab_size=vocab,
                sampled_ratio_clip=ratio_clip,
            )  # fmt: skip
        q_N = ref.probabilities().detach()
        mask_NS = batch.loss_mask.double()
        value = (q_N * (divergence_NS.double() * mask_NS).sum(-1)).sum()
        return value, (q_N * (per_token_NS.double() * mask_NS).sum(-1)).sum()


def gradient_variance(code: CodePath, kind: str, credit: str = "token") -> tuple[float, float]:
    """``(E_q |g_y - E g|^2, |E g|^2)`` of ``sampled``'s one-sample gradient ``g_y = sum_t w_t grad log q(y_t)``
    with respect to the student's table, exactly over the enumeration (a response's positions predict from distinct
    prefixes, distinct rows of the table: ``|g_y|^2 = sum_t w_t^2 |e_{y_t} - pi_t|^2``)."""
    from megatron_opd.losses.sampled import sampled_divergence

    ref, batch, scores = code.ref, code.batch, code.scores
    responses = ref.responses
    first, width = batch.prompt_lengths[0] - 1, responses.nodes_NL.shape[1]
    logq_NL = ref.student.token_logprobs(responses).detach()
    logq_NS = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    logq_NS[:, first : first + width] = logq_NL
    logq_NS.requires_grad_()
    surrogate_NS, _ = sampled_divergence(
        logq_NS, scores.requested_logprobs[..., 0].double(), kind, scores.extras["group_offset"], credit=credit,
        loss_mask_T=batch.loss_mask,
    )  # fmt: skip
    (weight_NS,) = torch.autograd.grad((surrogate_NS * batch.loss_mask).sum(), logq_NS)
    weight_NL = weight_NS[:, first : first + width] * responses.mask_NL
    pi_NLV = torch.softmax(ref.student.logits().detach(), -1)[responses.nodes_NL] * ref.student.allowed_V
    score_NLV = torch.nn.functional.one_hot(responses.labels_NL, pi_NLV.shape[-1]) * ref.student.allowed_V - pi_NLV
    q_N = logq_NL.sum(-1).exp()
    second_moment = (q_N * (weight_NL**2 * score_NLV.pow(2).sum(-1)).sum(-1)).sum()
    mean = torch.zeros_like(ref.student.table).index_add(
        0, responses.nodes_NL.reshape(-1), (q_N[:, None, None] * weight_NL[..., None] * score_NLV).flatten(0, 1)
    )
    mean_sq = float(mean.pow(2).sum())
    return float(second_moment) - mean_sq, mean_sq


def _relative(g: torch.Tensor, reference: torch.Tensor) -> float:
    return float((g - reference).norm() / reference.norm())


def _cosine(g: torch.Tensor, reference: torch.Tensor) -> float:
    return float((g * reference).sum() / (g.norm() * reference.norm()))


def gap_row(ref: Reference, sampled: CodePath, aligned: CodePath, kind: str) -> dict[str, float]:
    """The values of (a) (boundary sum, canonical), (b), ``sampled`` and ``aligned``, and how far each gradient is
    from the reference's: ``rel_*`` = ``|g - g_ref| / |g_ref|``, ``cos_*`` the cosine, ``err_sampled_b`` the largest
    difference from (b)'s gradient relative to its largest entry."""
    a_boundary = ref.sequence_divergence(kind, "boundary")
    a_canonical = ref.sequence_divergence(kind, "canonical")
    b_value, b_surrogate = ref.fixed_prefix(kind)
    s_value, s_surrogate = sampled.objective(kind)
    al_value, al_surrogate = aligned.objective(kind)
    g_a, g_can, g_b = ref.gradient(a_boundary), ref.gradient(a_canonical), ref.gradient(b_surrogate)
    g_tok = ref.gradient(ref.sequence_divergence(kind, "tokens"))
    g_s, g_al = ref.gradient(s_surrogate), ref.gradient(al_surrogate)
    return {
        "responses": float(len(ref.responses.ids)),
        "a_boundary": float(a_boundary.detach()),
        "a_canonical": float(a_canonical.detach()),
        "b": float(b_value),
        "sampled": float(s_value),
        "aligned": float(al_value),
        "err_sampled_b": float((g_s - g_b).abs().max() / g_b.abs().max()),
        "rel_b_a": _relative(g_b, g_a),
        "cos_b_a": _cosine(g_b, g_a),
        "rel_b_canonical": _relative(g_b, g_can),
        "cos_b_canonical": _cosine(g_b, g_can),
        "rel_b_tokens": _relative(g_b, g_tok),
        "cos_b_tokens": _cosine(g_b, g_tok),
        "rel_aligned_b": _relative(g_al, g_b),
        "cos_aligned_b": _cosine(g_al, g_b),
        "rel_aligned_a": _relative(g_al, g_a),
        "cos_aligned_a": _cosine(g_al, g_a),
    }


def main() -> None:
    """Print the gap table (docs/losses.md)."""
    names = ("responses", "a_boundary", "a_canonical", "b", "sampled", "aligned", "cos_b_tokens", "cos_b_canonical",
             "rel_b_a", "cos_b_a", "rel_aligned_b", "cos_aligned_b", "rel_aligned_a", "cos_aligned_a")  # fmt: skip
    print("| pair | kind | " + " | ".join(names) + " |")
    for name, pair in pair_matrix().items():
        ref = Reference.build(pair)
        sampled, aligned = CodePath.run(ref, "sampled"), CodePath.run(ref, "aligned")
        for kind in ("reverse_kl", "forward_kl"):
            row = gap_row(ref, sampled, aligned, kind)
            print(f"| {name} | {kind} | " + " | ".join(f"{row[k]:.3g}" for k in names) + " |")


if __name__ == "__main__":
    main()
