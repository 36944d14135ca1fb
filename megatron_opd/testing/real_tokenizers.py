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
