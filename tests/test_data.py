"""Prompt data: reading records, encoding prompts and responses, and the per-rank prompt stream."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_opd.data import DataError, PromptEncoder, PromptStream, load_prompts, read_records
from megatron_opd.data.records import first_records
from megatron_opd.testing.tiny_models import make_tiny_tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """The tiny tokenizer as saved (no BOS), and a copy with a ``<s>`` BOS prepended to every text."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    plain = make_tiny_tokenizer(root / "plain")
    raw = Tokenizer.from_file(str(plain / "tokenizer.json"))
    raw.add_special_tokens(["<s>"])
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    with_bos = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|endoftext|>")
    with_bos.save_pretrained(root / "bos")
    return {"plain": str(plain), "bos": str(root / "bos")}


def _tokenizer(tokenizer_dirs, kind="bos", chat_template: str | None = CHAT_TEMPLATE):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dirs[kind])
    tok.chat_template = chat_template
    return tok


# ---------------------------------------------------------------- records


def test_read_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "a", "answer": "1"}, {"messages": [{"role": "user", "content": "b"}], "answer": "2"}]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # blank lines are skipped
    parquet = tmp_path / "more.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "c"}, {"prompt": "d"}]), parquet)
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"prompt": "e"}]))

    records = read_records([str(jsonl), str(parquet), str(array)])
    assert records[:2] == rows
    assert [r["prompt"] for r in records[2:]] == ["c", "d", "e"]
    assert read_records(str(jsonl)) == rows  # one path as a string
    # the start-up check's sample: each file's first record, read no further
    firsts = first_records([str(jsonl), str(parquet), str(array)])
    assert firsts == [(str(f), read_records(str(f))[0]) for f in (jsonl, parquet, array)]


def test_a_byte_order_mark_is_accepted(tmp_path):
    """UTF-8 with a BOM (what many Windows tools write), in JSON lines and in a JSON array."""
    jsonl, array = tmp_path / "bom.jsonl", tmp_path / "bom.json"
    jsonl.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "caf\u00e9"}\n{"prompt": "b"}\n'.encode())
    array.write_bytes(b"\xef\xbb\xbf" + b'[{"prompt": "c"}]')
    assert [r["prompt"] for r in read_records([str(jsonl), str(array)])] == ["caf\u00e9", "b", "c"]


def test_record_errors(tmp_path):
    with pytest.raises(DataError, match=r"data\.eval_files: file .*nope\.jsonl.* does not exist"):
        read_records([str(tmp_path / "nope.jsonl")], key="data.eval_files")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl.* holds no records"):
        read_records([str(empty)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        read_records([str(bad)])
    not_object = tmp_path / "list.jsonl"
    not_object.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"list\.jsonl:1: a record must be a JSON object"):
        read_records([str(not_object)])
    csv = tmp_path / "data.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(DataError, match=r"unknown extension '\.csv'"):
        read_records([str(csv)])
    with pytest.raises(DataError, match=r"data\.train_files is empty"):
        read_records([])
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"corrupt\.parquet: not a readable Parquet file"):
        read_records([str(corrupt)])


# ---------------------------------------------------------------- prompts


def test_text_prompt_gets_bos_once(tokenizer_dirs):
    tok = _tokenizer(tokenizer_dirs)
    enc = PromptEncoder(tok)
    ids = enc.prompt_ids({"prompt": "The student samples"}, where="t.jsonl record 0")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids == tok("The student samples").input_ids
    # Text already rendered with the BOS written out: still one BOS.
    pre = enc.prompt_ids({"prompt": "<s>The student samples"}, where="t.jsonl record 1")
    assert pre == ids


def test_chat_prompt_renders_template_without_double_bos(tokenizer_dirs):
    tok = _tokenizer(tokenizer_dirs)
    enc = PromptEncoder(tok)
    record = {"messages": [{"role": "user", "content": "What is KL?"}]}
    ids = enc.prompt_ids(record, where="chat.jsonl record 0")
    text = enc.prompt_text(record)
    assert text == "<s><|im_start|>user\nWhat is KL?<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok(text, add_special_tokens=False).input_ids  # the rendered template, nothing added
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # A custom key, and the prompt text taking precedence when both fields are present.
    enc2 = PromptEncoder(tok, prompt_key="question", messages_key="chat")
    assert enc2.prompt_ids({"chat": record["messages"]}, where="x") == ids
    assert enc2.prompt_text({"question": "hi", "chat": record["messages"]}) == "hi"


def test_chat_prompt_without_bos_in_template(tokenizer_dirs):
    template = CHAT_TEMPLATE.replace("{{ bos_token }}", "")
    tok = _tokenizer(tokenizer_dirs, kind="plain", chat_template=template)
    ids = PromptEncoder(tok).prompt_ids({"messages": [{"role": "user", "content": "hi"}]}, where="x")
    assert ids == tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids


QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen3's branch on ``enable_thinking``: thinking unless told not to, when an empty think block closes it."""


def test_chat_template_kwargs_reach_rollout_eval_and_teacher_prompts(tmp_path, tokenizer_dirs):
    from types import SimpleNamespace

    from megatron_opd.config import load_config
    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import build_retokenizer

    folder = tmp_path / "qwen3_style"
    folder.mkdir()
    for f in Path(tokenizer_dirs["plain"]).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_STYLE_TEMPLATE}))
    tok = load_tokenizer(folder)
    record = {"messages": [{"role": "user", "content": "What is KL?"}]}
    head = "<|im_start|>user\nWhat is KL?<|im_end|>\n<|im_start|>assistant\n"

    def encoders(*overrides):
        cfg = load_config(TrainConfig, None, ["loss.cross_tokenizer=sampled", "loss.mode=sampled", *overrides])
        vocab = SimpleNamespace(tokenizer=tok, teacher_tokenizer=tok, stop_token_ids=(tok.eos_token_id,))
        # The trainer's own: the student's (rollout and evaluation prompts) and the teacher's re-tokenization.
        return PromptEncoder.for_data(tok, cfg.data), build_retokenizer(cfg, vocab).teacher_encoder

    for overrides, text in [
        ((), head),
        (("data.chat_template_kwargs.enable_thinking=true",), head),
        (("data.chat_template_kwargs.enable_thinking=false",), head + "<think>\n\n</think>\n\n"),
    ]:
        for encoder in encoders(*overrides):
            assert encoder.prompt_text(record) == text
            assert encoder.prompt_ids(record, "x") == tok(text, add_special_tokens=False).input_ids


class _ListTemplateTokenizer:
    """A transformers 4.x-style tokenizer whose chat template returns a plain list (or a batch of one)."""

    bos_token_id = 9
    eos_token_id = 8
    chat_template = "x"

    def __init__(self, rendered):
        self.rendered = rendered

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return self.rendered


@pytest.mark.parametrize("rendered", [[9, 9, 4, 5], [[9, 4, 5]], {"input_ids": [9, 4, 5], "attention_mask": [1, 1, 1]}])
def test_chat_template_return_types(rendered):
    ids = PromptEncoder(_ListTemplateTokenizer(rendered)).prompt_ids(
        {"messages": [{"role": "user", "content": "a"}]}, "x"
    )
    assert ids == [9, 4, 5]


def test_prompt_errors(tokenizer_dirs):
    enc = PromptEncoder(_tokenizer(tokenizer_dirs))
    with pytest.raises(DataError, match=r"f\.jsonl record 7: .*neither 'prompt' \(text\) nor 'messages' \(chat\)"):
        enc.prompt_ids({"question": "hi"}, where="f.jsonl record 7")
    with pytest.raises(DataError, match=r"'prompt' must be a string"):
        enc.prompt_ids({"prompt": 3}, where="x")
    with pytest.raises(DataError, match=r"'messages' must be a list"):
        enc.prompt_ids({"messages": "hi"}, where="x")
    no_template = PromptEncoder(_tokenizer(tokenizer_dirs, chat_template=None))
    with pytest.raises(DataError, match=r"no chat template"):
        no_template.prompt_ids({"messages": [{"role": "user", "content": "hi"}]}, where="x")
    with pytest.raises(DataError, match=r"loss\.kind=sft needs .*'response'"):
        enc.response_ids({"prompt": "hi"}, where="f.jsonl record 2")


def test_response_ids_end_with_eos(tokenizer_dirs):
    tok = _tokenizer(tokenizer_dirs)
    ids = PromptEncoder(tok, response_key="target").response_ids({"target": "the teacher scores"}, where="x")
    assert ids == tok("the teacher scores", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert tok.bos_token_id not in ids


def test_load_prompts_names_file_and_index(tmp_path, tokenizer_dirs):
    enc = PromptEncoder(_tokenizer(tokenizer_dirs))
    good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    records, ids = load_prompts([good], enc)
    assert [r["prompt"] for r in records] == ["a", "b"] and len(ids) == 2
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match=r"bad\.jsonl record 1"):
        load_prompts([good, bad], enc)


# ---------------------------------------------------------------- stream


def _stream(n=10, **kw) -> PromptStream:
    prompt_ids = kw.pop("prompt_ids", None) or [[i + 1] * (1 + i % 3) for i in range(n)]
    records = [{"i": i} for i in range(len(prompt_ids))]
    args = dict(seed=3, shuffle=True, global_batch=4, dp_rank=0, dp_size=1, max_prompt_len=None)
    args.update(kw)
    return PromptStream(prompt_ids, records, **args)


def _indices(batch) -> list[int]:
    return [item.index for item in batch]


def test_stream_deterministic_and_epochs():
    a, b = _stream(), _stream()
    seq_a = [_indices(a.next_batch()) for _ in range(6)]
    seq_b = [_indices(b.next_batch()) for _ in range(6)]
    assert seq_a == seq_b
    flat = [i for batch in seq_a for i in batch]  # 24 prompts: epochs 0, 1 and part of 2
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # reshuffled each epoch
    assert a.epoch == 2
    other_seed = _stream(seed=4)
    assert [_indices(other_seed.next_batch()) for _ in range(3)] != seq_a[:3]
    ordered = _stream(shuffle=False)
    assert [_indices(ordered.next_batch()) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    item = _stream(shuffle=False).next_batch()[1]
    assert item.index == 1 and item.prompt_ids == [2, 2] and item.record == {"i": 1}


def test_stream_batch_larger_than_dataset():
    s = _stream(n=3, shuffle=False, global_batch=8)
    assert _indices(s.next_batch()) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert s.epoch == 2


def test_stream_resume():
    s = _stream()
    for _ in range(3):
        s.next_batch()
    state = s.state_dict()
    assert state["consumed"] == 12
    expected = [_indices(s.next_batch()) for _ in range(4)]
    resumed = _stream()
    resumed.load_state_dict(state)
    assert [_indices(resumed.next_batch()) for _ in range(4)] == expected
    # Resuming at another data-parallel size continues the same global order.
    halves = [_stream(global_batch=4, dp_rank=r, dp_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    assert [_indices(halves[0].next_batch()) + _indices(halves[1].next_batch()) for _ in range(4)] == expected
    with pytest.raises(DataError, match=r"num_prompts=10 but this run has 9"):
        _stream(n=9).load_state_dict(state)


def test_stream_dp_ranks_union_equals_single_rank():
    single = _stream(global_batch=6)
    ranks = [_stream(global_batch=6, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(5):
        parts = [_indices(r.next_batch()) for r in ranks]
        assert all(len(p) == 3 for p in parts)
        assert parts[0] + parts[1] == _indices(single.next_batch())
    with pytest.raises(ValueError, match=r"train\.prompts_per_step=6 .* data-parallel size 4"):
        _stream(global_batch=6, dp_size=4)


def test_stream_skips_long_prompts(caplog):
    prompt_ids = [[1] * n for n in (3, 9, 4, 12, 5, 8)]
    with caplog.at_level(logging.WARNING, logger="megatron_opd.data.stream"):
        s = _stream(prompt_ids=prompt_ids, max_prompt_len=5, shuffle=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipping 3 of 6" in warnings[0].getMessage()
    assert "longer than 5 tokens" in warnings[0].getMessage()
    assert s.num_skipped == 3 and s.num_prompts == 3
    assert _indices(s.next_batch()) == [0, 2, 4, 0]
    assert all(len(item.prompt_ids) <= 5 for item in s.next_batch())  # kept whole, never truncated
    with pytest.raises(DataError, match=r"no usable prompt among 6"):
        _stream(prompt_ids=prompt_ids, max_prompt_len=2)
