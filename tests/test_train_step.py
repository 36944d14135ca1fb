"""A distillation step under TP=2, TP=2xPP=2 and DP=2 equals TP=1 (loss and updated parameters), given the same
rollouts, and its rollout-fidelity sums (the trainer's log-probability of each sampled token, read in the loss pass
at temperature 1, also with loss.student_temperature != 1) equal a float64 transformers reference at every layout;
the in-process teacher's top-k equals torch.topk over transformers' log-softmax."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_opd.distributed import ParallelConfig
from megatron_opd.testing.host_sync import count_host_reads
from megatron_opd.testing.multiprocess import run_distributed

N, S = 4, 16


def _fixed_batch():
    """Four samples with different prompt and response lengths (fixed seed), padded to S."""
    from megatron_opd.data.batch import pack

    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for p_len, r_len in [(3, 9), (5, 4), (2, 12), (6, 7)]:
        prompts.append(torch.randint(0, 1000, (p_len,), generator=gen))
        responses.append(torch.randint(0, 1000, (r_len,), generator=gen))
    masks = [torch.ones(r.numel()) for r in responses]
    masks[3][2:4] = 0  # tool tokens: never trained
    logprobs = [-3 - torch.rand(r.numel(), generator=gen) for r in responses]  # "the sampler's" values
    return pack(prompts, responses, masks, pad_token_id=0, seq_len=S, logprobs=logprobs)


def _counting_forward_backward(reads: list[str]):
    """``Student.step``'s micro-batch loop (Megatron's schedule over every micro-batch), counting host reads."""
    from megatron_opd.trainer import student

    real = student.forward_backward

    def forward_backward(*args, **kwargs):
        with count_host_reads(reads):
            return real(*args, **kwargs)

    return forward_backward


def _step_body(layout: dict, dirs: dict[str, str]):
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.models import load_architecture
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.teacher.inprocess import InProcessTeacher
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    parallel = ParallelConfig(**layout)
    initialize_distributed(parallel)
    tp = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    results = {}
    # A sharp teacher (temperature 0.1) keeps the top-k divergence O(1): two random tiny models are otherwise so
    # close that the loss is a float32 cancellation of much larger terms.
    # The top-k case trains at student temperature 2: the monitor then takes its own logsumexp at temperature 1.
    for mode, kind, temperature, t_student in [("dense", "jsd", 1.0, 1.0), ("topk", "reverse_kl", 0.1, 2.0)]:

        def load(path, trainable):
            return build_and_load(path, parallel, trainable=trainable)[1]

        optim = OptimConfig(lr=1e-3, clip_grad=0.5)
        student = Student(load(dirs["student"], True), optim, precision_plan(optim, detect_accelerator("cpu")), 10)
        teacher = InProcessTeacher(
            load(dirs["teacher"], False),
            vocab_size=1000,
            mode=mode,
            topk=16,
            temperature=temperature,
            micro_batch_size=2,
        )
        batch = _fixed_batch()
        per_rank = N // dp_size
        batch.tokens = batch.tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        batch.loss_mask = batch.loss_mask[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        batch.rollout_logprobs = batch.rollout_logprobs[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        batch.seq_weights = torch.tensor([1.0, 0.5, 2.0, 1.5])[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        scores = teacher.score(batch.tokens).result()
        loss_cfg = LossConfig(kind=kind, mode=mode, topk=16, beta=0.3, student_temperature=t_student)
        reads: list[str] = []
        with mock.patch("megatron_opd.trainer.student.forward_backward", _counting_forward_backward(reads)):
            result = train_step(
                student,
                batch,
                scores,
                loss_cfg,
                vocab_size=1000,
                teacher_temperature=1.0,
                micro_batch_size=min(2, per_rank),
            )
        params = full_tensors(student.chunks, load_architecture(dirs["student"]), ps.get_tensor_model_parallel_group())
        params = params if tp[1] == 0 and dp_rank == 0 else {}
        results[mode] = (result.stats.loss, result.grad_norm, params)
        results[f"{mode}_stats"] = result.stats.as_dict()
        results[f"{mode}_host_reads"] = reads
    return results


LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "dp2": (2, dict()),
}


@pytest.fixture(scope="module")
def student_teacher(tmp_path_factory):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("pair")
    return {
        "teacher": str(make_tiny_hf_model("qwen3", root / "teacher", seed=0)),
        "student": str(make_tiny_hf_model("qwen3", root / "student", seed=1, num_hidden_layers=2)),
    }


@pytest.fixture(scope="module")
def tp1_reference(student_teacher):
    return run_distributed(_step_body, 1, args=({}, student_teacher), timeout=300)[0]


def _merge(per_rank: list[dict]) -> dict:
    merged = {}
    for mode in ("dense", "topk"):
        losses = {r[mode][0] for r in per_rank}
        params = {}
        for r in per_rank:
            params.update(r[mode][2])
        merged[mode] = (per_rank[0][mode][0], per_rank[0][mode][1], params, losses)
    return merged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_equals_tp1(layout, student_teacher, tp1_reference):
    world, kwargs = LAYOUTS[layout]
    per_rank = run_distributed(_step_body, world, args=(kwargs, student_teacher), timeout=240)
    _check_fidelity_sums(per_rank, student_teacher["student"])
    ours = _merge(per_rank)
    for mode in ("dense", "topk"):
        ref_loss, ref_norm, ref_params = tp1_reference[mode]
        loss, norm, params, losses = ours[mode]
        assert len(losses) == 1, f"{layout}/{mode}: ranks disagree on the loss: {losses}"
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{layout}/{mode}: loss {loss} vs TP=1 {ref_loss}"
        assert abs(norm - ref_norm) <= 1e-4 * ref_norm, f"{layout}/{mode}: grad norm {norm} vs {ref_norm}"
        assert set(params) == set(ref_params), f"{layout}/{mode}: parameter names differ"
        for name, ref in ref_params.items():
            # Relative in norm: Adam's first step divides by |g| + eps, so single elements whose gradient is ~eps
            # can move by a few 1e-6 between layouts while the tensor as a whole agrees to ~1e-7.
            err = ((params[name] - ref).norm() / ref.norm()).item()
            assert err <= 1e-5, f"{layout}/{mode}: {name} differs by {err:.2e} (relative, in norm)"


def _check_fidelity_sums(results: list[dict], student_dir: str) -> None:
    """Every rank's fidelity sums equal ``fidelity_sums`` over a float64 transformers forward of the whole batch."""
    from megatron_opd.models.reference import hf_logits
    from megatron_opd.rollout.fidelity import fidelity_sums

    batch = _fixed_batch()
    logits = hf_logits(student_dir, batch.tokens).double()
    reference = torch.log_softmax(logits, -1).gather(-1, batch.next_tokens()[..., None])[..., 0]
    expected = fidelity_sums(reference, batch.rollout_logprobs, batch.loss_mask)
    assert expected["fidelity_tokens"] == float((batch.loss_mask != 0).sum())
    for mode in ("dense", "topk"):
        for rank, r in enumerate(results):
            for name, value in expected.items():
                got = r[f"{mode}_stats"][name]
                assert got == pytest.approx(value, rel=1e-5, abs=1e-5), f"rank {rank}, {mode}: {name} {got} vs {value}"


def test_fidelity_sums_match_transformers(student_teacher, tp1_reference):
    _check_fidelity_sums([tp1_reference], student_teacher["student"])


def test_step_changes_parameters(student_teacher, tp1_reference):
    """Guard against a vacuous comparison: the step really moved the student (by lr-sized amounts)."""
    from safetensors.torch import load_file

    initial = load_file(f"{student_teacher['student']}/model.safetensors")
    updated = tp1_reference["dense"][2]["decoder.final_layernorm.weight"]
    assert (updated - initial["model.norm.weight"]).abs().max() > 1e-4


def _topk_body(layout: dict, teacher_dir: str, tokens: torch.Tensor, temperature: float):
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import initialize_distributed
    from megatron_opd.teacher.inprocess import InProcessTeacher

    parallel = ParallelConfig(**layout)
    initialize_distributed(parallel)
    arch, chunks = build_and_load(teacher_dir, parallel, trainable=False)
    teacher = InProcessTeacher(chunks, vocab_size=arch.vocab_size, mode="topk", topk=20, temperature=temperature)
    request = torch.roll(tokens, -1, dims=1).unsqueeze(-1)
    scores = teacher.score(tokens, request).result()
    if scores.topk_ids is None or ps.get_tensor_model_parallel_rank() != 0:
        return None
    return scores.topk_ids, scores.topk_logprobs, scores.requested_logprobs


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_teacher_topk_matches_transformers(temperature, tiny_model_dirs):
    from megatron_opd.models.reference import hf_logits

    teacher_dir = tiny_model_dirs["qwen3"]  # vocab 1001: padded columns must never enter the top-k
    tokens = torch.randint(0, 1001, (4, 12), generator=torch.Generator().manual_seed(3))
    results = run_distributed(
        _topk_body, 2, args=(dict(tensor_model_parallel_size=2), teacher_dir, tokens, temperature)
    )
    ids, logprobs, requested = next(r for r in results if r is not None)
    ref = torch.log_softmax(hf_logits(teacher_dir, tokens).double() / temperature, dim=-1)
    ref_values, ref_ids = torch.topk(ref, 20, dim=-1)
    assert ids.max() < 1001
    torch.testing.assert_close(logprobs.double(), ref_values, atol=2e-5, rtol=0)
    # Ids agree except where neighbouring log-probabilities tie within float32 noise.
    mismatch = ids != ref_ids
    gap = (ref_values[mismatch] - ref.gather(-1, ids)[mismatch]).abs()
    assert gap.numel() == 0 or gap.max() < 1e-5, f"top-k ids differ beyond ties: {gap.max():.2e}"
    ref_requested = ref.gather(-1, torch.roll(tokens, -1, dims=1).unsqueeze(-1))
    torch.testing.assert_close(requested.double(), ref_requested, atol=2e-5, rtol=0)


def test_no_host_read_in_micro_batch_loop(tp1_reference):
    """The loss function keeps a micro-batch's statistics on the device: Megatron's schedule over the step's
    micro-batches reads no tensor to the host (on a GPU each read is a sync, which also stalls pipeline schedules);
    the step's totals are read once after the last micro-batch (``sum_stats``)."""
    reads: list[str] = []
    with count_host_reads(reads):  # the fake sees a read
        float(torch.ones(()))
    assert len(reads) == 1 and reads[0].startswith("__float__ at ")
    for mode in ("dense", "topk"):
        # Left: the torch back end's top-k gather, the CPU path (CUDA tensors run the Triton kernels, no nonzero).
        reads = [r for r in tp1_reference[f"{mode}_host_reads"] if not r.endswith(" in _local_positions")]
        assert reads == [], mode
