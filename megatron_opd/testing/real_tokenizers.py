"""Model folders whose tokenizer is a real ``tokenizer.model`` shipped inside a PyPI package (nothing downloaded).

``mistral_common`` ships Mistral's SentencePiece models (32,768 tokens) and ``llama-models`` ships Llama 3's
tiktoken file (128,000 tokens + 256 special tokens). Each folder gets only ``tokenizer.model``, a
``tokenizer_config.json`` as the model families publish them (special tokens, chat template) and a
``generation_config.json``; tests that need the packages skip without them.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + '[/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)
"""Mistral's instruct format, written the way Mistral's own transformers templates write it."""

LLAMA3_CHAT_TEMPLATE = (
    "{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
    "m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""Meta-Llama-3-Instruct's template: it writes the BOS itself."""

LLAMA3_STOP_IDS = (128001, 128008, 128009)
"""``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``: Llama 3.1's generation_config.json ``eos_token_id``."""


def mistral_sentencepiece_model(version: str = "v3") -> Path:
    """Path of the SentencePiece model of Mistral's tokenizer ``version`` (v1: 32,000 tokens; v2, v3: 32,768)."""
    import mistral_common

    names = {
        "v1": "tokenizer.model.v1",
        "v2": "mistral_instruct_tokenizer_240216.model.v2",
        "v3": "mistral_instruct_tokenizer_240323.model.v3",
    }
    return Path(mistral_common.__file__).parent / "data" / names[version]


def llama3_tiktoken_model() -> Path:
    """Path of Llama 3's tiktoken BPE file (``tokenizer.model``) inside ``llama-models``."""
    import llama_models

    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


def llama3_special_tokens() -> dict[int, str]:
    """Llama 3's 256 special tokens by id, as ``llama-models`` defines them (the file itself has none)."""
    from llama_models.llama3.tokenizer import Tokenizer

    return {i: token for token, i in Tokenizer(llama3_tiktoken_model()).special_tokens.items()}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_mistral_tokenizer(out_dir: str | os.PathLike, version: str = "v3") -> Path:
    """A folder holding only Mistral's ``tokenizer.model`` and its config files."""
    return write_sentencepiece_tokenizer(out_dir, mistral_sentencepiece_model(version).read_bytes())


def write_sentencepiece_tokenizer(out_dir: str | os.PathLike, model: bytes) -> Path:
    """A folder holding only the SentencePiece ``model`` as ``tokenizer.model`` and Mistral-style config files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model)
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "chat_template": MISTRAL_CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    return out


def write_llama3_tokenizer(out_dir: str | os.PathLike) -> Path:
    """A folder holding only Llama 3's tiktoken ``tokenizer.model`` and its config files (Llama 3.1's stop ids)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(llama3_tiktoken_model(), out / "tokenizer.model")
    added = {
        str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, token in sorted(llama3_special_tokens().items())
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "added_tokens_decoder": added,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": 128000, "eos_token_id": list(LLAMA3_STOP_IDS)})
    return out


def train_sentencepiece(corpus: list[str], vocab_size: int, **options: object) -> bytes:
    """A BPE SentencePiece model trained by ``sentencepiece`` itself, Llama-style (identity, byte fallback)."""
    import sentencepiece

    settings: dict[str, object] = dict(
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=True,
        minloglevel=2,
    )
    settings.update(options)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, **settings
    )
    return model.getvalue()


TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "byte_level")
"""Mistral's SentencePiece, Llama 3's tiktoken, a tiny byte-level BPE (``tiny_models.make_tiny_tokenizer``)."""

TOKENIZER_PAIRS = tuple((a, b) for a in TOKENIZER_KINDS for b in TOKENIZER_KINDS if a != b)
"""Every ordered (student, teacher) pair of two kinds."""


def tokenizers_of_every_kind(root: str | os.PathLike) -> dict[str, tuple[object, tuple[int, ...]]]:
    """Each kind's loaded tokenizer and stop ids, written under ``root``; the real ones are missing without
    ``mistral_common`` / ``llama-models`` (and ``sentencepiece``)."""
    from megatron_opd.testing.tiny_models import make_tiny_tokenizer
    from megatron_opd.tokenizer import load_tokenizer

    root = Path(root)
    tiny = load_tokenizer(make_tiny_tokenizer(root / "byte_level"))
    found = {"byte_level": (tiny, (tiny.eos_token_id,))}
    try:
        mistral = load_tokenizer(write_mistral_tokenizer(root / "sentencepiece"))
        found["sentencepiece"] = (mistral, (mistral.eos_token_id,))
        found["tiktoken"] = (load_tokenizer(write_llama3_tokenizer(root / "tiktoken")), LLAMA3_STOP_IDS)
    except ImportError:
        pass
    return found


# ---- synthetic pairs that stress alignment (issue #41) ------------------------------------------------------------

SYNTHETIC_EOS = "<|endoftext|>"
"""Every synthetic tokenizer's EOS and pad token (id 0)."""

SPACED_PAIRS = tuple(sorted(random.Random(41).sample([(a, b) for a in range(10) for b in range(10)], 40)))
"""The 40 ordered digit pairs ``a b`` the ``cross_space`` teacher writes as one token (a seeded draw): about a
quarter of its tokens on spaced digit answers have no student twin."""

SYNTHETIC_KINDS = ("word", "char", "cross_space", "cross_digit", "byte_fallback")
"""Synthetic tokenizers, each built locally in a second:

- ``word``: byte-level BPE split into words first (GPT-2's pre-tokenizer): one token per digit with its space (" 5"),
  "reverse", " =" (274 ids).
- ``char``: byte-level with no merges at all, one token per byte (257 ids): a character-level tokenizer.
- ``cross_space``: byte-level BPE over the whole text (no word split), so merges cross spaces: ``word``'s tokens plus
  one token for each pair of :data:`SPACED_PAIRS` ("5 1", " 5 1": 354 ids).
- ``cross_digit``: ``word``'s tokens plus one for each of the same pairs written without a space ("51", " 51").
- ``byte_fallback``: a SentencePiece BPE (``sentencepiece`` itself, byte fallback, a dummy prefix) trained on digit
  texts.
"""

SYNTHETIC_PAIRS = (
    ("word", "cross_space"),
    ("char", "cross_space"),
    ("word", "cross_digit"),
    ("byte_fallback", "cross_space"),
    ("word", "char"),
)
"""(student, teacher) pairs of the matrix: merges across spaces (the pair of issue #41), a character-level student,
merges across digits, a SentencePiece student with byte fallback, a character-level teacher (every teacher token a
prefix of a student token)."""

_RNG = random.Random(7)
MATRIX_TEXT = "\n".join(" ".join(_RNG.choices("0123456789", k=_RNG.randint(3, 6))) for _ in range(200)) + (
    "\nreverse 409 12 = 21 904\nthe sum 51 + 15 = 66\n"
)
"""The fixed text the map statistics are weighted on: 200 spaced digit answers of 3-6 digits (the spaced task's
responses), a few unspaced digits and words."""


def byte_level_tokenizer(
    merges: list[tuple[str, str]], split_words: bool, alphabet: str | None = None, eos: str = SYNTHETIC_EOS
):
    """A byte-level BPE ``PreTrainedTokenizerFast`` from explicit merges (strings in the byte-level alphabet): ``eos``
    (id 0), the byte-level characters of ``alphabet`` (default: all 256 bytes), then one token per merge.
    ``split_words``: GPT-2's word split first (no merge crosses a space); else merges may cross spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_opd.tokenizer import bytes_to_unicode

    vocab = {eos: 0}
    for char in bytes_to_unicode().values() if alphabet is None else alphabet:
        vocab.setdefault(char, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([eos])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=eos)


def _word_merges() -> list[tuple[str, str]]:
    """ "reverse", " =" and " 0" ... " 9" (Ġ is the byte-level space)."""
    reverse = [("r", "e"), ("re", "v"), ("rev", "e"), ("reve", "r"), ("rever", "s"), ("revers", "e")]
    return reverse + [("Ġ", "=")] + [("Ġ", str(d)) for d in range(10)]


def synthetic_tokenizer(kind: str):
    """The synthetic tokenizer ``kind`` (:data:`SYNTHETIC_KINDS`), loaded (not saved)."""
    if kind == "word":
        return byte_level_tokenizer(_word_merges(), split_words=True)
    if kind == "char":
        return byte_level_tokenizer([], split_words=True)
    if kind == "cross_space":
        pairs = [(f"Ġ{a}", f"Ġ{b}") for a, b in SPACED_PAIRS] + [(f"{a}", f"Ġ{b}") for a, b in SPACED_PAIRS]
        return byte_level_tokenizer(_word_merges() + pairs, split_words=False)
    if kind == "cross_digit":
        pairs = [(f"{a}", f"{b}") for a, b in SPACED_PAIRS] + [(f"Ġ{a}", f"{b}") for a, b in SPACED_PAIRS]
        return byte_level_tokenizer(_word_merges() + pairs, split_words=True)
    if kind == "byte_fallback":
        import tempfile

        from megatron_opd.tokenizer import load_tokenizer

        corpus = [MATRIX_TEXT] + [" ".join(str((7 * i + j) % 10) for j in range(i % 7 + 2)) for i in range(200)]
        model = train_sentencepiece(corpus, vocab_size=300)
        with tempfile.TemporaryDirectory() as tmp:
            return load_tokenizer(write_sentencepiece_tokenizer(tmp, model))
    raise ValueError(f"synthetic tokenizer kind must be one of {SYNTHETIC_KINDS}, got {kind!r}")


def write_synthetic_tokenizer(out_dir: str | os.PathLike, kind: str) -> Path:
    """:func:`synthetic_tokenizer` saved as a Hugging Face folder (``tokenizer.json`` and its config)."""
    out = Path(out_dir)
    synthetic_tokenizer(kind).save_pretrained(out)
    return out
