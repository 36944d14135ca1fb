"""Cross-tokenizer alignment on real tokenizers: Mistral's SentencePiece, Llama 3's tiktoken, a byte-level BPE.

Every alignment is checked against a brute-force reference: the byte offsets where both sides end a token.
"""

from __future__ import annotations

import random
import time
from bisect import bisect_left
from itertools import accumulate

import pytest

from megatron_opd.cross_tokenizer import TextMismatchError, TokenBytes, align, align_batch, alignment_stats
from megatron_opd.testing.real_tokenizers import TOKENIZER_KINDS, TOKENIZER_PAIRS

TEXTS = (
    "Hello world",
    "Family 👩‍👩‍👧‍👦, flag 🇯🇵, thumbs 👍🏽 and 🙂🙂",
    "日本語のテキストと中文文本，한국어 텍스트",
    "code:\n    return x\t\t# two  spaces\n\n\n   end  ",
    " one leading space",
    "  two leading spaces",
    "byte fallback only: \x00\x01 ǅ 𒀀𒀁 ꙮ",
    "naïve café Ελληνικά русский עברית العربية हिन्दी 1234567",
    "[REFERENCE_DOC_3] is a word here",
)
KINDS, PAIRS = TOKENIZER_KINDS, TOKENIZER_PAIRS


@pytest.fixture(scope="module")
def tokenizers(tokenizer_kinds) -> dict:
    """Each kind's (transformers tokenizer, TokenBytes); the real ones are missing without their packages."""
    return {kind: (tokenizer, TokenBytes(tokenizer, name=kind)) for kind, (tokenizer, _) in tokenizer_kinds.items()}


def tokenizer_of(tokenizers, kind):
    if kind not in tokenizers:
        pytest.skip("needs sentencepiece, mistral_common and llama-models")
    return tokenizers[kind]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def reference_groups(student_ids, teacher_ids, student: TokenBytes, teacher: TokenBytes):
    """Groups from the intersection of both sides' token end offsets; special tokens only at either end."""

    def split(ids, token_bytes):
        flags = [token_bytes.is_special(i) for i in ids]
        lead = next((k for k, f in enumerate(flags) if not f), len(ids))
        trail = next((k for k, f in enumerate(reversed(flags[lead:])) if not f), len(ids) - lead)
        assert not any(flags[lead : len(ids) - trail]), "the reference handles special tokens only at the ends"
        return lead, len(ids) - trail

    (s0, s1), (t0, t1) = split(student_ids, student), split(teacher_ids, teacher)
    s_pieces, t_pieces = student.pieces(student_ids[s0:s1]), teacher.pieces(teacher_ids[t0:t1])
    s_text, t_text = b"".join(s_pieces), b"".join(t_pieces)
    s_skip, t_skip = int(s_text == b" " + t_text), int(t_text == b" " + s_text)
    s_ends = [max(e - s_skip, 0) for e in accumulate(map(len, s_pieces))]
    t_ends = [max(e - t_skip, 0) for e in accumulate(map(len, t_pieces))]
    boundaries = sorted((set(s_ends) & set(t_ends)) - {0})

    def ranges(ends, offset):
        index = [bisect_left(boundaries, e) for e in ends]
        return [(offset + index.index(g), offset + len(index) - index[::-1].index(g)) for g in range(len(boundaries))]

    def specials(a0, a1, b0, b1):  # pair in order, the rest one-sided
        pairs = []
        while a0 < a1 or b0 < b1:
            pairs.append(((a0, a0 + (a0 < a1)), (b0, b0 + (b0 < b1))))
            a0, b0 = a0 + (a0 < a1), b0 + (b0 < b1)
        return pairs

    middle = list(zip(ranges(s_ends, s0), ranges(t_ends, t0)))
    return specials(0, s0, 0, t0) + middle + specials(s1, len(student_ids), t1, len(teacher_ids))


def check(student_ids, teacher_ids, student: TokenBytes, teacher: TokenBytes):
    alignment = align(student_ids, teacher_ids, student, teacher)
    groups = [(g.student, g.teacher) for g in alignment.groups]
    assert groups == reference_groups(student_ids, teacher_ids, student, teacher)
    student_index, teacher_index = alignment.student_group_index(), alignment.teacher_group_index()
    assert student_index.tolist() == [k for k, (s, _) in enumerate(groups) for _ in range(*s)]
    assert teacher_index.tolist() == [k for k, (_, t) in enumerate(groups) for _ in range(*t)]
    assert len(student_index) == len(student_ids) and len(teacher_index) == len(teacher_ids)
    return alignment


def split_tokens(tokenizer, ids: list[int], rng: random.Random) -> list[int]:
    """A non-canonical sequence for the same text: every token that is two vocabulary tokens becomes those two."""
    vocab = tokenizer.get_vocab()
    out = []
    for token in tokenizer.convert_ids_to_tokens(ids):
        cuts = [k for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        if cuts and not token.startswith("<0x"):
            k = rng.choice(cuts)
            out += [vocab[token[:k]], vocab[token[k:]]]
        else:
            out.append(vocab[token])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_token_bytes_match_the_decoder(tokenizers, kind):
    tokenizer, token_bytes = tokenizer_of(tokenizers, kind)
    assert token_bytes.kind == ("sentencepiece" if kind == "sentencepiece" else "byte_level")
    assert token_bytes.dummy_prefix == (kind == "sentencepiece")
    for text in TEXTS:
        ids = encode(tokenizer, text)
        data = b"".join(token_bytes.pieces(ids))
        assert data in (text.encode(), b" " + text.encode())
        assert token_bytes.text(ids) == decode(tokenizer, ids)
        for k in range(1, len(ids) + 1):  # every prefix that is whole characters decodes to its tokens' bytes
            try:
                prefix = b"".join(token_bytes.pieces(ids[:k])).decode()
            except UnicodeDecodeError:
                continue
            assert (
                token_bytes.text(ids[:k])
                == decode(tokenizer, ids[:k])
                == prefix.removeprefix(" " if kind == "sentencepiece" else "")
            )
    eos = tokenizer.eos_token_id
    assert token_bytes.is_special(eos) and token_bytes[eos] == b""


@pytest.mark.parametrize("student_kind, teacher_kind", PAIRS)
def test_real_pairs_match_the_reference(tokenizers, student_kind, teacher_kind):
    student_tok, student = tokenizer_of(tokenizers, student_kind)
    teacher_tok, teacher = tokenizer_of(tokenizers, teacher_kind)
    rng = random.Random(0)
    for text in TEXTS:
        canonical = encode(student_tok, text)
        for student_ids in (canonical, split_tokens(student_tok, canonical, rng)):
            teacher_ids = encode(teacher_tok, decode(student_tok, student_ids))
            check(student_ids, teacher_ids, student, teacher)
            # EOS at the end of both: a group of its own.
            eos_ids = student_ids + [student_tok.eos_token_id], teacher_ids + [teacher_tok.eos_token_id]
            alignment = check(*eos_ids, student, teacher)
            n, m = len(student_ids), len(teacher_ids)
            assert alignment.groups[-1] == ((n, n + 1), (m, m + 1))
            assert not alignment.groups[-1].one_sided


@pytest.mark.parametrize("student_kind, teacher_kind", PAIRS)
def test_random_texts_match_the_reference(tokenizers, student_kind, teacher_kind):
    student_tok, student = tokenizer_of(tokenizers, student_kind)
    teacher_tok, teacher = tokenizer_of(tokenizers, teacher_kind)
    rng = random.Random(1)
    alphabet = list("ab xyz  \t\n\n.,!?'é日本🙂👩\u200d👧ǅ𒀀") + ["the", " and", "ing", "  ", "1234"]
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        student_ids = encode(student_tok, text)
        if rng.random() < 0.5:
            student_ids = split_tokens(student_tok, student_ids, rng)
        check(student_ids, encode(teacher_tok, decode(student_tok, student_ids)), student, teacher)


@pytest.mark.parametrize("kind", KINDS)
def test_identical_tokenizers_align_one_to_one(tokenizers, kind):
    tokenizer, token_bytes = tokenizer_of(tokenizers, kind)
    for text in TEXTS:
        ids = encode(tokenizer, text) + [tokenizer.eos_token_id]
        alignment = check(ids, ids, token_bytes, token_bytes)
        assert alignment.groups == [((k, k + 1), (k, k + 1)) for k in range(len(ids))]
        assert alignment.stats().one_to_one_share == 1.0


def test_bytes_split_inside_a_character(tokenizers):
    """One token per byte for the student: groups close at byte offsets, wherever the teacher's tokens end."""
    tokenizer, token_bytes = tokenizer_of(tokenizers, "tiktoken")
    byte_level_tok, byte_level = tokenizer_of(tokenizers, "byte_level")
    all_pieces = token_bytes.pieces(list(range(len(token_bytes))))
    single = {piece: i for i, piece in enumerate(all_pieces) if len(piece) == 1}
    assert len(single) == 256
    text = "👩‍👧 a 日本"
    per_byte = [single[bytes([b])] for b in text.encode()]
    teacher_ids = encode(tokenizer, text)
    alignment = check(per_byte, teacher_ids, token_bytes, token_bytes)
    assert [t for _, t in alignment.groups] == [(k, k + 1) for k in range(len(teacher_ids))]
    alignment = check(per_byte, encode(byte_level_tok, text), token_bytes, byte_level)
    character_ends = set(accumulate(len(c.encode()) for c in text))
    byte_offsets = [g.student[1] for g in alignment.groups]  # one student token per byte
    assert any(offset not in character_ends for offset in byte_offsets), "no group closes inside a character"


def test_special_tokens(tokenizers):
    student_tok, student = tokenizer_of(tokenizers, "sentencepiece")
    teacher_tok, teacher = tokenizer_of(tokenizers, "byte_level")
    ids = student_tok("Hello world")["input_ids"]  # with BOS
    assert ids[0] == student_tok.bos_token_id
    teacher_ids = encode(teacher_tok, decode(student_tok, ids))
    alignment = check(ids, teacher_ids + [teacher_tok.eos_token_id], student, teacher)
    assert alignment.groups[0] == ((0, 1), (0, 0)) and alignment.groups[0].one_sided  # BOS on one side only
    assert alignment.groups[-1] == ((len(ids), len(ids)), (len(teacher_ids), len(teacher_ids) + 1))
    assert alignment.stats().one_sided_groups == 2

    # A special token inside a group joins it: "Hel" <|im_end|> "lo" against Llama 3's one "Hello".
    vocab = teacher_tok.get_vocab()
    im_end = teacher_tok.convert_tokens_to_ids("<|im_end|>")
    inside = [vocab[c] for c in "Hel"] + [im_end] + [vocab[c] for c in "lo"]
    llama_tok, llama = tokenizer_of(tokenizers, "tiktoken")
    hello = encode(llama_tok, "Hello")
    assert len(hello) == 1
    alignment = align(inside, hello, teacher, llama)
    assert alignment.groups == [((0, 6), (0, 1))]

    # Several specials at one boundary pair in order; the one left over is one-sided.
    student_ids = [*hello, llama_tok.eos_token_id, llama_tok.bos_token_id]
    teacher_ids = [*encode(teacher_tok, "Hello"), im_end]
    alignment = check(student_ids, teacher_ids, llama, teacher)
    m = len(teacher_ids)
    assert alignment.groups[1:] == [((1, 2), (m - 1, m)), ((2, 3), (m, m))]
    assert [g.one_sided for g in alignment.groups] == [False, False, True]


def test_non_special_added_token_contributes_its_content(tokenizers):
    student_tok, student = tokenizer_of(tokenizers, "sentencepiece")
    teacher_tok, teacher = tokenizer_of(tokenizers, "byte_level")
    doc = student_tok.convert_tokens_to_ids("[REFERENCE_DOC_3]")
    assert not student.is_special(doc) and student[doc] == b"[REFERENCE_DOC_3]"
    ids = [doc, *encode(student_tok, " is cited")]
    assert student.text(ids) == decode(student_tok, ids) == "[REFERENCE_DOC_3] is cited"
    check(ids, encode(teacher_tok, decode(student_tok, ids)), student, teacher)


def test_dummy_prefix_joins_the_first_group(tokenizers):
    student_tok, student = tokenizer_of(tokenizers, "sentencepiece")
    teacher_tok, teacher = tokenizer_of(tokenizers, "byte_level")
    ids = encode(student_tok, "Hello")
    assert student[ids[0]].startswith(b" ")
    alignment = check(ids, encode(teacher_tok, "Hello"), student, teacher)
    assert alignment.groups[0].student[0] == 0 and alignment.groups[0].teacher[0] == 0
    # A lone "▁" token first: it adds no byte of the text and joins the first group.
    lone = student_tok.convert_tokens_to_ids(["▁", "Hello"])
    assert align(lone, encode(teacher_tok, "Hello"), student, teacher).groups[0].student == (0, 2)


@pytest.mark.parametrize(
    "student_text, teacher_text, offset",
    [("Hello world", "Hello World", 6), ("Hello world", "Hello  world", 6), ("abc", "abcd", 3), ("🙂", "🙃", 3)],
)
def test_mismatched_texts_are_refused(tokenizers, student_text, teacher_text, offset):
    tokenizer, token_bytes = tokenizer_of(tokenizers, "byte_level")
    with pytest.raises(TextMismatchError, match=f"first differing at byte {offset}") as err:
        align(encode(tokenizer, student_text), encode(tokenizer, teacher_text), token_bytes, token_bytes)
    assert err.value.offset == offset and isinstance(err.value, ValueError)


def test_leading_space_only_from_a_dummy_prefix(tokenizers):
    """Only a tokenizer with a dummy prefix may carry a leading space the other stream lacks."""
    tokenizer, token_bytes = tokenizer_of(tokenizers, "byte_level")
    llama_tok, llama = tokenizer_of(tokenizers, "tiktoken")
    with pytest.raises(TextMismatchError, match="byte 0"):
        align(encode(tokenizer, " Hello"), encode(llama_tok, "Hello"), token_bytes, llama)
    # With one, offsets are counted in the text, after its dummy prefix.
    mistral_tok, mistral = tokenizer_of(tokenizers, "sentencepiece")
    with pytest.raises(TextMismatchError, match="byte 6") as err:
        align(encode(mistral_tok, "Hello world"), encode(tokenizer, "Hello World"), mistral, token_bytes)
    assert "b'Hello world'" in str(err.value) and "b'Hello World'" in str(err.value)


def test_unknown_ids_and_unsupported_tokenizers_are_refused(tokenizers):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, token_bytes = tokenizer_of(tokenizers, "byte_level")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        align([len(token_bytes)], [], token_bytes, token_bytes)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        align([-1], [], token_bytes, token_bytes)

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=wordpiece, name_or_path="bert-like")
    with pytest.raises(ValueError, match="bert-like.*WordPiece"):
        TokenBytes(fast)
    bpe_with_wordpiece_decoder = Tokenizer(models.BPE({"a": 0}, []))
    bpe_with_wordpiece_decoder.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="my-folder.*WordPiece"):
        TokenBytes(PreTrainedTokenizerFast(tokenizer_object=bpe_with_wordpiece_decoder), name="my-folder")


def test_batch_of_long_responses_is_fast(tokenizers):
    student_tok, student = tokenizer_of(tokenizers, "sentencepiece")
    teacher_tok, teacher = tokenizer_of(tokenizers, "tiktoken")
    text = " ".join(TEXTS) * 3
    pairs = []
    for k in range(100):
        ids = encode(student_tok, text[k:])[:500] + [student_tok.eos_token_id]
        pairs.append((ids, encode(teacher_tok, decode(student_tok, ids)) + [teacher_tok.eos_token_id]))
    assert sum(len(s) for s, _ in pairs) > 45_000
    start = time.perf_counter()
    alignments = align_batch(pairs, student, teacher)
    seconds = time.perf_counter() - start
    stats = alignment_stats(alignments)
    print(f"aligned 100 pairs of ~500 tokens in {seconds * 1000:.1f} ms: {stats}")
    assert seconds < 5.0  # ~50 ms expected; generous for a loaded machine
    assert stats.one_sided_groups == 0 and 0 < stats.one_to_one_share < 1
    assert stats.mean_student_tokens >= 1 and stats.mean_teacher_tokens >= 1


def test_zero_byte_tokens_join_the_group_they_end():
    """An empty token (possible in a vocabulary, never in a canonical split) joins the group that ends where it is."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "": 1, "▁": 2, "a": 3, "b": 4, "▁a": 5, "ab": 6}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    token_bytes = TokenBytes(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"), name="empty")
    assert token_bytes.kind == "sentencepiece" and token_bytes.dummy_prefix and token_bytes[1] == b""
    assert check([3, 1, 4, 1], [6], token_bytes, token_bytes).groups == [((0, 4), (0, 1))]
    assert check([3, 4, 1], [3, 1, 4], token_bytes, token_bytes).groups == [((0, 1), (0, 2)), ((1, 3), (2, 3))]
    assert check([2, 1, 3], [3], token_bytes, token_bytes).groups == [((0, 3), (0, 1))]  # "▁" dummy prefix first
