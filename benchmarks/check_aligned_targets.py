"""Is ``cross_tokenizer=aligned``'s target the teacher's exact next-word distribution? (issue #51, ``mistral_word``)

    python benchmarks/check_aligned_targets.py --workdir W --samples 40    # W: a bench_cross_tokenizer.py workdir

On a word-level student (one token a word) every group is one student token, so at each aligned row the exact
per-token target is the teacher's probability of each next word by the chain rule: the word's teacher tokens (as
the teacher tokenizes the response) scored one after another, EOS scored after the prefix. This samples responses
from the warmed-up student (``W/student-warmup/hf``, temperature 1), builds the rows the trainer builds
(``CrossTokenizer`` with the teacher's top-k, ``W/teacher/hf``) and compares them, over the task's words and EOS,
with that exact distribution; and, at the same positions, with the same-tokenizer control teacher
(``W/teacher-word/hf``). Positions are "on track" where the prefix is the right answer's first words.
Prints per track: the KL of the mapped target from the exact one, how often their argmax and the control's agree,
the student's reverse KL from each teacher (nats, over the words and EOS, renormalised), and how many of the
words fall outside the mapped top-k (the loss's tail bucket) with the student's and the teacher's mass on them.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_opd.cross_tokenizer.retokenize import CrossTokenizer
from megatron_opd.data.batch import pack_rollouts
from megatron_opd.data.prompts import PromptEncoder
from megatron_opd.interfaces import Rollouts, TeacherScores
from megatron_opd.tokenizer import load_tokenizer


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    """KL(a || b) of two log-probability vectors, each renormalised."""
    a, b = a.log_softmax(-1), b.log_softmax(-1)
    return float((a.exp() * (a - b)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--topk", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = args.workdir
    st, tt = load_tokenizer(work / "task" / "student-init"), load_tokenizer(work / "teacher" / "hf")
    load = lambda name: AutoModelForCausalLM.from_pretrained(work / name / "hf").eval()  # noqa: E731
    teacher, control, student = load("teacher"), load("teacher-word"), load("student-warmup")
    lines = (work / "task" / "train.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines[: args.samples]]
    words = sorted({w for line in lines for w in json.loads(line)["answer"].split()})
    word_ids = [st.convert_tokens_to_ids("Ġ" + w) for w in words] + [st.eos_token_id]  # byte-level BPE's space

    prompts = [PromptEncoder(st).prompt_ids(r, "check") for r in records]
    torch.manual_seed(0)
    beyond = list(range(len(st), student.config.vocab_size))  # padding rows of the embedding
    responses = [
        student.generate(torch.tensor([p]), do_sample=True, max_new_tokens=16, eos_token_id=st.eos_token_id,
                         pad_token_id=st.eos_token_id, suppress_tokens=beyond)[0, len(p):]
        for p in prompts
    ]  # fmt: skip
    n = len(records)
    rollouts = Rollouts(prompt_ids=[torch.tensor(p) for p in prompts], response_ids=responses,
                        response_mask=[torch.ones(len(r)) for r in responses],
                        logprobs=[torch.zeros(len(r)) for r in responses], finish_reasons=["stop"] * n,
                        prompt_index=list(range(n)))  # fmt: skip
    batch = pack_rollouts(rollouts, pad_token_id=st.eos_token_id)
    cross = CrossTokenizer(st, tt, PromptEncoder(tt), (st.eos_token_id,), 16, topk=True)
    request = cross.request(batch, rollouts, records)
    with torch.no_grad():
        logp = teacher(request.tokens).logits.log_softmax(-1)
        logq, logc = (m(batch.tokens).logits.log_softmax(-1) for m in (student, control))
    values, ids = logp.topk(args.topk, -1)
    scores = cross.scores(
        TeacherScores(topk_ids=ids, topk_logprobs=values.float(),
                      requested_logprobs=logp.gather(-1, request.request_ids).float()),
        request, batch,
    )  # fmt: skip
    support = scores.extras["teacher_topk_support"]

    def exact(i: int, prefix: list[str]) -> torch.Tensor:
        """The teacher's log-probability of each word (then EOS) after ``prefix``, by the chain rule."""
        prompt = request.tokens[i, : request.teacher_prompt_lengths[i]].tolist()
        start = len(prompt) + (len(tt(" ".join(prefix), add_special_tokens=False)["input_ids"]) if prefix else 0)
        seqs = [prompt + tt(" ".join([*prefix, w]), add_special_tokens=False)["input_ids"] for w in words]
        seqs.append(prompt + (tt(" ".join(prefix), add_special_tokens=False)["input_ids"] if prefix else [])
                    + [tt.eos_token_id])  # fmt: skip
        width = max(map(len, seqs))
        with torch.no_grad():
            lp = teacher(torch.tensor([s + [0] * (width - len(s)) for s in seqs])).logits.log_softmax(-1)
        return torch.tensor([sum(float(lp[j, t - 1, s[t]]) for t in range(start, len(s))) for j, s in enumerate(seqs)])

    counts, sums = collections.Counter(), collections.defaultdict(float)
    for i in range(n):
        said = [
            st.convert_ids_to_tokens(int(t))[1:] for t in batch.tokens[i, batch.prompt_lengths[i] : batch.lengths[i]]
        ]
        answer = records[i]["answer"].split()
        for k, pos in enumerate(range(batch.prompt_lengths[i] - 1, batch.lengths[i] - 1)):
            if not scores.extras["aligned_mask"][i, pos]:
                counts["sampled rows"] += 1
                continue
            track = "on track" if said[:k] == answer[:k] else "off track"
            mapped = torch.full((len(word_ids),), -torch.inf)
            for a, v, s in zip(scores.topk_ids[i, pos].tolist(), scores.topk_logprobs[i, pos], support[i, pos]):
                if s and a in word_ids:
                    mapped[word_ids.index(a)] = torch.logaddexp(mapped[word_ids.index(a)], v)
            outside = torch.isinf(mapped)  # words in the loss's tail bucket here
            mapped = mapped.clamp(min=-60.0)
            ref, ctl, q = exact(i, said[:k]), logc[i, pos, word_ids], logq[i, pos, word_ids]
            counts[track] += 1
            counts[track, "argmax mapped = exact"] += int(mapped.argmax() == ref.argmax())
            counts[track, "argmax mapped = control's"] += int(mapped.argmax() == ctl.argmax())
            sums[track, "KL(mapped || exact)"] += kl(mapped, ref)
            sums[track, "teacher's top-1 probability (exact)"] += float(ref.softmax(-1).max())
            sums[track, "control's top-1 probability"] += float(ctl.softmax(-1).max())
            sums[track, "student's reverse KL from the mapped target"] += kl(q, mapped)
            sums[track, "student's reverse KL from the control"] += kl(q, ctl)
            sums[track, "words and EOS outside the mapped top-k"] += float(outside.sum())
            sums[track, "student's mass on them"] += float(q.exp()[outside].sum())
            sums[track, "the teacher's exact mass on them"] += float(ref.softmax(-1)[outside].sum())
    print(f"{n} samples; {dict((k, v) for k, v in counts.items() if isinstance(k, str))}")
    for track in ("on track", "off track"):
        for key, v in counts.items():
            if isinstance(key, tuple) and key[0] == track:
                print(f"{track}: {key[1]}: {v}/{counts[track]}")
        for (t, name), v in sums.items():
            if t == track:
                print(f"{track}: {name}: {v / max(counts[track], 1):.3g}")


if __name__ == "__main__":
    main()
