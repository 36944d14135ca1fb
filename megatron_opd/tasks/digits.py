"""Digit reversal: a synthetic task that tiny models learn in seconds on one CPU core (the quick start's task).

A record asks to reverse a string of 3 to 6 digits (leading zeros allowed)::

    {"prompt": "reverse 40912 =", "answer": "21904", "response": "21904"}

The tokenizer is byte-level BPE whose only merges spell the prompt's words, so every digit is a token of its own
and a prompt and its response tokenize the same joined or apart (the trainer appends EOS to ``response``).
``make_model`` writes randomly initialised Qwen3 checkpoints: a 0.66M-parameter ``teacher`` and a 0.12M-parameter
``student``. Measured in plain PyTorch on one CPU thread: the teacher reaches 99-100% held-out greedy accuracy
after 300 SFT steps (batch 64, lr 3e-3); on-policy distillation takes the student from 0% to 82-100%
(forward KL, 300 steps of 64 prompts).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
"""End of sequence, also the pad token (id 0)."""
PROMPT_TEMPLATE = "reverse {digits} ="
TASKS = {
    "reverse": ("reverse {digits} =", lambda d: d[::-1]),
    "sort": ("sort {digits} =", lambda d: "".join(sorted(d))),
}
"""Prompt template and answer of each task: digit reversal (the quick start's), and digit sorting (the second task of
``examples/quickstart.py --multi-teacher``; the tokenizer has no merges for its word, which it spells byte by byte)."""
MIN_DIGITS = 3
MAX_DIGITS = 6
VOCAB_SIZE = 272
"""The models' vocabulary: the tokenizer's 264 ids rounded up to a multiple of 16."""
DIGIT_MERGES = {
    "none": [],
    "pairs": [f"{a}{b}" for a in range(10) for b in range(10)],
    "doubles": [f"{a}{a}" for a in range(10)],
}
"""Other tokenizers for the same texts (``digit_merges``): a token for every pair of digits ("40"), or only for
the doubled digits ("00", "11", ...)."""
MERGES_VOCAB_SIZE = {"none": VOCAB_SIZE, "pairs": 368, "doubles": 288}
"""The models' vocabulary for each ``digit_merges``."""
HEAD_DIM = 32
"""vLLM's CPU attention needs a head dim of at least 32."""
MAX_POSITION_EMBEDDINGS = 64
"""A prompt is at most 9 tokens and a response (with EOS) at most 7."""
MODEL_SIZES: dict[str, dict[str, int]] = {
    "teacher": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    "student": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    ),
    "wide_student": dict(
        hidden_size=384, intermediate_size=768, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=4
    ),
}
"""Qwen3 shapes; head counts and FFN widths are even so that tensor parallelism 2 splits them. ``wide_student`` is the
LoRA quick start's base (``--lora``, 2.66M parameters): wide enough that rank-8 adapters on every projection are
2.9% of it (on ``student``, 14%), as on real models (Qwen3-8B: ~0.5%)."""


def make_records(
    n: int,
    seed: int,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    exclude: Iterable[str] = (),
    task: str = "reverse",
) -> list[dict]:
    """``n`` records with distinct digit strings, none in ``exclude`` (the prompts of another split), of ``task``.

    Lengths are uniform over ``[min_digits, max_digits]`` until a length runs out of unused strings.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    template, answer_of = TASKS[task]
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    lengths = range(min_digits, max_digits + 1)
    taken = {d for d in map(_digits_of, exclude) if len(d) in lengths}
    left = {k: 10**k - sum(1 for d in taken if len(d) == k) for k in lengths}
    if n > sum(left.values()):
        raise ValueError(f"only {sum(left.values())} unused strings of {min_digits}-{max_digits} digits are left")
    rng = random.Random(seed)
    records: list[dict] = []
    while len(records) < n:
        length = rng.choice([k for k in lengths if left[k] > 0])
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        if digits in taken:
            continue
        taken.add(digits)
        left[length] -= 1
        answer = answer_of(digits)
        records.append({"prompt": template.format(digits=digits), "answer": answer, "response": answer})
    return records


def _digits_of(prompt: str) -> str:
    """The digit string of a prompt (or the string itself when it is bare digits)."""
    return "".join(c for c in prompt if c.isdigit())


def score(prompt: str, response: str, record: dict) -> float:
    """1.0 iff ``response`` (cut at the first EOS, stripped) is the record's answer, else 0.0."""
    del prompt
    text = response.split(EOS_TOKEN, 1)[0].strip()
    return 1.0 if text == str(record["answer"]).strip() else 0.0


def make_tokenizer(out_dir: str | os.PathLike, digit_merges: str = "none") -> Path:
    """Save a 264-id byte-level BPE tokenizer (``PreTrainedTokenizerFast``) to ``out_dir``.

    Its merges come from the prompt's words only, so every digit stays a token of its own. EOS is
    ``<|endoftext|>`` (id 0), also the pad token. ``digit_merges`` (``DIGIT_MERGES``): also a token for each pair of
    digits ("40"), so digit strings tokenize about two digits a token, or for each doubled digit ("00").
    """
    if digit_merges not in DIGIT_MERGES:
        raise ValueError(f"digit_merges must be one of {sorted(DIGIT_MERGES)}, got {digit_merges!r}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MERGES_VOCAB_SIZE[digit_merges],
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = [PROMPT_TEMPLATE.format(digits="")] * 4
    tokenizer.train_from_iterator(words + DIGIT_MERGES[digit_merges], trainer=trainer)
    assert len(tokenizer.encode("0123456789").ids) == (5 if digit_merges == "pairs" else 10)
    assert tokenizer.get_vocab_size() <= MERGES_VOCAB_SIZE[digit_merges]
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def make_model(
    out_dir: str | os.PathLike, size: str, seed: int, digit_merges: str = "none", family: str | None = None
) -> Path:
    """Save a randomly initialised Qwen3 ``size`` model (a ``MODEL_SIZES`` name) and the tokenizer to ``out_dir``;
    ``family`` (a registered family's name) makes that family's model of the same sizes instead.

    The folder holds config.json, model.safetensors (fp32), generation_config.json (EOS id) and the tokenizer files.
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    if size not in MODEL_SIZES:
        raise ValueError(f"size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    out = make_tokenizer(out_dir, digit_merges)
    eos_id = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(EOS_TOKEN)
    fields = dict(
        vocab_size=MERGES_VOCAB_SIZE[digit_merges],
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=size != "teacher",  # like Qwen3-0.6B/1.7B: the students people distil into are tied
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **MODEL_SIZES[size],
    )
    if family is None:
        config = Qwen3Config(**fields)
    else:
        from transformers import AutoConfig

        from megatron_opd.models.families import family_named

        # Sliding-window layers (where the family has them) see 8 tokens: less than a prompt and its answer. Gated
        # DeltaNet layers (Qwen3.5, Qwen3-Next) get two key heads of HEAD_DIM, each with two value heads, and alternate
        # with attention layers. Per-layer input embeddings (Gemma 4) default to a 262,144 x 256 table (134M
        # parameters here): sized like the model's own vocabulary and 16 wide instead.
        config = AutoConfig.for_model(family_named(family).model_types[0], **fields, sliding_window=8,
                                      query_pre_attn_scalar=HEAD_DIM, sliding_window_pattern=2,
                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                                      full_attention_interval=2, vocab_size_per_layer_input=fields["vocab_size"],
                                      hidden_size_per_layer_input=16)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    return out
