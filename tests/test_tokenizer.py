"""tokenizer.model folders (SentencePiece and tiktoken) tokenize exactly as sentencepiece / tiktoken themselves.

References are the libraries that made the files: ``sentencepiece`` for Mistral's models and models trained here,
``llama-models``' own tiktoken tokenizer for Llama 3.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

sentencepiece = pytest.importorskip("sentencepiece")

from megatron_opd.checkpoint.hf_to_mcore import copy_hf_side_files  # noqa: E402
from megatron_opd.data.prompts import PromptEncoder  # noqa: E402
from megatron_opd.testing.real_tokenizers import (  # noqa: E402
    LLAMA3_STOP_IDS,
    mistral_sentencepiece_model,
    train_sentencepiece,
    write_llama3_tokenizer,
    write_mistral_tokenizer,
)
from megatron_opd.tokenizer import load_tokenizer, tokenizer_model_format  # noqa: E402
from megatron_opd.vocab import TokenizerError, eos_token_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _texts(n: int = 150, seed: int = 0) -> list[str]:
    """Hand-picked hard cases and random slices of the README (prose, code, tables, unicode)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rng = random.Random(seed)
    slices = [readme[i : i + rng.randrange(1, 160)] for i in (rng.randrange(len(readme)) for _ in range(n))]
    hard = [
        "Hello world", "two  spaces and   three", "def f(x):\n    return x  # indented\n\tTab", "trailing  ",
        "digits 0123456789 3.14159", "naïve café 日本語 Ελληνικά 🙂 ﬁ", "\n\nleading newlines", "a\r\nb", "x",
    ]  # fmt: skip
    # A text that starts with a space is the one documented difference from sentencepiece (see megatron_opd.tokenizer).
    return hard + [s for s in slices if s and not s.startswith(" ")]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    pytest.importorskip("mistral_common")
    return write_mistral_tokenizer(tmp_path_factory.mktemp("mistral") / "v3", "v3")


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    pytest.importorskip("llama_models")
    return write_llama3_tokenizer(tmp_path_factory.mktemp("llama3") / "tok")


def _sentencepiece_dir(root: Path, name: str, **options) -> Path:
    corpus = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    folder = root / name
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(train_sentencepiece(corpus, options.pop("vocab_size"), **options))
    return folder


def test_format_is_detected_and_bad_files_are_named(tmp_path, mistral_dir, llama3_dir):
    assert tokenizer_model_format(mistral_dir / "tokenizer.model") == "sentencepiece"
    assert tokenizer_model_format(llama3_dir / "tokenizer.model") == "tiktoken"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.model").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match=r"bad/tokenizer.model: neither a SentencePiece model nor a tiktoken"):
        tokenizer_model_format(bad / "tokenizer.model")
    with pytest.raises(TokenizerError, match=r"neither a SentencePiece model nor a tiktoken"):
        load_tokenizer(bad)


@pytest.mark.parametrize(
    "source",
    ["mistral-v1", "mistral-v3", "trained-bpe", "trained-unigram-nfkc"],
)
def test_sentencepiece_folders_match_sentencepiece(tmp_path, source):
    if source.startswith("mistral"):
        pytest.importorskip("mistral_common")
        folder = write_mistral_tokenizer(tmp_path / source, source.split("-")[1])
    elif source == "trained-bpe":  # Llama-style: BPE, identity normalisation, byte fallback
        folder = _sentencepiece_dir(tmp_path, source, vocab_size=600)
    else:  # sentencepiece's defaults: unigram, NFKC, extra whitespace removed
        folder = _sentencepiece_dir(
            tmp_path, source, vocab_size=300, model_type="unigram", normalization_rule_name="nmt_nfkc",
            remove_extra_whitespaces=True, byte_fallback=False,
        )  # fmt: skip
    assert not (folder / "tokenizer.json").exists()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokenizer = load_tokenizer(folder)
    assert len(tokenizer) == sp.vocab_size()
    assert tokenizer.get_vocab() == {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (sp.bos_id(), sp.eos_id(), 0)
    for text in _texts():
        ids = tokenizer(text)["input_ids"]
        assert ids == [sp.bos_id(), *sp.encode(text)], f"{source}: {text!r}"
        if sp.unk_id() not in ids:  # sentencepiece decodes <unk> as " ⁇ ", transformers skips it
            assert tokenizer.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]), f"{source}: {text!r}"


def test_llama3_tiktoken_folder_matches_llama_models(llama3_dir):
    from llama_models.llama3.tokenizer import Tokenizer

    reference = Tokenizer(llama3_dir / "tokenizer.model")
    tokenizer = load_tokenizer(llama3_dir)
    assert len(tokenizer) == reference.n_words == 128256
    for token, i in reference.special_tokens.items():
        assert tokenizer.convert_tokens_to_ids(token) == i
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (reference.bos_id, reference.eos_id)
    for text in _texts() + [" leading space"]:  # byte-level BPE has no dummy prefix: leading spaces match too
        ids = tokenizer(text)["input_ids"]
        assert ids == reference.encode(text, bos=True, eos=False), repr(text)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Special-token text in a chat template becomes the special id, as in llama-models' chat format.
    text = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(
        text, bos=False, eos=False, allowed_special="all"
    )
    assert eos_token_ids(llama3_dir, tokenizer) == sorted(LLAMA3_STOP_IDS)


def test_bos_is_never_doubled(mistral_dir, llama3_dir):
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    reference = Tokenizer(llama3_dir / "tokenizer.model")
    encoder = PromptEncoder(load_tokenizer(llama3_dir))
    # The template writes <|begin_of_text|> itself; the ids are llama-models' chat format, one BOS.
    chat = [{"role": "user", "content": "Reverse 123"}]
    expected = ChatFormat(reference).encode_dialog_prompt([RawMessage(role="user", content="Reverse 123")]).tokens
    assert encoder.prompt_ids({"messages": chat}, "chat") == expected
    # Text that already starts with the BOS string: the tokenizer's BOS is not added twice.
    assert encoder.prompt_ids({"prompt": "<|begin_of_text|>Reverse 123"}, "text") == reference.encode(
        "Reverse 123", bos=True, eos=False
    )
    # Mistral's template writes <s> too; the ids are mistral_common's own encoding of the turn.
    from mistral_common.protocol.instruct.messages import UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    request = ChatCompletionRequest(messages=[UserMessage(content="Reverse  123")])
    # mistral_common reads the tokenizer version from the file name, so it gets the packaged file.
    expected = MistralTokenizer.from_file(str(mistral_sentencepiece_model("v3"))).encode_chat_completion(request).tokens
    chat = [{"role": "user", "content": "Reverse  123"}]
    assert PromptEncoder(load_tokenizer(mistral_dir)).prompt_ids({"messages": chat}, "chat") == expected


def test_tiktoken_special_tokens_must_be_listed(tmp_path, llama3_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.model").write_bytes((llama3_dir / "tokenizer.model").read_bytes())
    with pytest.raises(TokenizerError, match=r"tiktoken file, which holds no special tokens.*added_tokens_decoder"):
        load_tokenizer(bare)
    config = json.loads((llama3_dir / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]["128005"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: added_tokens_decoder skips ids 128005\.\.128005"):
        load_tokenizer(bare)


def test_malformed_config_names_the_file(tmp_path, mistral_dir):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes((mistral_dir / "tokenizer.model").read_bytes())
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"broken/tokenizer_config.json: malformed JSON"):
        load_tokenizer(folder)


def test_copied_files_load_the_same_in_plain_transformers(tmp_path, mistral_dir):
    """What tools/checkpoint writes (hf_config/, exports): a tokenizer.json transformers takes as is."""
    from transformers import AutoTokenizer

    dest = tmp_path / "copy"
    copied = copy_hf_side_files(mistral_dir, dest)
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(copied)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    original = json.loads((mistral_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == original["chat_template"]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_dir / "tokenizer.model"))
    plain = AutoTokenizer.from_pretrained(dest)
    for text in _texts(40, seed=1):
        assert plain(text)["input_ids"] == [sp.bos_id(), *sp.encode(text)], repr(text)


def test_tokenizer_json_that_splits_differently_is_reported(tmp_path, mistral_dir, caplog):
    """A folder with both files uses tokenizer.json (as transformers and vLLM do) and says when it disagrees."""
    from tokenizers import Tokenizer, pre_tokenizers

    good = tmp_path / "good"
    copy_hf_side_files(mistral_dir, good)
    with caplog.at_level(logging.WARNING, logger="megatron_opd.tokenizer"):
        load_tokenizer(good)
    assert not caplog.records
    bad = tmp_path / "bad"
    copy_hf_side_files(mistral_dir, bad)
    backend = Tokenizer.from_file(str(bad / "tokenizer.json"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    backend.save(str(bad / "tokenizer.json"))  # no dummy prefix: "Hello" instead of "▁Hello"
    with caplog.at_level(logging.WARNING, logger="megatron_opd.tokenizer"):
        tokenizer = load_tokenizer(bad)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_dir / "tokenizer.model"))
    expected = f"splits 'Hello world' into {tokenizer('Hello world', add_special_tokens=False)['input_ids']} but "
    expected += f"sentencepiece gives {sp.encode('Hello world')}"
    (record,) = caplog.records
    assert expected in record.getMessage() and "remove tokenizer.json" in record.getMessage()


def test_special_token_outside_the_vocabulary_refused(tmp_path, llama3_dir):
    folder = tmp_path / "typo"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes((llama3_dir / "tokenizer.model").read_bytes())
    config = json.loads((llama3_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|eot|>"  # not Llama 3's <|eot_id|>
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token '<\|eot\|>' is not a token of"):
        load_tokenizer(folder)
