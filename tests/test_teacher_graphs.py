"""``teacher.cuda_graphs`` on CPU: the bucketed forward (padding to a (rows, length) bucket, copying the real rows out)
through the eager runner gives the unpadded teacher's scores for a dense and an MoE (MLA) teacher at lengths crossing
buckets, makes one runner per bucket and no host sync inside it (what a capture needs), runs a micro-batch beyond the
largest bucket eagerly with one log line, and the settings it cannot run with are refused by name before a model is
built. The capture itself (``graphs.cuda_graph_runner``) runs in ``benchmarks/gpu/check.py``'s #57 rows."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed

SHAPES_RUN = ("qwen3_tied", "deepseek_v3_mla")
"""A dense teacher, and an MoE one with multi-latent attention and a dense first layer (fused routing)."""
LENGTHS = (8, 16)
"""Length buckets of the test; the cases below cross them and go beyond the last."""
CASES = ((3, 5), (1, 8), (4, 9), (2, 16), (3, 21))
"""(rows, length) of each scored batch: inside, at and across the buckets; 21 > 16 runs eagerly."""


def _all_scores() -> dict:
    """:func:`_scores` of every shape of ``SHAPES_RUN``, in one process (one start)."""
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig())
    out = {shape: _scores(shape) for shape in SHAPES_RUN}
    out["control"] = _scores(SHAPES_RUN[-1], fused_routing=False, cases=CASES[:1])  # Megatron's MoE layer: syncs
    return out


def _scores(shape: str, fused_routing: bool = True, cases=CASES) -> dict:
    """Per case: the eager teacher's and the bucketed teacher's top-k and requested log-probabilities, the buckets
    made, and the host syncs inside the bucketed runs."""
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.teacher.graphs import BucketedForward, eager_runner
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.testing.host_sync import count_host_syncs
    from megatron_opd.testing.moe_profile import build_shape

    torch.manual_seed(0)
    arch, model = build_shape(shape, ModelBuildConfig(moe_fused_routing=fused_routing))
    model.requires_grad_(False)
    syncs: list[str] = []

    def counting_runner(forward, tokens, positions):
        run = eager_runner(forward, tokens, positions)

        def counted(t, p):
            with count_host_syncs(syncs):
                return run(t, p)

        return counted

    graphs = BucketedForward(LENGTHS, 4, counting_runner)
    eager = InProcessTeacher([model], vocab_size=arch.vocab_size, mode="topk", topk=4, micro_batch_size=4)
    bucketed = InProcessTeacher([model], vocab_size=arch.vocab_size, mode="topk", topk=4, micro_batch_size=4,
                                graphs=graphs)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    out = {}
    for rows, length in cases:
        tokens = torch.randint(0, arch.vocab_size, (rows, length), generator=gen)
        requested = torch.randint(0, arch.vocab_size, (rows, length, 2), generator=gen)
        a, b = (t.score(tokens, requested).result() for t in (eager, bucketed))
        out[rows, length] = [(x.topk_ids, x.topk_logprobs, x.requested_logprobs) for x in (a, b)]
    return {"scores": out, "buckets": sorted(k[1:] for k in graphs.runners), "syncs": syncs}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_scores, 1, timeout=300)[0]


@pytest.mark.parametrize("shape", SHAPES_RUN)
def test_bucketed_scores_equal_the_unpadded_teacher_s(results, shape):
    for case, ((ids0, lp0, req0), (ids1, lp1, req1)) in results[shape]["scores"].items():
        assert lp1.shape == lp0.shape == (*case, 4)
        assert torch.equal(ids0, ids1), case
        torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-6, msg=f"{shape} {case}")
        torch.testing.assert_close(req1, req0, rtol=0, atol=1e-6, msg=f"{shape} {case}")


@pytest.mark.parametrize("shape", SHAPES_RUN)
def test_one_runner_per_bucket_and_no_host_sync_inside(results, shape):
    # (3, 5) -> 4 x 8, (1, 8) -> 1 x 8, (4, 9) -> 4 x 16, (2, 16) -> 2 x 16; (3, 21) runs eagerly, outside them.
    assert results[shape]["buckets"] == [(1, 8), (2, 16), (4, 8), (4, 16)]
    assert results[shape]["syncs"] == [], results[shape]["syncs"]
    assert results["control"]["syncs"], "the counter sees Megatron's MoE layer's host syncs"


def test_beyond_the_largest_bucket_runs_eagerly_with_one_log_line(caplog):
    from megatron_opd.teacher.graphs import BucketedForward

    made = []
    graphs = BucketedForward(
        (4, 8), 2, lambda forward, t, p: made.append(t.shape) or (lambda t, p: forward(t, p, None))
    )

    def forward(tokens, positions, mask):  # a causal stand-in: each output is its row's running sum
        return (tokens * 10 + positions).cumsum(-1)

    tokens = torch.arange(30).view(3, 10)
    positions = torch.arange(10).expand(3, 10)
    with caplog.at_level(logging.WARNING, logger="megatron_opd.teacher.graphs"):
        for _ in range(2):
            assert torch.equal(graphs(forward, "v", tokens, positions), forward(tokens, positions, None))
            assert torch.equal(
                graphs(forward, "v", tokens[:2, :7], positions[:2, :7]), forward(tokens, positions, None)[:2, :7]
            )
    assert made == [(2, 8)] and sum("beyond the largest bucket" in r.message for r in caplog.records) == 1


def test_row_buckets_and_length_checks():
    from megatron_opd.teacher.graphs import check_lengths, row_buckets

    assert row_buckets(8) == (1, 2, 4, 8) and row_buckets(6) == (1, 2, 4, 6) and row_buckets(1) == (1,)
    for bad in ([], [16, 8], [8, 8], [0, 8], list(range(1, 10))):
        with pytest.raises(ValueError, match="teacher.cuda_graph_lengths"):
            check_lengths(bad)


def test_refusals_name_the_setting_before_a_model_is_built(capsys):
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.teacher.config import TeacherConfig
    from megatron_opd.teacher.graphs import bucketed_teacher_forward, check_capturable
    from megatron_opd.teacher.serve import parse_args
    from megatron_opd.testing.tiny_models import tiny_hf_config

    with pytest.raises(ValueError, match="cuda_graph_lengths"):
        TeacherConfig(cuda_graphs=True, cuda_graph_lengths=[])
    with pytest.raises(ValueError, match="needs a CUDA device"):
        bucketed_teacher_forward((8,), 2, torch.device("cpu"))
    moe = architecture_from_hf_config(tiny_hf_config("qwen3_moe").to_dict(), "qwen3_moe")
    with pytest.raises(ValueError, match="build.moe_fused_routing=true"):
        check_capturable(moe, moe_fused_routing=False)
    check_capturable(moe, moe_fused_routing=True)
    for flags, named in ((["--pp", "2"], "--pp 2"), (["--device", "cpu"], "--device cpu")):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--cuda-graphs", *flags])
        assert (
            f"--cuda-graphs captures one forward per padded shape on CUDA: not with {named}" in capsys.readouterr().err
        )
    assert parse_args(["--model", "m", "--cuda-graphs"]).packing is False  # one shape per bucket: padded


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"train.packing": True}, "train.packing=true"),
        ({"parallel.pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size=2"),
        ({"teacher.offload": True}, "teacher.offload=true"),
        ({"device": "cpu"}, "device=cpu"),
        (
            {"parallel.tensor_model_parallel_size": 2, "teacher.cuda_graph_lengths": [9, 16]},
            r"teacher.cuda_graph_lengths=\[9, 16\] not all multiples of tensor_model_parallel_size=2",
        ),
    ],
)
def test_train_config_refuses_layouts_without_static_shapes(overrides, named):
    from megatron_opd.trainer.config import TrainConfig

    cfg = TrainConfig()
    cfg.student.path = cfg.teacher.path = "m"
    cfg.data.train_files = ["d.jsonl"]
    cfg.train.packing = False
    cfg.teacher.cuda_graphs = True
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(cfg, section) if section else cfg, name, value)
    with pytest.raises(ValueError, match=f"teacher.cuda_graphs=true cannot run with .*{named}"):
        cfg.validate()


def test_check_inputs_refuses_before_any_model(tmp_path):
    """The trainer's start-up checks (no process group, no model yet): an MoE teacher without fused routing, then a
    machine without CUDA."""
    from megatron_opd.config import parse_args
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import check_inputs

    moe = make_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=0)
    make_tiny_tokenizer(moe, vocab_size=1000)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    base = [f"student.path={moe}", f"teacher.path={moe}", f"data.train_files={tmp_path / 'train.jsonl'}",
            "data.eval_files=", "train.packing=false", "teacher.cuda_graphs=true"]  # fmt: skip
    with pytest.raises(ValueError, match="teacher.cuda_graphs with a Mixture-of-Experts teacher needs build.moe_fused"):
        check_inputs(parse_args(TrainConfig, base))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="teacher.cuda_graphs=true needs a CUDA device, and this run's is cpu"):
            check_inputs(parse_args(TrainConfig, [*base, "build.moe_fused_routing=true"]))
