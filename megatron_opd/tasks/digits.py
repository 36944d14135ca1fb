"""Digit reversal: a synthetic task that a tiny model learns in about a minute on one CPU core.

A record asks to reverse a string of 3 to 6 digits (leading zeros allowed)::

    {"prompt": "reverse 40912 =", "answer": "21904", "response": "21904"}

The tokenizer is byte-level BPE whose only merges spell the prompt's words, so every digit is one token and
the prompt and response tokenize the same whether joined or apart. The trainer appends EOS to ``response``.
``make_model`` writes randomly initialised Qwen3 checkpoints: a ``teacher`` and a smaller ``student``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PROMPT_TEMPLATE = "reverse {digits} ="
MIN_DIGITS = 3
MAX_DIGITS = 6
MAX_POSITION_EMBEDDINGS = 64

# Qwen3 shapes. Tensor parallelism 2 needs even head counts and FFN width; vLLM's CPU attention needs head_dim >= 32.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "teacher": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    "student": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    ),
}
HEAD_DIM = 32
VOCAB_SIZE = 272
"""Model vocabulary: the tokenizer's ~265 ids rounded up to a multiple of 16."""


def _reverse(digits: str) -> str:
    return digits[::-1]


def make_records(
    n: int,
    seed: int,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    exclude: Iterable[str] = (),
) -> list[dict]:
    """``n`` records whose digit strings are distinct and not in ``exclude`` (prompts of another split).

    The length is uniform over ``[min_digits, max_digits]``; a length whose strings run out is skipped.
    """
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    capacity = sum(10**k for k in range(min_digits, max_digits + 1))
    taken = {_digits_of(p) for p in exclude}
    if n > capacity - len(taken):
        raise ValueError(f"only {capacity - len(taken)} distinct strings of {min_digits}-{max_digits} digits are left")
    rng = random.Random(seed)
    records: list[dict] = []
    while len(records) < n:
        length = rng.randint(min_digits, max_digits)
        if sum(1 for s in taken if len(s) == length) >= 10**length:
            continue
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        if digits in taken:
            continue
        taken.add(digits)
        answer = _reverse(digits)
        records.append({"prompt": PROMPT_TEMPLATE.format(digits=digits), "answer": answer, "response": answer})
    return records


def _digits_of(prompt: str) -> str:
    """The digit string of a prompt (or the string itself when it is bare digits)."""
    return "".join(c for c in prompt if c.isdigit())


def score(prompt: str, response: str, record: dict) -> float:
    """1.0 iff ``response`` (cut at the first EOS, stripped) is the record's answer, else 0.0."""
    del prompt
    text = response.split(EOS_TOKEN, 1)[0].strip()
    return 1.0 if text == str(record["answer"]).strip() else 0.0


def make_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Save a ~265-id byte-level BPE tokenizer (``PreTrainedTokenizerFast``) to ``out_dir``.

    Its merges come from the prompt's words only, so every digit stays a token of its own. EOS is
    ``<|endoftext|>`` (id 0), also the pad token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([PROMPT_TEMPLATE.format(digits="")] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def make_model(out_dir: str | os.PathLike, size: str, seed: int) -> Path:
    """Save a randomly initialised Qwen3 ``size`` model ("teacher" or "student") with its tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    if size not in MODEL_SIZES:
        raise ValueError(f"size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    out = Path(out_dir)
    make_tokenizer(out)
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(out).eos_token_id
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **MODEL_SIZES[size],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    return out
