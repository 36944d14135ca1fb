"""Load a model folder's tokenizer whatever files it ships, tokenizing exactly as the library that made it.

Hugging Face folders usually ship ``tokenizer.json``. Original and older checkpoints ship only ``tokenizer.model``:
a SentencePiece model (Llama 2, Mistral and many others) or a tiktoken BPE file (Llama 3 ships one under that
name). transformers converts either on the fly, but its SentencePiece conversion ranks merges by id instead of by
score and drops SentencePiece's dummy prefix before a leading space, so texts with leading or repeated spaces
(indented code) get ids the model never saw; a tiktoken file gets no BOS at all.

Here a ``tokenizer.model`` is converted into a ``tokenizer.json`` that reproduces ``sentencepiece`` / ``tiktoken``
(checked against them on probe texts at every conversion), and ``tools/checkpoint`` writes that file into
``hf_config/`` and exports, so the trainer, transformers and vLLM tokenize a prompt identically. A tiktoken file
holds no special tokens: they come from ``tokenizer_config.json``'s ``added_tokens_decoder``, and its split
pattern is taken to be Llama 3's (the file does not record one).

One deliberate difference from sentencepiece, shared with transformers: the dummy prefix ("▁") goes only before
a text that does not already start with a space, and never after a special token. Chat templates written for
transformers rely on it (``'[INST] ' + content`` encodes as mistral_common encodes the turn).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from megatron_opd.model_files import TokenizerError

logger = logging.getLogger(__name__)

TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SIDE_FILES = ("special_tokens_map.json", "chat_template.jinja", "chat_template.json", "added_tokens.json")
"""Tokenizer files other than the model and its config that travel with a converted tokenizer."""
_SLOW_ONLY_KEYS = ("legacy", "add_prefix_space", "sp_model_kwargs", "vocab_file", "merges_file", "tokenizer_file")
"""tokenizer_config.json keys that configure transformers' own conversion, which the tokenizer.json replaces."""

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
"""The pre-tokenizer split of Llama 3's tiktoken file (and of transformers' tiktoken conversion)."""

PROBE_TEXTS = (
    "Hello world",
    "one space, then  two and   three spaces",
    "code:\n    return f(x)  # comment\n\tand a tab",
    "digits 1234567890 and 3.14159, done.",
    "naïve café, 日本語, Ελληνικά, emoji 🙂!",
    "trailing spaces   ",
    "lines\n\nand\r\nbreaks",
)
"""Texts a converted tokenizer must split exactly as sentencepiece / tiktoken do (no special-token strings).

None starts with a space: there the conversion follows transformers, not sentencepiece (see the module docstring).
"""

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")

# SentencePiece piece types (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

TokenizerModelFormat = Literal["sentencepiece", "tiktoken"]


def tokenizer_model_format(path: str | os.PathLike) -> TokenizerModelFormat:
    """Whether ``path`` (a ``tokenizer.model``) is a SentencePiece model or a tiktoken BPE file."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4096)
    first_line = head.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first_line):
        return "tiktoken"
    try:
        proto = _sentencepiece_proto(path)
    except Exception:  # noqa: BLE001 - any parse failure means "not SentencePiece", reported below
        proto = None
    if proto is not None and len(proto.pieces) > 0:
        return "sentencepiece"
    raise TokenizerError(
        f"{path}: neither a SentencePiece model nor a tiktoken BPE file (lines of 'base64-token rank'); it starts "
        f"with {head[:40]!r}. Replace it with the model's own tokenizer.model, or add the model's tokenizer.json"
    )


def _sentencepiece_proto(path: Path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: malformed JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _merges_by_priority(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every merge ``(a, b)`` whose result ``a+b`` can be merged, best result first.

    SentencePiece's BPE and tiktoken both merge, at each step, the adjacent pair whose concatenation has the best
    score (SentencePiece) or lowest rank (tiktoken); HF BPE merges the pair listed first, so listing every split
    of every piece in that order reproduces them.
    """
    merges = []
    for piece, key in priority.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((key, vocab[piece], i, left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _bos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    from tokenizers import processors

    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    specials = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))


def _sentencepiece_tokenizer(path: Path, config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` equal to ``sentencepiece`` on ``path``, and the config entries it implies."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = _sentencepiece_proto(path)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    unk = pieces[trainer.unk_id].piece if 0 <= trainer.unk_id < len(pieces) else None
    if trainer.model_type == 1:  # UNIGRAM
        model = models.Unigram(
            [(p.piece, p.score) for p in pieces],
            unk_id=trainer.unk_id if unk is not None else None,
            byte_fallback=trainer.byte_fallback,
        )
    elif trainer.model_type == 2:  # BPE
        normal = {p.piece: -p.score for p in pieces if p.type == _NORMAL}
        model = models.BPE(
            vocab=vocab,
            merges=_merges_by_priority(vocab, normal),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    else:
        raise TokenizerError(
            f"{path}: SentencePiece model type {trainer.model_type} (word/char) is not supported, only BPE and "
            "unigram; add the model's tokenizer.json"
        )
    tokenizer = Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        # Stripped text never starts with a space, so every piece of text gets the dummy prefix (as T5-style
        # tokenizers do in transformers).
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
        steps += [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
        steps.append(normalizers.Replace(" ", "▁"))
    else:
        # Llama / Mistral style: like transformers, only the start of the text gets the dummy prefix, not the text
        # after a special token (chat templates written for transformers expect that).
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if norm.add_dummy_prefix else "never", split=False
        )
    tokenizer.normalizer = normalizers.Sequence(steps) if steps else None
    decode = [decoders.Replace("▁", " ")] + ([decoders.ByteFallback()] if trainer.byte_fallback else [])
    decode.append(decoders.Fuse())  # one string, so the Strip below removes only the text's dummy prefix
    if norm.add_dummy_prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(decode)
    # Control pieces (<s>, </s>, [INST], ...) are never produced from text by SentencePiece; as special tokens they
    # are still recognised in chat templates, as transformers and vLLM do. User-defined pieces match in any text.
    tokenizer.add_special_tokens(
        [AddedToken(p.piece, special=True, normalized=False) for p in pieces if p.type in (_CONTROL, _UNKNOWN)]
    )
    tokenizer.add_tokens(
        [AddedToken(p.piece, special=False, normalized=False) for p in pieces if p.type == _USER_DEFINED]
    )

    def piece(i: int) -> str | None:
        return pieces[i].piece if 0 <= i < len(pieces) else None

    entries = {
        "bos_token": _token_content(config.get("bos_token")) or piece(trainer.bos_id),
        "eos_token": _token_content(config.get("eos_token")) or piece(trainer.eos_id),
        "unk_token": _token_content(config.get("unk_token")) or unk,
    }
    pad = _token_content(config.get("pad_token")) or piece(trainer.pad_id)
    if pad is not None:
        entries["pad_token"] = pad
    return tokenizer, entries


def _tiktoken_tokenizer(path: Path, config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A byte-level ``tokenizers.Tokenizer`` equal to ``tiktoken`` on ``path`` plus the config's special tokens."""
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = load_tiktoken_bpe(str(path))
    byte_to_char = bytes_to_unicode()
    vocab = {"".join(byte_to_char[b] for b in token): rank for token, rank in ranks.items()}
    if len(set(vocab.values())) != len(vocab) or max(vocab.values()) != len(vocab) - 1:
        raise TokenizerError(f"{path}: the tiktoken ranks are not the ids 0..{len(vocab) - 1} without gaps")
    decoder = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
    special = {i: _token_content(t) for i, t in decoder.items() if i >= len(vocab)}
    where = f"{path.parent / TOKENIZER_CONFIG}"
    if not special:
        raise TokenizerError(
            f"{path} is a tiktoken file, which holds no special tokens (BOS, EOS, chat tokens), and {where} lists "
            f"none above its {len(vocab)} tokens; add them with their ids to its added_tokens_decoder"
        )
    missing = [i for i in range(len(vocab), max(special) + 1) if i not in special]
    if missing:
        raise TokenizerError(
            f"{where}: added_tokens_decoder skips ids {missing[0]}..{missing[-1]} between the {len(vocab)} tokens of "
            f"{path.name} and its highest added id {max(special)}; list every id so ids mean the same everywhere"
        )
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=_merges_by_priority(vocab, vocab), fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # In id order, so each gets the id the config gives it; "special" as the config says (Llama 3: all of them).
    tokenizer.add_tokens(
        [
            AddedToken(special[i], special=not isinstance(decoder[i], dict) or decoder[i].get("special", True),
                       normalized=False)
            for i in sorted(special)
        ]
    )  # fmt: skip
    entries = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return tokenizer, {k: v for k, v in entries.items() if v is not None}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies (and tiktoken's HF form) use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def needs_conversion(folder: str | os.PathLike) -> bool:
    """True when ``folder``'s tokenizer is a ``tokenizer.model`` without a ``tokenizer.json`` beside it."""
    folder = Path(folder)
    return (folder / TOKENIZER_MODEL).is_file() and not (folder / TOKENIZER_JSON).is_file()


def write_converted_tokenizer(folder: str | os.PathLike, dest: str | os.PathLike) -> TokenizerModelFormat:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` converted from ``folder``'s ``tokenizer.model`` to ``dest``.

    The config keeps every entry of the original (chat template, special tokens, added tokens) but names
    ``PreTrainedTokenizerFast``, so transformers and vLLM take the tokenizer.json as written. The conversion is
    checked against sentencepiece / tiktoken on :data:`PROBE_TEXTS` before anything is written.
    """
    folder, dest = Path(folder), Path(dest)
    model_file = folder / TOKENIZER_MODEL
    fmt = tokenizer_model_format(model_file)
    config = _read_config(folder)
    build = _sentencepiece_tokenizer if fmt == "sentencepiece" else _tiktoken_tokenizer
    tokenizer, entries = build(model_file, config)
    add_bos = bool(config.get("add_bos_token", entries.get("bos_token") is not None))
    add_eos = bool(config.get("add_eos_token", False))
    for flag, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag and entries.get(name) is None:
            raise TokenizerError(
                f"{folder / TOKENIZER_CONFIG}: add_{name} is set but no {name} is named; name one or set add_{name} "
                "to false"
            )
    for name, token in entries.items():  # transformers would silently append a missing one as a new id
        if tokenizer.token_to_id(token) is None:
            raise TokenizerError(
                f"{folder / TOKENIZER_CONFIG}: {name} {token!r} is not a token of {model_file}; name a token of its "
                "vocabulary (a tiktoken file's special tokens come from added_tokens_decoder)"
            )
    bos = (entries["bos_token"], tokenizer.token_to_id(entries["bos_token"])) if add_bos else None
    eos = (entries["eos_token"], tokenizer.token_to_id(entries["eos_token"])) if add_eos else None
    if bos or eos:
        tokenizer.post_processor = _bos_processor(bos, eos)
    _check_against_reference(tokenizer, model_file, fmt, bos[1] if bos else None, eos[1] if eos else None)

    new_config = {k: v for k, v in config.items() if k not in _SLOW_ONLY_KEYS}
    new_config.update(entries)
    new_config.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=add_bos, add_eos_token=add_eos)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dest / TOKENIZER_JSON))
    (dest / TOKENIZER_CONFIG).write_text(json.dumps(new_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return fmt


def _reference_encoder(model_file: Path, fmt: TokenizerModelFormat) -> Callable[[str], list[int]]:
    if fmt == "sentencepiece":
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        return lambda text: list(processor.encode(text))
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    encoding = tiktoken.Encoding(
        name=model_file.name,
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(model_file)),
        special_tokens={},
    )
    return lambda text: list(encoding.encode(text, disallowed_special=()))


def _first_difference(
    encode: Callable[[str], list[int]],
    model_file: Path,
    fmt: TokenizerModelFormat,
    prefix: list[int],
    suffix: list[int],
) -> str | None:
    """How ``encode`` first disagrees with the reference library on :data:`PROBE_TEXTS` (None: never)."""
    reference = _reference_encoder(model_file, fmt)
    for text in PROBE_TEXTS:
        got, expected = encode(text), prefix + reference(text) + suffix
        if got != expected:
            return f"splits {text!r} into {got} but {fmt} gives {expected}"
    return None


def _check_against_reference(
    tokenizer: Any, model_file: Path, fmt: TokenizerModelFormat, bos_id: int | None, eos_id: int | None
) -> None:
    prefix, suffix = [bos_id] if bos_id is not None else [], [eos_id] if eos_id is not None else []
    difference = _first_difference(lambda text: tokenizer.encode(text).ids, model_file, fmt, prefix, suffix)
    if difference is not None:
        raise TokenizerError(
            f"{model_file}: the converted tokenizer {difference}; this tokenizer.model cannot be reproduced here: "
            "add the model's tokenizer.json beside it"
        )


def _warn_if_json_differs(tokenizer: Any, folder: Path) -> None:
    """A folder with both files: say so when its tokenizer.json does not split text as its tokenizer.model does."""
    model_file = folder / TOKENIZER_MODEL
    try:
        fmt = tokenizer_model_format(model_file)
    except TokenizerError:
        return  # some other library's file under that name: tokenizer.json is the tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    difference = _first_difference(encode, model_file, fmt, [], [])
    if difference is not None:
        logger.warning(
            "%s %s; prompts are tokenized with tokenizer.json, as transformers and vLLM do. To tokenize as %s does, "
            "remove tokenizer.json (tokenizer.model is then converted exactly)",
            folder / TOKENIZER_JSON,
            difference,
            fmt,
        )


def load_tokenizer(folder: str | os.PathLike, field: str = "tokenizer") -> Any:
    """The transformers tokenizer of ``folder`` (a Hugging Face folder or a dist_ckpt's ``hf_config/``).

    A ``tokenizer.json`` is loaded as is (with a warning when a ``tokenizer.model`` beside it splits text
    differently); a lone ``tokenizer.model`` is converted first (see the module docstring).
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    try:
        if not needs_conversion(folder):
            tokenizer = AutoTokenizer.from_pretrained(folder)
            if (folder / TOKENIZER_MODEL).is_file() and (folder / TOKENIZER_JSON).is_file():
                _warn_if_json_differs(tokenizer, folder)
            return tokenizer
        with tempfile.TemporaryDirectory(prefix="megatron_opd_tokenizer_") as tmp:
            for name in _SIDE_FILES:
                if (folder / name).is_file():
                    shutil.copy2(folder / name, Path(tmp) / name)
            fmt = write_converted_tokenizer(folder, tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
            logger.debug("converted %s (%s) for %s", folder / TOKENIZER_MODEL, fmt, field)
            return tokenizer
    except TokenizerError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers raises many types for one cause: unreadable files
        raise TokenizerError(
            f"{field}={str(folder)!r}: the tokenizer could not be loaded ({type(err).__name__}: {err}); "
            f"check its {TOKENIZER_JSON} / {TOKENIZER_MODEL} / {TOKENIZER_CONFIG}, or point {field} at a folder "
            "with a working tokenizer"
        ) from err
