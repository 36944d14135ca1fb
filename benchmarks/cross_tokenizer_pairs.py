"""Pairs like users' pairs for ``bench_cross_tokenizer.py`` (issue #51 item 3): the task folder of each.

``boundary``: the pair of issue #51's "Why", rebuilt. Digit sorting with spaced digits ("sort : 3 1 0 3 =" ->
"0 1 3 3"). The teacher's byte-level BPE is trained on whole prompt-and-answer texts with no word split, so its
merges cross spaces and the prompt/answer boundary (" 0 0", " = 0", "sort : 1"), yet it is fine-tuned with prompt and
answer tokenized apart, the answer with or without a leading space at random (``teacher_response``), as a chat
template's boundary makes it. The student's byte-level BPE is split at spaces, one token per word ("sort", " :",
" 3"), and its template is ``prompt + " " + answer + EOS`` (``response``). The control's teacher: the student's
tokenizer, fine-tuned on the same ``teacher_response``.

``llama3_mistral`` / ``mistral_llama3``: real vocabularies (Llama 3's tiktoken file, 128,256 ids, and Mistral's v3
SentencePiece, 32,768), tiny Qwen3 bodies, records as chats (``messages``) rendered by each tokenizer's own chat
template, so the boundary is each family's: Llama 3 "...<|end_header_id|>\\n\\n" + answer, Mistral "[/INST]" + " " +
answer. The task: reverse a list of 3-5 words from :data:`WORDS` ("reverse walnut ember canyon" -> "canyon ember
walnut"), words Llama 3 mostly writes as one token (" canyon") and Mistral as two or three ("▁can", "y", "on"); at
the boundary Llama 3's answer starts without a space ("c", "any", "on"), so the text a Mistral student writes after
its "[/INST] " re-tokenizes for the teacher as it never saw in fine-tuning. (Digits were tried first: Llama 3 writes
them three a token, which a teacher this small does not learn to sort in the CPU time a benchmark has.) The
control's teacher: the student's tokenizer.

``mistral_word``: Mistral's real SentencePiece teacher (its chat template, the answer after "[/INST]" with the
dummy prefix's space) and a byte-level student split at spaces with one token per word (" walnut"), template
``prompt + " " + answer + EOS`` (``response``; the teacher learns ``teacher_response``, the answer alone, as its
template's boundary writes it). The student's side is cheap, so this is the real-vocabulary pair a 2-core machine
runs fastest. ``llama3_mistral`` was measured on 2026-11-30 (its teacher's SFT 3.3-3.9 s a step: 25 minutes, one thread;
teacher and control teacher 100%, the student 27.3% after 120 warm-up steps); ``mistral_llama3`` is written but was
not measured.

Every pair writes ``teacher-init``, ``student-init``, ``teacher-word-init`` (the control's teacher, named as in
``--pair cross_space``), ``train.jsonl`` and ``eval.jsonl`` (no digit string in both).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SORT_PROMPT = "sort : {digits} ="
BOUNDARY_TEACHER_VOCAB = 320
"""The ``boundary`` teacher's BPE: 257 byte-level ids and EOS, the rest merges learnt on whole texts."""
REAL_SIZES = {
    "teacher": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2),
    "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2),
}  # fmt: skip
"""The word-reversal pairs' bodies: ``tasks.digits``' sizes (hidden 32 with one head learnt 12.5% in 400 SFT steps)."""
PAIRS = ("boundary", "mistral_word", "llama3_mistral", "mistral_llama3")
WORDS = ("apricot", "walnut", "lantern", "meadow", "pebble", "harbor", "violet", "canyon", "falcon", "ember")


def _spaced_sort_records(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    from megatron_opd.tasks import digits

    eval_records = digits.make_records(n_eval, seed=seed + 1, task="sort")
    train_records = digits.make_records(n_train, seed=seed + 2, exclude=[r["prompt"] for r in eval_records],
                                        task="sort")  # fmt: skip
    rng = random.Random(seed + 3)

    def spaced(records: list[dict]) -> list[dict]:
        out = []
        for r in records:
            digits_in = "".join(c for c in r["prompt"] if c.isdigit())
            answer = " ".join(r["answer"])
            out.append({"prompt": SORT_PROMPT.format(digits=" ".join(digits_in)), "answer": answer,
                        "response": " " + answer, "teacher_response": rng.choice(["", " "]) + answer})  # fmt: skip
        return out

    return spaced(train_records), spaced(eval_records)


def boundary_teacher_tokenizer(texts: list[str]):
    """A byte-level BPE trained on ``texts`` whole (no split at spaces): merges cross spaces and the boundary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_opd.testing.real_tokenizers import SYNTHETIC_EOS

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BOUNDARY_TEACHER_VOCAB, special_tokens=[SYNTHETIC_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SYNTHETIC_EOS, pad_token=SYNTHETIC_EOS)


def boundary_student_tokenizer():
    """Byte-level BPE split at spaces (GPT-2's pre-tokenizer): "sort", " :", " =", " 0" ... " 9", one a word."""
    from megatron_opd.testing.real_tokenizers import byte_level_tokenizer

    sort = [("s", "o"), ("so", "r"), ("sor", "t")]
    return byte_level_tokenizer(sort + [("Ġ", ":"), ("Ġ", "=")] + [("Ġ", str(d)) for d in range(10)], split_words=True)


def _save_model(folder: Path, vocab: int, size: dict, seed: int, tied: bool, ids: dict[str, int | list[int]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from megatron_opd.tasks import digits

    config = Qwen3Config(vocab_size=(vocab + 15) // 16 * 16, head_dim=digits.HEAD_DIM, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied, **ids, **size)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(folder, safe_serialization=True)


def make_boundary_task(out: Path, n_train: int = 8000, n_eval: int = 256, seed: int = 0) -> None:
    """Issue #51's pair (module docstring): tokenizers, initial models, and data with both response fields."""
    from megatron_opd.tasks import digits

    train, held_out = _spaced_sort_records(n_train, n_eval, seed)
    teacher_tok = boundary_teacher_tokenizer([r["prompt"] + " " + r["answer"] for r in train])
    student_tok = boundary_student_tokenizer()
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    for name, tok, size, s in (("teacher-init", teacher_tok, "teacher", seed), ("student-init", student_tok, "student",
                               seed + 1), ("teacher-word-init", student_tok, "teacher", seed)):  # fmt: skip
        tok.save_pretrained(out / name)
        _save_model(out / name, len(tok), digits.MODEL_SIZES[size], s, size == "student", ids)
    for name, records in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))


def make_real_task(out: Path, teacher: str, student: str, n_train: int = 8000, n_eval: int = 256, seed: int = 0):
    """A pair of real vocabularies (``llama3`` / ``mistral``): chats of the word-reversal task."""
    from megatron_opd.testing import real_tokenizers as rt
    from megatron_opd.tokenizer import load_tokenizer

    writers = {"llama3": rt.write_llama3_tokenizer, "mistral": rt.write_mistral_tokenizer}
    for name, kind, size, s in (("teacher-init", teacher, "teacher", seed), ("student-init", student, "student",
                                seed + 1), ("teacher-word-init", student, "teacher", seed)):  # fmt: skip
        folder = writers[kind](out / name)
        tok = load_tokenizer(folder)
        gen = json.loads((folder / "generation_config.json").read_text())
        ids = {"bos_token_id": gen["bos_token_id"], "eos_token_id": gen["eos_token_id"],
               "pad_token_id": tok.eos_token_id}  # fmt: skip
        _save_model(folder, len(tok), REAL_SIZES[size], s, size == "student", ids)
        (folder / "generation_config.json").write_text(json.dumps(gen))  # the family's own, not transformers'
    rng, seen, chats = random.Random(seed + 2), set(), []
    while len(chats) < n_train + n_eval:
        words = tuple(rng.choice(WORDS) for _ in range(rng.randint(3, 5)))
        if words not in seen:
            seen.add(words)
            answer = " ".join(reversed(words))
            chats.append({"messages": [{"role": "user", "content": "reverse " + " ".join(words)}], "answer": answer,
                          "response": answer})  # fmt: skip
    for name, records in (("train.jsonl", chats[n_eval:]), ("eval.jsonl", chats[:n_eval])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))


WORD_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The word-level student's chat: the user's text as is; its answers start with a space (``response``)."""


def word_student_tokenizer():
    """Byte-level BPE split at spaces with a token for "reverse" and each of :data:`WORDS`, with and without a space."""
    from megatron_opd.testing.real_tokenizers import byte_level_tokenizer

    merges = [(word[:i], word[i]) for word in ("reverse", *WORDS) for i in range(1, len(word))]
    merges += [("Ġ", word) for word in WORDS]
    tokenizer = byte_level_tokenizer(list(dict.fromkeys(merges)), split_words=True)
    tokenizer.chat_template = WORD_CHAT_TEMPLATE
    return tokenizer


def make_mistral_word_task(out: Path, n_train: int = 8000, n_eval: int = 256, seed: int = 0) -> None:
    """``mistral_word`` (module docstring)."""
    from megatron_opd.testing import real_tokenizers as rt
    from megatron_opd.tokenizer import load_tokenizer

    teacher = load_tokenizer(rt.write_mistral_tokenizer(out / "teacher-init"))
    student = word_student_tokenizer()
    for name, tok, size, s in (("teacher-init", teacher, "teacher", seed), ("student-init", student, "student",
                               seed + 1), ("teacher-word-init", student, "teacher", seed)):  # fmt: skip
        if name != "teacher-init":
            tok.save_pretrained(out / name)
        eos = tok.eos_token_id
        ids = {"bos_token_id": getattr(tok, "bos_token_id", None) or eos, "eos_token_id": eos, "pad_token_id": eos}
        _save_model(out / name, len(tok), REAL_SIZES[size], s, size == "student", ids)
    rng, seen, records = random.Random(seed + 2), set(), []
    while len(records) < n_train + n_eval:
        words = tuple(rng.choice(WORDS) for _ in range(rng.randint(3, 5)))
        if words not in seen:
            seen.add(words)
            answer = " ".join(reversed(words))
            records.append({"messages": [{"role": "user", "content": "reverse " + " ".join(words)}],
                            "answer": answer, "response": " " + answer, "teacher_response": answer})  # fmt: skip
    for name, part in (("train.jsonl", records[n_eval:]), ("eval.jsonl", records[:n_eval])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))


def make_pair_task(pair: str, out: Path) -> None:
    if pair == "boundary":
        make_boundary_task(out)
    elif pair == "mistral_word":
        make_mistral_word_task(out)
    else:
        teacher, student = pair.split("_")
        make_real_task(out, teacher, student)
