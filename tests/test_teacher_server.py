"""The Megatron teacher server as a job of ranks (``RankJob``: torchrun's launch variables): exactness at TP=2 and
PP=2, a distillation through it, kill and restart; the in-process teacher and the server on every shape of the
model-shape matrix.

One TP=2 server of the fixture's teacher serves the first tests; the fault test runs its own server that dies
on its 3rd request (``MEGATRON_OPD_TEACHER_FAULT=exit_at_request:3``, a request count, not a timer) and is started
again on the same port. References are independent: ``transformers``' log-softmax + ``torch.topk``, and the
in-process teacher at TP=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_opd.teacher.client import TeacherClient
from megatron_opd.teacher.transport import RequestRefusedError
from megatron_opd.teacher.zmq_transport import ZmqTransportFactory
from megatron_opd.testing.distill_fixture import make_distill_fixture
from megatron_opd.testing.multiprocess import find_free_port, run_distributed, run_trainer
from megatron_opd.testing.shapes import MATRIX, SHAPES, shapes_at
from megatron_opd.testing.teacher_fakes import ThreadServer
from megatron_opd.testing.teacher_jobs import start_teacher_server, stop, train_metrics, wait_ready

ROOT = Path(__file__).resolve().parents[1]
K = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_distill_fixture(tmp_path_factory.mktemp("distill"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    """A TP=2 teacher server of the fixture's teacher; yields its address."""
    root = tmp_path_factory.mktemp("server")
    log = str(root / "server.log")
    proc = start_teacher_server(pair.teacher, tp=2, port=find_free_port(), ready_file=root / "ready", log_file=log,
                                extra_args=["--topk", "64"])  # fmt: skip
    address = wait_ready(proc, root / "ready", log)
    yield address
    stop(proc)


def _client(address: str, **kwargs) -> TeacherClient:
    options = dict(topk=K, timeout_s=60.0, retries=2, backoff_s=0.2, connect_timeout_s=60.0)
    options.update(kwargs)
    return TeacherClient([address], ZmqTransportFactory(), **options)


def _reference(teacher_dir: str, tokens: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    from megatron_opd.models.reference import hf_logits

    return torch.log_softmax(hf_logits(teacher_dir, tokens)[..., :vocab].double() / temperature, dim=-1)


def _assert_topk_close(ids, logprobs, ref: torch.Tensor, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Log-probs within tolerance; ids equal except where neighbouring log-probabilities tie within it."""
    ref_values, ref_ids = ref.topk(ids.shape[-1], dim=-1)
    torch.testing.assert_close(logprobs.double(), ref_values, atol=atol, rtol=rtol, msg=lambda m: f"{what} {m}")
    mismatch = ids != ref_ids
    gap = (ref_values[mismatch] - ref.gather(-1, ids)[mismatch]).abs()
    assert gap.numel() == 0 or gap.max() < atol + rtol * ref_values.abs().max(), (
        f"{what} ids differ beyond ties: {gap.max()}"
    )


def _assert_hidden_gives(hidden, teacher_dir: str, ref: torch.Tensor, vocab: int, what: str = "") -> None:
    """Hidden states from a server (``teacher.transfer=hidden``) times the output layer of ``teacher_dir`` give the
    reference log-probabilities (what the trainer's loss forms from them)."""
    from megatron_opd.checkpoint.source import load_output_weight

    weight = load_output_weight(teacher_dir)[:vocab].double()
    got = torch.log_softmax(hidden.double() @ weight.t(), dim=-1)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, msg=lambda m: f"{what} hidden states: {m}")


def _inprocess_body(teacher_dir: str, tokens, request_ids, temperatures, vocab: int):
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.teacher.inprocess import InProcessTeacher

    initialize_distributed(ParallelConfig())
    _, chunks = build_and_load(teacher_dir, ParallelConfig(), trainable=False)
    out = {}
    for temperature in temperatures:
        teacher = InProcessTeacher(chunks, vocab_size=vocab, mode="topk", topk=K, temperature=temperature)
        scores = teacher.score(tokens, request_ids).result()
        out[temperature] = (scores.topk_ids, scores.topk_logprobs, scores.requested_logprobs)
    return out


def test_server_tp2_matches_transformers_and_the_inprocess_teacher(pair, server):
    client = _client(server)
    remote, info = client.vocabulary()
    vocab = len(remote)
    assert info.embedding_rows == 1000 and vocab < 1000  # padded embedding rows must never enter the top-k
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    # The sampled next token and an arbitrary id per position (what a union-support loss asks for).
    request_ids = torch.stack([torch.roll(tokens, -1, dims=1), torch.randint(0, vocab, (4, 12), generator=g)], -1)
    inprocess = run_distributed(_inprocess_body, 1, args=(pair.teacher, tokens, request_ids, (1.0, 2.0), vocab))[0]
    for temperature in (1.0, 2.0):
        client.temperature = temperature
        scores = client.score(tokens, request_ids).result(timeout=120)
        assert scores.topk_ids.shape == (4, 12, K) and int(scores.topk_ids.max()) < vocab
        ref = _reference(pair.teacher, tokens, vocab, temperature)
        _assert_topk_close(scores.topk_ids, scores.topk_logprobs, ref, atol=2e-5)
        torch.testing.assert_close(scores.requested_logprobs.double(), ref.gather(-1, request_ids), atol=2e-5, rtol=0)
        ids, logprobs, requested = inprocess[temperature]
        ip_ref = torch.full(ref.shape, -torch.inf, dtype=torch.float64).scatter(-1, ids, logprobs.double())
        _assert_topk_close(scores.topk_ids, scores.topk_logprobs, ip_ref, atol=2e-5)
        torch.testing.assert_close(scores.requested_logprobs, requested, atol=2e-5, rtol=0)
    client.close()
    # bf16 on the wire: the same ids (up to ties), log-probs within bf16 rounding.
    client = _client(server, wire_dtype="bf16")
    scores = client.score(tokens, request_ids).result(timeout=120)
    _assert_topk_close(scores.topk_ids, scores.topk_logprobs, _reference(pair.teacher, tokens, vocab, 1.0),
                       atol=2e-5, rtol=2**-8)  # fmt: skip
    client.close()


def test_server_scores_after_the_teachers_own_prompt(pair, server):
    """``teacher.prompt_template`` through the server (TP=2): the reprompter's sequences (a hint + the student's
    prompt + its response; one sample without a hint), scored and moved back, hold at the student's position of each
    response token transformers' log-probabilities on the hinted sequence (top-k, the requested token, and with
    ``transfer=hidden`` the hidden states times the output layer). The trainer's side: test_an_inprocess_and_a_server_
    teacher_in_one_run (its server teacher has a template); the in-process teacher's: tests/test_packing.py."""
    from transformers import AutoTokenizer

    from megatron_opd.checkpoint.source import load_output_weight
    from megatron_opd.interfaces import TeacherScores
    from megatron_opd.teacher.reprompt import Reprompter
    from megatron_opd.testing.own_prompt import assert_own_prompt_scores, own_prompt_case

    tokenizer = AutoTokenizer.from_pretrained(pair.teacher)
    vocab = len(tokenizer)
    case = own_prompt_case(tokenizer, pair.train_file, vocab)
    request = case.request
    ref = _reference(pair.teacher, request.tokens, vocab, 1.0)
    client = _client(server)
    scores = client.score(request.tokens, request.request_ids, request.lengths).result(timeout=120)
    client.close()
    assert_own_prompt_scores(Reprompter.scores(scores, request, case.batch), case, ref, atol=2e-5, what="server")
    client = _client(server, transfer="hidden")
    scores = Reprompter.scores(client.score(request.tokens, None, request.lengths).result(timeout=120), request,
                               case.batch)  # fmt: skip
    client.close()
    weight = load_output_weight(pair.teacher)[:vocab].double()
    logprobs = torch.log_softmax(scores.dense_hidden.double() @ weight.t(), dim=-1)
    values, ids = logprobs.topk(K, dim=-1)
    formed = TeacherScores(topk_ids=ids, topk_logprobs=values,
                           requested_logprobs=logprobs.gather(-1, case.batch.next_tokens()[..., None]))  # fmt: skip
    assert_own_prompt_scores(formed, case, ref, atol=2e-5, what="server hidden states")


# How far a top-k divergence (the default reverse KL, bucket tail, K = 8 ids at teacher temperature 1.5) may move
# when the teacher's log-probabilities come from the TP=2 server instead of the in-process teacher at TP=1 (fp32,
# other summation orders: the row-parallel layers' partial sums, the log-sum-exp over two vocabulary shards).
# - The two teachers' log-probabilities differ by at most TEACHER_LOGPROB_DIFF: the bound
#   test_server_tp2_matches_transformers_and_the_inprocess_teacher holds them to (each other and the reference).
# - Per token, d = sum_k q_k (log q_k - log p_k) + q_tail (log q_tail - log p_tail) with p_tail = 1 - sum_k p_k, so
#   d(d)/d(log p_k) = -q_k + q_tail p_k / p_tail and |delta d| <= (Q_K + q_tail P_K / p_tail) * delta, with Q_K, P_K
#   the student's and the teacher's mass on the k ids. Evaluating each log-difference on two different float32
#   inputs adds 2 u |log p| (u = 2^-24, |log p| <= 7.6 over this fixture's ~1000 ids) to delta.
# - On this fixture's models (random initialisation: both near uniform) sum_t (Q_K + q_tail P_K / p_tail) is 44x
#   sum_t d (measured over random tokens: Q_K, P_K ~ 0.01, d ~ 4e-4 per token); DIVERGENCE_SENSITIVITY rounds up.
# Relative bound: 50 * (2e-5 + 2 * 2^-24 * 7.6) = 1.05e-3; measured 4e-6 (loss 1e-6) on an AVX-512 EPYC. A real
# error is far larger: log-probs rounded to bf16 on the wire (delta ~ 7.6 * 2^-9 = 0.015) give ~0.7 relative, a
# wrong teacher temperature or a dropped id moves d by its own size (relative ~0.1-1), a dropped token of the 24
# evaluated ~0.04. (A teacher near-tie between its 8th and 9th id, flipped by rounding, would move d by ~1e-2
# relative; none within rounding here: the smallest gap over 128 tokens is 6e-5, the teachers differ by ~1e-7.)
TEACHER_LOGPROB_DIFF = 2e-5
DIVERGENCE_SENSITIVITY = 50
TOPK_REL = DIVERGENCE_SENSITIVITY * (TEACHER_LOGPROB_DIFF + 2 * 2**-24 * 7.6)


@pytest.mark.parametrize("transfer", ["topk", "hidden", "aligned"])
def test_distillation_through_the_server_matches_the_inprocess_teacher(transfer, pair, server, tmp_path):
    """Student in one job (one process: the student's layout is not the subject), teacher TP=2 in another:
    the first step's loss equals the in-process one.
    ``hidden``: the server sends final hidden states (fp32 on the wire) and the trainer forms the teacher's logits
    with its output layer from ``teacher.path``: dense distillation, equal to the in-process dense loss; with
    ``eval.teacher_responses=false`` (the evaluator then builds no sampler for the remote teacher).
    ``aligned``: ``loss.cross_tokenizer=aligned``, the trainer re-tokenizing for the teacher and mapping its reply
    back (the tokenizers are one here: every position on the top-k loss; another tokenizer's ids and their mapping:
    tests/test_aligned_loss.py, tests/test_vocabulary_map.py)."""
    # optim.adam_eps: Adam's first step is lr * g / (|g| + eps), which moves a parameter by up to lr/(4 eps) times a
    # difference in its gradient (at |g| = eps). At the default eps 1e-8 that is 2.5e4 x: the two teachers' rounding
    # (below) flipped parameters whose gradient is within rounding of 0 by +-lr, and the evaluation after the step
    # differed by 1e-4 relative on an AVX-512 EPYC. At 1e-3 the factor is lr/(4 eps) = 0.25 (a step like SGD's): the
    # students differ by a quarter of their gradients' difference, and the evaluation after the step was 3.7e-5
    # relative apart there (the one before it 4e-6), within the same bound as the first.
    common = {"train.steps": 1, "loss.mode": "topk", "loss.topk": 8,
              "teacher.temperature": 1.5, "loss.weighting": "teacher_confidence", "rollout.n": 2,
              "optim.adam_eps": 1e-3, "export_hf": False}  # fmt: skip
    if transfer == "hidden":  # and without the fixed teacher responses: the evaluator never asks for its chunks
        common.update({"loss.mode": "dense", "loss.kind": "jsd", "eval.teacher_responses": False})
    if transfer == "aligned":
        common.update({"loss.cross_tokenizer": "aligned", "loss.weighting": "none"})
        transfer = "topk"
    code, out = run_trainer(pair.overrides(tmp_path / "inprocess", **common), nproc=1)
    assert code == 0, out[-3000:]
    remote = dict(common, **{"teacher.backend": "server", "teacher.address": server, "teacher.transfer": transfer})
    code, out = run_trainer(pair.overrides(tmp_path / "server", **remote), nproc=1)
    assert code == 0, out[-3000:]
    ref, got = train_metrics(tmp_path / "inprocess"), train_metrics(tmp_path / "server")
    ref_loss, got_loss = [r["loss"] for r in ref if "loss" in r], [r["loss"] for r in got if "loss" in r]
    assert len(ref_loss) == len(got_loss) == 1
    if "loss.cross_tokenizer" in common:  # its evaluation is accuracy only (the teacher scores its own tokens)
        assert [r["cross_tokenizer/topk_share"] for r in got if "loss" in r] == [1.0]
        assert got_loss[0] == pytest.approx(ref_loss[0], rel=TOPK_REL, abs=1e-7)
        return
    skipped = "eval.teacher_responses needs the teacher's weights in this job"
    assert (skipped in out) == common.get("eval.teacher_responses", True), out[-3000:]
    assert got_loss[0] == pytest.approx(ref_loss[0], rel=1e-6 if transfer == "hidden" else TOPK_REL, abs=1e-7)
    # The evaluation's divergence to the teacher goes through the server too.
    key = "eval/divergence_own_samples"
    ref_eval, got_eval = [r[key] for r in ref if key in r], [r[key] for r in got if key in r]
    assert len(got_eval) == 2 and got_eval == pytest.approx(ref_eval, rel=1e-5 if transfer == "hidden" else TOPK_REL)


def test_an_inprocess_and_a_server_teacher_in_one_run(pair, server, tmp_path):
    """``teachers.*`` end to end (config, routing, both back ends, the routed step, metrics): half the records name
    the server teacher, the rest go to the in-process one (``data.default_teacher``); each teacher's metrics are logged
    with exact token counts that add up to the step's. The server teacher has a prompt of its own
    (``teachers.remote.prompt_template``). (Equal losses and gradients to one teacher:
    tests/test_multi_teacher.py.)"""
    mixed = {}
    for name, path in (("train", pair.train_file), ("eval", pair.eval_file)):
        records = [json.loads(line) for line in Path(path).read_text().splitlines()]
        mixed[name] = tmp_path / f"{name}.jsonl"
        mixed[name].write_text("".join(json.dumps({**r, **({"teacher": "remote"} if i % 2 else {})}) + "\n"
                                       for i, r in enumerate(records)))  # fmt: skip
    common = {"train.steps": 1, "loss.mode": "topk", "loss.topk": 8, "rollout.n": 2, "export_hf": False,
              "data.train_files": mixed["train"], "data.eval_files": mixed["eval"], "data.shuffle": False,
              "eval.scorer": "megatron_opd.tasks.digits:score", "loss.teacher_balance": "per_teacher"}  # fmt: skip
    routed = [o for o in pair.overrides(tmp_path / "two", **common) if not o.startswith("teacher.path=")]
    routed += [f"teachers.local.path={pair.teacher}", "teachers.remote.backend=server",
               f"teachers.remote.address={server}", "data.default_teacher=local",
               "teachers.remote.prompt_template=answer {answer}. {prompt}"]  # fmt: skip
    code, out = run_trainer(routed, nproc=1)
    assert code == 0, out[-3000:]
    (got,) = [r for r in train_metrics(tmp_path / "two") if "loss" in r]
    # The server teacher scored after its own prompt (its scores: test_server_scores_after_the_teachers_own_prompt).
    assert got["teacher/remote/teacher_prompt/extra_tokens"] > 0
    assert "teacher/local/teacher_prompt/extra_tokens" not in got
    local, remote = (got[f"teacher/{name}/tokens"] for name in ("local", "remote"))
    assert local > 0 and remote > 0 and local + remote == got["response_length"] * 8
    assert got["teacher/local/samples"] + got["teacher/remote/samples"] == 8 and got["teacher/remote/retries"] == 0
    # per_teacher balance: the step's loss is the mean of the two teachers' per-token divergences (top-k: the loss)
    means = [got[f"teacher/{name}/divergence"] for name in ("local", "remote")]
    assert got["loss"] == pytest.approx(sum(means) / 2, rel=1e-5)
    assert "records per teacher: {'local': 16, 'remote': 16}" in out and "local div" in out and "remote div" in out
    # Evaluation per teacher: the eval records carry the same field (2 of the 4 evaluated prompts each).
    evals = [r for r in train_metrics(tmp_path / "two") if "eval/accuracy" in r]
    assert len(evals) == 2
    for r in evals:
        assert r["eval/accuracy"] == pytest.approx((r["eval/local/accuracy"] + r["eval/remote/accuracy"]) / 2)


def test_killed_pipeline_parallel_server_restarts_and_every_batch_is_answered_once(pair, tmp_path):
    port, ready, log = find_free_port(), tmp_path / "ready", str(tmp_path / "server.log")
    fault = {"MEGATRON_OPD_TEACHER_FAULT": "exit_at_request:3"}
    # PP=2 here (TP=2 above): the scores travel from the last pipeline stage to rank 0.
    proc = start_teacher_server(pair.teacher, pp=2, port=port, ready_file=ready, log_file=log, env=fault)
    address = wait_ready(proc, ready, log)
    client = _client(address, timeout_s=3.0, retries=40, backoff_s=0.5, connect_timeout_s=120.0)
    vocab = len(client.vocabulary()[0])
    batches = [torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    futures = [client.score(tokens, torch.roll(tokens, -1, dims=1)[..., None]) for tokens in batches]
    assert proc.wait(timeout=120) != 0, "the fault hook did not kill the server"
    assert "fault injection: exit at score request 3" in Path(log).read_text()
    proc = start_teacher_server(pair.teacher, pp=2, port=port, ready_file=ready, log_file=log)
    try:
        wait_ready(proc, ready, log)
        results = [f.result(timeout=300) for f in futures]
        hidden_client = _client(address, transfer="hidden")  # the hidden states travel from the last stage too
        hidden = hidden_client.score(batches[0]).result(timeout=120).dense_hidden
        hidden_client.close()
    finally:
        stop(proc)
    _assert_hidden_gives(hidden, pair.teacher, _reference(pair.teacher, batches[0], vocab, 1.0), vocab)
    for tokens, scores in zip(batches, results):
        ref = _reference(pair.teacher, tokens, vocab, 1.0)
        _assert_topk_close(scores.topk_ids, scores.topk_logprobs, ref, atol=2e-5)
        expected = ref.gather(-1, torch.roll(tokens, -1, dims=1)[..., None])
        torch.testing.assert_close(scores.requested_logprobs.double(), expected, atol=2e-5, rtol=0)
    assert client.stats["requests"] == 6 and client.stats["retries"] >= 1
    client.close()


@pytest.mark.parametrize("case", ["vocabulary", "token"])
def test_trainer_refuses_a_wrong_vocabulary_or_token(case, pair, tmp_path):
    token_file = tmp_path / "token.txt"
    token_file.write_text("not-the-secret\n")
    # A toy teacher of 50 tokens (vocabulary case), or the right size behind a token the trainer does not have.
    toy = ThreadServer(token=b"the-secret" if case == "token" else None)
    try:
        overrides = pair.overrides(tmp_path / f"run_{case}", **{"teacher.backend": "server", "teacher.address": toy.address,
                                                       "teacher.token_file": token_file, "loss.mode": "topk",
                                                       "loss.topk": 8, "teacher.timeout_s": 10})  # fmt: skip
        code, out = run_trainer(overrides, nproc=1, timeout=200)
    finally:
        toy.stop()
    assert code != 0
    if case == "vocabulary":
        assert f"teacher 'teacher.address={toy.address}' has 50 tokens and student" in out, out[-3000:]
    else:
        assert "wrong or missing token: teacher.token_file must hold the token" in out, out[-3000:]


INPROCESS_PATH, SERVER_PATH = "in-process teacher top-k vs transformers", "teacher server top-k vs transformers"
INPROCESS_LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "tp1": dict()}  # TP=1 runs as two data-parallel copies
SERVER_TP = {"tp1": 1, "tp2": 2}


LENGTHS = [12, 3, 7, 1]
"""Real tokens of each row of ``_inputs`` (the rest is padding): the packed (THD) paths get rows of other lengths."""


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens below ``vocab`` and two requested ids per position (the next token and an arbitrary one)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    return tokens, torch.stack([torch.roll(tokens, -1, dims=1), torch.randint(0, vocab, (4, 12), generator=g)], -1)


def _reference64(hf_dir: str, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """transformers' log-probabilities over the first ``vocab`` ids, the model run in float64."""
    from megatron_opd.models.reference import hf_model

    # MoE experts one by one: transformers' grouped expert GEMM has no float64 kernel
    model = hf_model(hf_dir, experts_implementation="eager").double().eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=tokens).logits[..., :vocab], dim=-1)


def _inprocess_layouts_body(cells: dict[str, dict[str, str]]):
    """The in-process teacher's top-k (mode="topk") of every shape of every layout, re-initialised in one job; rows
    of ``LENGTHS`` tokens packed two to a micro-batch, the logits formed 5 tokens at a time. Then its dense scores
    (mode="dense"): this rank's logit shard, from the hidden states and the output weight the loss would take, or
    the output layer's own logits where they are soft-capped (Gemma 2, Gemma 4)."""
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel
    from megatron_opd.teacher.inprocess import InProcessTeacher

    out = {}
    for i, (label, shapes) in enumerate(cells.items()):
        parallel = ParallelConfig(**INPROCESS_LAYOUTS[label])
        (initialize_distributed if i == 0 else initialize_model_parallel)(parallel)
        for name, hf_dir in shapes.items():
            vocab = SHAPES[name].vocab_size
            _, chunks = build_and_load(hf_dir, parallel, trainable=False)
            tokens, request_ids = _inputs(vocab)
            teacher = InProcessTeacher(chunks, vocab_size=vocab, mode="topk", topk=K, micro_batch_size=2, packing=True,
                                       chunk_size=5)  # fmt: skip
            scores = teacher.score(tokens, request_ids, LENGTHS).result()
            out[label, name] = (scores.topk_ids, scores.topk_logprobs, scores.requested_logprobs)
            teacher = InProcessTeacher(chunks, vocab_size=vocab, mode="dense", topk=K, micro_batch_size=2,
                                       packing=True)  # fmt: skip
            dense = teacher.score(tokens, None, LENGTHS).result()
            if dense.dense_logits is None:
                dense.dense_logits = dense.dense_hidden.double() @ dense.output_weight.double().t()
            out["dense", label, name] = dense.dense_logits
    return out


def test_teacher_topk_per_shape(shape_dirs, tmp_path):
    """The matrix's shapes through the in-process teacher (TP=1, TP=2) and a teacher server each at the matrix's
    layouts (a server holds one model; all start together, while the in-process job runs), against float64
    transformers."""
    from megatron_opd.testing.tiny_models import make_tiny_tokenizer

    cells = {label: {n: shape_dirs[n] for n in shapes_at(INPROCESS_PATH, label)} for label in MATRIX[INPROCESS_PATH]}
    servers, hidden = {}, {}
    try:
        for layout in MATRIX[SERVER_PATH]:
            for name in shapes_at(SERVER_PATH, layout):
                root = tmp_path / f"{name}@{layout}"
                tokenizer = str(
                    make_tiny_tokenizer(root / "tokenizer", SHAPES[name].vocab_size, exact=True)
                )  # a row a token
                proc = start_teacher_server(shape_dirs[name], tp=SERVER_TP[layout], port=0,
                                            ready_file=root / "ready", log_file=str(root / "server.log"),
                                            extra_args=["--topk", str(K), "--tokenizer", tokenizer])  # fmt: skip
                servers[f"server@{layout}", name] = (proc, root)
        per_rank = run_distributed(_inprocess_layouts_body, 2, args=(cells,), timeout=600)
        results = {}
        for (where, name), (proc, root) in servers.items():
            client = _client(wait_ready(proc, root / "ready", str(root / "server.log")))
            remote, info = client.vocabulary()
            assert len(remote) == info.embedding_rows == SHAPES[name].vocab_size, name
            tokens, request_ids = _inputs(SHAPES[name].vocab_size)
            scores = client.score(tokens, request_ids, LENGTHS).result(timeout=120)
            results[where, name] = (scores.topk_ids, scores.topk_logprobs, scores.requested_logprobs)
            client.close()
            client = _client(client.addresses[0], transfer="hidden")
            if "no_hidden" in info.extra:  # soft-capped final logits (Gemma 2): refused, and why
                with pytest.raises(RequestRefusedError, match="soft-capped.*use teacher.transfer=topk"):
                    client.score(tokens, None, LENGTHS).result(timeout=120)
            else:
                hidden[where, name] = client.score(tokens, None, LENGTHS).result(timeout=120).dense_hidden
            client.close()
    finally:
        for proc, _ in servers.values():
            stop(proc)
    keys = {(label, n) for label, shapes in cells.items() for n in shapes}
    assert per_rank[0].keys() == keys | {("dense", *key) for key in keys}
    dense = {}
    for label, name in keys:
        assert torch.equal(per_rank[0][label, name][0], per_rank[1][label, name][0]), (
            f"{label}/{name}: the ranks disagree"
        )
        results[f"in-process@{label}", name] = per_rank[0][label, name]
        shards = [per_rank[r].pop(("dense", label, name)) for r in (0, 1)]  # TP=1: two data-parallel copies
        dense[f"in-process@{label}", name] = torch.cat(shards, -1) if label == "tp2" else shards[0]
    for (where, name), (ids, logprobs, requested) in results.items():
        vocab = SHAPES[name].vocab_size
        tokens, request_ids = _inputs(vocab)
        ref = _reference64(shape_dirs[name], tokens, vocab)
        assert ids.shape == (4, 12, K) and int(ids.max()) < vocab, (where, name)  # never a padded row
        for row, n in enumerate(LENGTHS):  # a causal model: the real positions do not see the padding after them
            what = f"{where}/{name} row {row}:"
            _assert_topk_close(ids[row, :n], logprobs[row, :n], ref[row, :n], atol=2e-5, what=what)
            torch.testing.assert_close(requested[row, :n].double(), ref[row, :n].gather(-1, request_ids[row, :n]),
                                       atol=2e-5, rtol=0, msg=lambda m, w=what: f"{w} {m}")  # fmt: skip
            if (where, name) in hidden:
                _assert_hidden_gives(hidden[where, name][row, :n], shape_dirs[name], ref[row, :n], vocab, what)
            if (where, name) in dense:
                got = torch.log_softmax(dense[where, name][row, :n, :vocab].double(), dim=-1)
                torch.testing.assert_close(got, ref[row, :n], atol=2e-5, rtol=0,
                                           msg=lambda m, w=what: f"{w} dense: {m}")  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3_moe_dense0", "deepseek_v3_mla"])
def test_moe_teacher_server_at_expert_parallelism_matches_transformers(name, shape_dirs, tmp_path):
    """A Mixture-of-Experts teacher (Qwen3-MoE; DeepSeek-V3: multi-latent attention, group-limited routing with its
    expert bias) served at ``--ep 2``: its two data-parallel replicas score a batch's rows in two shares (3 rows: 1
    and 2; 1 row: replica 0 scores none and keeps its experts' exchanges in step), returned in order, top-k,
    requested and hidden states against float64 transformers."""
    from megatron_opd.testing.tiny_models import make_tiny_tokenizer, routing_margin

    vocab = SHAPES[name].vocab_size
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (3, 10), generator=g)
    request_ids = torch.randint(0, vocab, (3, 10, 2), generator=g)
    assert routing_margin(shape_dirs[name], tokens) > 1e-5, "routing near-tie: would test tie-breaking"
    tokenizer = str(make_tiny_tokenizer(tmp_path / "tokenizer", vocab, exact=True))
    log = str(tmp_path / "server.log")
    proc = start_teacher_server(shape_dirs[name], ep=2, port=0, ready_file=tmp_path / "ready", log_file=log,
                                extra_args=["--topk", str(K), "--tokenizer", tokenizer])  # fmt: skip
    try:
        address = wait_ready(proc, tmp_path / "ready", log)
        ref = _reference(shape_dirs[name], tokens, vocab, 1.0)
        for rows in (slice(0, 3), slice(2, 3)):
            client = _client(address)
            scores = client.score(tokens[rows], request_ids[rows]).result(timeout=120)
            _assert_topk_close(scores.topk_ids, scores.topk_logprobs, ref[rows], atol=2e-5, what=f"rows {rows}")
            torch.testing.assert_close(scores.requested_logprobs.double(), ref[rows].gather(-1, request_ids[rows]),
                                       atol=2e-5, rtol=0)  # fmt: skip
            client.close()
        client = _client(address, transfer="hidden")
        hidden = client.score(tokens, None).result(timeout=120).dense_hidden
        client.close()
        _assert_hidden_gives(hidden, shape_dirs[name], ref, vocab, what="ep2")
    finally:
        stop(proc)
    assert "EP=2" in Path(log).read_text(errors="replace")
