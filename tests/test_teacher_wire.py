"""The teacher server's wire format, reply validation, the tokenizer summary and the server-backend config.

No sockets here: bytes in, bytes out. Malformed input must raise ``WireError`` naming the field, never allocate
what a lying header claims, and never reach pickle.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from megatron_opd.teacher import wire
from megatron_opd.teacher.client import check_reply
from megatron_opd.teacher.transport import WIRE_DTYPES, ScoreReply, ScoreRequest, split_addresses
from megatron_opd.teacher.vocabulary import RemoteTokenizer, fingerprint, tokenizer_summary
from megatron_opd.testing.multiprocess import run_distributed

MAX = 1 << 20
VOCABULARY = "5e" * 32
"""A vocabulary fingerprint (64 hex digits) the requests name."""


def _request(n=3, s=5, r=2, k=4, dtype="fp32") -> ScoreRequest:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (n, s), generator=g)
    ids = torch.randint(0, 1000, (n, s, r), generator=g) if r else None
    return ScoreRequest(tokens, k, 0.7, ids, dtype, vocabulary=VOCABULARY)


def _reply(n=3, s=5, k=4, r=2) -> ScoreReply:
    g = torch.Generator().manual_seed(1)
    logprobs = torch.log_softmax(torch.randn(n, s, 50, generator=g), dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    requested = logprobs[..., :r].clone() if r else None
    return ScoreReply(ids, values, requested)


@pytest.mark.parametrize("r", [0, 2])
def test_score_request_round_trip(r):
    request = _request(r=r, dtype="bf16")
    data = wire.encode_score(77, b"tok", request)
    assert len(data) == wire.score_size(3, 5, r, b"tok")
    message = wire.decode(data, MAX)
    assert isinstance(message, wire.Score) and message.request_id == 77 and message.token == b"tok"
    got = message.request
    assert torch.equal(got.tokens.long(), request.tokens)
    assert got.k == 4 and got.temperature == 0.7 and got.wire_dtype == "bf16"  # temperature travels as float64
    if r:
        assert torch.equal(got.request_ids.long(), request.request_ids)
    else:
        assert got.request_ids is None
    assert got.vocabulary == VOCABULARY  # the vocabulary the ids are of (version 3)
    with pytest.raises(wire.WireError, match="vocabulary: must be a 64-hex-digit fingerprint, got ''"):
        wire.encode_score(78, b"tok", dataclasses.replace(request, vocabulary=""))


@pytest.mark.parametrize("dtype, tol", [("fp32", 0.0), ("bf16", 2**-8), ("fp16", 2**-11)])
def test_hidden_request_and_reply_round_trip(dtype, tol):
    """``transfer=hidden`` (protocol 2): the request's flag bit 1, k may be 0; the reply is a HIDDEN message."""
    request = ScoreRequest(_request(r=0).tokens, 0, 1.0, None, dtype, "hidden", VOCABULARY)
    message = wire.decode(wire.encode_score(3, b"", request), MAX)
    assert message.request.transfer == "hidden" and message.request.k == 0 and message.request.request_ids is None
    hidden = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(2)) * 4
    data = wire.encode_hidden(4, ScoreReply(hidden=hidden), dtype)
    assert len(data) == wire.hidden_size(3, 5, 7, dtype)
    reply = wire.decode(data, MAX)
    assert isinstance(reply, wire.Hidden) and reply.request_id == 4 and reply.wire_dtype == dtype
    assert reply.reply.topk_ids is None
    torch.testing.assert_close(reply.reply.hidden.float(), hidden, atol=0, rtol=tol)
    check_reply(request, reply.reply, vocab_size=50, hidden_size=7)
    with pytest.raises(ValueError, match=r"hidden has shape \(3, 5, 7\), the request needs \(3, 5, 8\)"):
        check_reply(request, reply.reply, vocab_size=50, hidden_size=8)
    with pytest.raises(ValueError, match="NaN or infinite"):
        check_reply(request, ScoreReply(hidden=hidden.clone().fill_(math.nan)), vocab_size=50, hidden_size=7)
    # Requested ids have no meaning for hidden states: refused on both sides of the wire.
    with pytest.raises(wire.WireError, match="request_ids: a hidden-state request takes no requested ids"):
        wire.encode_score(
            5, b"", ScoreRequest(request.tokens, 0, 1.0, _request().request_ids, dtype, "hidden", VOCABULARY)
        )
    flagged = bytearray(wire.encode_score(6, b"", _request(r=2)))
    flagged[7] |= wire.FLAG_HIDDEN
    with pytest.raises(wire.WireError, match="R=2: a hidden-state request takes no requested ids"):
        wire.decode(bytes(flagged), MAX)


@pytest.mark.parametrize("dtype, tol", [("fp32", 0.0), ("bf16", 2**-8), ("fp16", 2**-11)])
def test_scores_reply_round_trip_in_each_wire_dtype(dtype, tol):
    reply = _reply()
    data = wire.encode_scores(5, reply, dtype)
    assert len(data) == wire.scores_size(3, 5, 4, 2, dtype)
    message = wire.decode(data, MAX)
    assert isinstance(message, wire.Scores) and message.wire_dtype == dtype
    got = message.reply
    assert got.topk_logprobs.dtype == WIRE_DTYPES[dtype]
    assert torch.equal(got.topk_ids.long(), reply.topk_ids)
    for a, b in ((got.topk_logprobs, reply.topk_logprobs), (got.requested_logprobs, reply.requested_logprobs)):
        err = ((a.float() - b) / b.abs().clamp(min=1e-3)).abs().max()
        assert err <= tol, f"{dtype}: relative error {err}"
    check_reply(
        ScoreRequest(torch.zeros(3, 5, dtype=torch.long), 4, 1.0, torch.zeros(3, 5, 2, dtype=torch.long)), got, 50
    )


def test_small_messages_round_trip():
    hello = wire.decode(wire.encode_hello(1, b"secret", True), MAX)
    assert hello == wire.Hello(1, b"secret", True)
    info = wire.decode(wire.encode_info(2, {"a": [1, "é"]}), MAX)
    assert info == wire.Info(2, {"a": [1, "é"]})
    error = wire.decode(wire.encode_error(3, wire.ErrorCode.LIMIT, "too big"), MAX)
    assert error == wire.Error(3, wire.ErrorCode.LIMIT, "too big")
    assert wire.decode(wire.encode_ping(4), MAX) == wire.Ping(4)
    assert wire.decode(wire.encode_pong(5), MAX) == wire.Pong(5)


def _corrupt(data: bytes, offset: int, raw: bytes) -> bytes:
    return data[:offset] + raw + data[offset + len(raw) :]


def test_malformed_messages_name_the_field():
    good = wire.encode_score(9, b"", _request())
    fields_at = wire.HEADER.size + wire.TOKEN_LEN.size
    cases = {
        "header": good[:10],
        "magic": b"XXXX" + good[4:],
        "request_ids": good[:-5],  # truncated body
        "length": good + b"\0\0",  # trailing bytes
        "dtype": _corrupt(good, fields_at, bytes([9])),
        "message type": _corrupt(good, 6, bytes([99])),
        "token length": _corrupt(good, wire.HEADER.size, (5000).to_bytes(2, "little")),
        "k": _corrupt(good, fields_at + 4, (0).to_bytes(4, "little")),
        "R": _corrupt(wire.encode_score(9, b"", _request(r=0)), 7, bytes([1])),  # flag says ids follow, R=0
    }
    for field, data in cases.items():
        with pytest.raises(wire.WireError) as info:
            wire.decode(data, MAX)
        assert info.value.field == field, (field, str(info.value))
    # A header may claim 2**32-1 sequences: the reader checks the bytes exist before allocating anything.
    n_at = fields_at + 16
    lying = _corrupt(good, n_at, (2**32 - 1).to_bytes(4, "little"))
    with pytest.raises(wire.WireError, match="tokens: needs"):
        wire.decode(lying, MAX)
    with pytest.raises(wire.WireError, match="exceeds the limit"):
        wire.decode(good, len(good) - 1)
    with pytest.raises(wire.VersionError) as info:
        wire.decode(_corrupt(good, 4, (wire.VERSION + 1).to_bytes(2, "little")), MAX)
    with pytest.raises(wire.VersionError):  # a version-1 peer (before transfer=hidden) is told to upgrade
        wire.decode(_corrupt(good, 4, (1).to_bytes(2, "little")), MAX)
    assert info.value.request_id == 9  # the server can still address its error reply


def test_random_bytes_never_escape_as_other_errors():
    g = torch.Generator().manual_seed(0)
    good = wire.encode_score(1, b"t", _request())
    for i in range(300):
        noise = torch.randint(0, 256, (int(torch.randint(0, 200, (1,), generator=g)),), generator=g)
        data = bytes(noise.to(torch.uint8).tolist())
        if i % 2:  # keep a valid header so the decoder gets deep into the body
            data = good[: wire.HEADER.size] + data
        try:
            wire.decode(data, MAX)
        except wire.WireError:
            pass


def test_no_pickle_on_network_bytes():
    """The teacher package never unpickles: no pickle, torch.load or *_object_list anywhere in it."""
    import megatron_opd.teacher as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        source = path.read_text()
        for banned in (r"import (c?pickle|marshal)", r"\bpickle\.", r"torch\.load\(", r"_object_list\("):
            assert not re.search(banned, source), f"{path.name} uses {banned}"


def test_check_reply_rejects_what_a_bad_server_could_send():
    request = ScoreRequest(torch.zeros(3, 5, dtype=torch.long), 4, 1.0, torch.zeros(3, 5, 2, dtype=torch.long))
    check_reply(request, _reply(), 50)

    def broken(**change) -> ScoreReply:
        reply = _reply()
        for name, fn in change.items():
            setattr(reply, name, fn(getattr(reply, name)))
        return reply

    cases = [
        (broken(topk_ids=lambda x: x[:, :4]), "topk_ids has shape"),
        (broken(topk_logprobs=lambda x: x[..., :3]), "topk_logprobs has shape"),
        (broken(requested_logprobs=lambda x: None), "requested_logprobs has shape"),
        (broken(topk_ids=lambda x: x.index_fill(-1, torch.tensor([0]), 50)), "outside the teacher's vocabulary"),
        (broken(topk_ids=lambda x: x.index_fill(-1, torch.tensor([0]), -1)), "outside the teacher's vocabulary"),
        (broken(topk_ids=lambda x: x[..., [0, 0, 1, 2]]), "repeat an id"),
        (broken(topk_logprobs=lambda x: x.index_fill(-1, torch.tensor([3]), math.nan)), "NaN or infinite"),
        (broken(requested_logprobs=lambda x: x.index_fill(-1, torch.tensor([0]), -math.inf)), "NaN or infinite"),
        (broken(topk_logprobs=lambda x: x + 5), "positive log-probabilities"),
        (broken(topk_logprobs=lambda x: x.flip(-1)), "not sorted"),
    ]
    for reply, message in cases:
        with pytest.raises(ValueError, match=message):
            check_reply(request, reply, 50)


def test_tokenizer_summary_passes_the_one_vocabulary_check(tmp_path):
    from megatron_opd.testing.tiny_models import make_tiny_tokenizer
    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.vocab import VocabularyMismatchError, check_vocab

    tokenizer = load_tokenizer(make_tiny_tokenizer(tmp_path / "a", vocab_size=300))
    summary = tokenizer_summary(tokenizer)
    assert fingerprint(summary) == fingerprint(tokenizer_summary(load_tokenizer(tmp_path / "a")))
    # Through JSON, as it travels.
    remote = RemoteTokenizer(wire.decode(wire.encode_info(0, summary), MAX).info, "teacher server x:1")
    size = check_vocab(remote, tokenizer, teacher_name="t", student_name="s", teacher_embedding_rows=300,
                       student_embedding_rows=300)  # fmt: skip
    assert size == len(tokenizer)

    other = dict(summary, vocab=dict(summary["vocab"]))
    victim = sorted(other["vocab"].items(), key=lambda kv: kv[1])[200][0]
    other["vocab"][victim + "!"] = other["vocab"].pop(victim)
    assert fingerprint(other) != fingerprint(summary)
    with pytest.raises(VocabularyMismatchError, match="id 200 is"):
        check_vocab(RemoteTokenizer(other, "t"), tokenizer, teacher_name="t", student_name="s",
                    teacher_embedding_rows=300, student_embedding_rows=300)  # fmt: skip
    with pytest.raises(ValueError, match="'vocab' must map"):
        RemoteTokenizer(dict(summary, vocab=[1, 2]), "t")


def test_server_backend_config_errors_name_the_field_and_fix():
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "data.train_files=x.jsonl", "teacher.backend=server", "loss.mode=topk"]
    cfg = parse_args(TrainConfig, [*base, "teacher.address=127.0.0.1:5555,[::1]:6000"])
    cfg.validate()  # no teacher.path needed with a server
    assert split_addresses(cfg.teacher.address) == ["127.0.0.1:5555", "[::1]:6000"]
    for extra, message in [
        ([], "teacher.address is required with teacher.backend=server"),
        (["teacher.address=localhost"], "teacher.address: 'localhost' is not host:port"),
        (["teacher.address=h:1", "loss.mode=dense"], "set loss.mode=topk"),
    ]:
        cfg = parse_args(TrainConfig, [*base, *extra])
        with pytest.raises(ValueError, match=re.escape(message)):
            cfg.validate()
    with pytest.raises(ValueError, match="teacher.timeout_s must be > 0"):
        parse_args(TrainConfig, [*base, "teacher.timeout_s=0"])


def test_serve_refuses_a_public_bind_without_a_token(tmp_path, capsys):
    from megatron_opd.teacher.serve import parse_args, read_token

    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--host", "0.0.0.0"])
    assert "--host 0.0.0.0 is not loopback: give --token-file" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    args = parse_args(["--model", "m", "--host", "0.0.0.0", "--token-file", str(token)])
    assert read_token(args.token_file) == b"s3cret"
    token.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token(str(token))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss.mode": "dense"}, "set loss.mode=topk, or teacher.transfer=hidden with a teacher server"),
        ({"teacher.transfer": "hidden"}, "teacher.transfer=hidden serves loss.mode=dense"),
        ({"teacher.transfer": "hidden", "loss.mode": "dense", "teacher.backend": "vllm"},
         "a vLLM server returns log-probabilities, not hidden states"),
        ({"teacher.transfer": "hidden", "loss.mode": "dense", "teacher.path": ""}, "needs teacher.path"),
        ({"teacher.transfer": "hidden", "loss.mode": "dense", "teacher.backend": "inprocess"},
         "teacher.transfer=hidden applies to teacher.backend=server"),
        ({"teacher.transfer": "hidden", "loss.mode": "dense"}, None),
    ],
)  # fmt: skip
def test_config_of_the_hidden_state_transfer(overrides, message):
    from megatron_opd.config import load_config
    from megatron_opd.trainer.config import TrainConfig

    values = {"student.path": "s", "teacher.path": "t", "data.train_files": "d.jsonl", "teacher.backend": "server",
              "teacher.address": "127.0.0.1:5555", "loss.mode": "topk", **overrides}  # fmt: skip
    if values["teacher.backend"] == "vllm":
        values["teacher.address"] = "http://127.0.0.1:8000"
    cfg = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    if message is None:
        cfg.validate()
        return
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def _output_weight_body(path: str) -> torch.Tensor:
    from megatron_opd.checkpoint.source import load_output_weight
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig())
    return load_output_weight(path)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied, tied (the embedding is the output layer)
def test_output_weight_of_a_teacher_folder_in_either_format(family, tiny_model_dirs, tmp_path):
    """``teacher.transfer=hidden`` loads the teacher's output layer from ``teacher.path``: the same rows from a
    Hugging Face folder and from its ``dist_ckpt`` (padded vocabulary rows there), and the server's check of it."""
    from megatron_opd.checkpoint.hf_to_mcore import convert_hf_to_mcore
    from megatron_opd.checkpoint.source import load_output_weight, model_architecture
    from megatron_opd.models.hf_io import HFCheckpointReader
    from megatron_opd.teacher.transport import ServerInfo
    from megatron_opd.trainer.setup import check_output_weight

    hf = tiny_model_dirs[family]
    arch = model_architecture(hf)
    name = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    want = HFCheckpointReader(hf).get(name)
    assert torch.equal(load_output_weight(hf), want)
    convert_hf_to_mcore(hf, tmp_path / "dist")
    # In the trainer's situation: a process group up (the dist_ckpt read is a collective).
    (got,) = run_distributed(_output_weight_body, 1, args=(str(tmp_path / "dist"),))
    assert got.shape[0] >= want.shape[0] and torch.equal(got[: want.shape[0]], want)
    vocab = want.shape[0] - 3
    sumsq = float(want[:vocab].double().square().sum())
    info = lambda **extra: ServerInfo(2, vocab, vocab, 8, 64, 64, 1 << 20, 8, "f", "teacher", extra=extra)  # noqa: E731
    check_output_weight(want, info(hidden_size=want.shape[1], output_weight_sumsq=sumsq, dtype="fp32"), vocab, hf)
    with pytest.raises(ValueError, match="is not the teacher server's"):
        check_output_weight(want * 1.001, info(hidden_size=want.shape[1], output_weight_sumsq=sumsq), vocab, hf)
    with pytest.raises(ValueError, match="sends hidden states of size 7"):
        check_output_weight(want, info(hidden_size=7, output_weight_sumsq=sumsq), vocab, hf)
