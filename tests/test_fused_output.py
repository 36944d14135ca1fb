"""The output layer fused into the divergence (``loss.fused_output``) against today's path, which multiplies by the
output layer first and runs the same loss on the whole logit shard.

In one process (fp32): every kind x tail x mode x support x reduction, with per-sequence weights, padded vocabulary
columns, a student temperature and the rollout-fidelity monitor; the loss of both paths within float32 rounding
of the float64 loss (a bound derived from the logits' magnitudes, ``_float64_loss_and_float32_bound``) and the
gradients of the hidden states and the output weight within 1e-5 relative; the step statistics equal; chunking and
reductions.
In spawned jobs: the model's hidden-state switch at TP=1, TP=2, TP=2 with sequence parallelism and TP=2 x PP=2,
tied and untied, through Megatron's schedule (gradients of every parameter) and one training step.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from megatron_opd.losses import reduce_loss
from megatron_opd.losses.fused_output import reduction_coefficients
from megatron_opd.trainer.config import LossConfig
from megatron_opd.trainer.objective import make_loss_fn

B, S, H, V, VOCAB, K = 3, 7, 16, 48, 45, 6  # V - VOCAB padded columns never enter


class _Switch:
    """Stands in for ``HiddenStateOutput`` after a forward: the weight the output layer was handed."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


def _micro_batch(mode: str, support: str, gen: torch.Generator) -> dict:
    mask = (torch.rand(B, S, generator=gen) > 0.3).float()
    mask[1] = 0  # a sample with nothing trained
    mb = {
        "loss_mask": mask,
        "labels": torch.randint(0, VOCAB, (B, S), generator=gen),
        "seq_weights": torch.tensor([1.0, 0.5, 2.0]),
        "rollout_logprobs": -torch.rand(B, S, generator=gen) * mask,
    }
    if mode == "dense":
        mb["teacher_logits"] = torch.randn(B, S, V, generator=gen) * 2
    else:
        t = torch.log_softmax(torch.randn(B, S, VOCAB, generator=gen) * 2, dim=-1)
        values, ids = t.topk(K, dim=-1)
        mb["teacher_topk_ids"], mb["teacher_topk_logprobs"] = ids, values
        if support == "union":
            student_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:3] for _ in range(B * S)]).view(B, S, 3)
            mb["student_topk_ids"] = student_ids
            mb["teacher_logprobs_at_student_ids"] = t.gather(-1, student_ids)
    return mb


CASES = [
    (kind, mode, tail, support)
    for kind, mode in itertools.product(("forward_kl", "reverse_kl", "jsd"), ("dense", "topk"))
    for tail, support in (
        [(None, None)]
        if mode == "dense"
        else [
            ("bucket", "teacher_topk"),
            ("renorm", "teacher_topk"),
            ("ignore", "teacher_topk"),
            ("bucket", "union"),
        ]  # fmt: skip
    )
]


@pytest.mark.parametrize("kind,mode,tail,support", CASES)
@pytest.mark.parametrize("reduction,grad_hint", [("token_mean", None), ("sequence_mean", 1.0), ("sum", None)])
def test_fused_equals_the_output_layer_then_the_loss(kind, mode, tail, support, reduction, grad_hint):
    """``grad_hint``: the weight gradient written straight into ``.grad`` (no accumulator), else accumulated."""
    # A seed of the case's own (str hashes change from process to process: the inputs would too).
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, mode, tail, support, reduction)).encode()) % 1000)
    mb = _micro_batch(mode, support or "teacher_topk", gen)
    cfg = LossConfig(kind=kind, mode=mode, tail=tail or "bucket", support=support or "teacher_topk", beta=0.3,
                     reduction=reduction, student_temperature=1.5, chunk_size=4,
                     coverage_weight=0.1 if support == "union" else 0.0)  # fmt: skip
    hidden = torch.randn(B, S, H, generator=gen, requires_grad=True)
    weight = (torch.randn(V, H, generator=gen) / 2).requires_grad_()
    common = dict(vocab_size=VOCAB, teacher_temperature=1.2, normalizer=5.0, scale=2.0)
    results = {}
    for fused in (False, True):
        hidden.grad = weight.grad = None
        if fused:
            loss_fn = make_loss_fn(cfg, output=_Switch(weight), grad_hint=grad_hint, **common)
            loss, stats = loss_fn(hidden, mb)
        else:
            loss_fn = make_loss_fn(cfg, **common)
            loss, stats = loss_fn(hidden @ weight.t(), mb)
        loss.backward()
        results[fused] = (float(loss.detach()), hidden.grad.clone(), weight.grad.clone(), stats)
    (ref_loss, ref_h, ref_w, ref_stats), (loss, grad_h, grad_w, stats) = results[False], results[True]
    exact, bound = _float64_loss_and_float32_bound(cfg, common, hidden, weight, mb, slots=K + 3 * (support == "union"))
    for path, value in (("fused", loss), ("unfused", ref_loss)):
        assert abs(value - exact) <= bound, f"{path}: loss {value!r}, float64 {exact!r}, bound {bound:.2e}"
    for name, got, want in (("hidden", grad_h, ref_h), ("weight", grad_w, ref_w)):
        assert want.abs().max() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        rel = float((got - want).abs().max() / want.abs().max())
        assert rel <= 1e-5, f"gradient of the {name} differs by {rel:.2e}"
    assert grad_w[VOCAB:].abs().max() == 0  # padded vocabulary rows get nothing
    for name, value in stats.as_dict().items():
        assert value == pytest.approx(getattr(ref_stats, name), rel=1e-5, abs=1e-6), name


def _float64_loss_and_float32_bound(cfg, common, hidden, weight, mb, *, slots):
    """The loss of ``hidden @ weight^T`` computed in float64 (today's path on float64 copies: the divergences then
    compute in float64), and how far a float32 evaluation of it may be.

    Float32 rounding (u = 2^-24) enters first in the logits: each is an H-term dot product, off by at most
    H u A_tj with A = |h| |W|^T (the sum of the products' magnitudes). The divergence then rounds in the log-sum-exp
    over the VOCAB columns (a relative error of at most VOCAB u in the sum of exponentials: an absolute VOCAB u in
    every log-probability), in the sums over at most ``slots`` + 1 support slots (the tail bucket) and in the
    reduction over tokens; bounded here as further perturbations of the logits of (VOCAB + slots + 1) u (A_tj + 1)
    each. A perturbation delta of the logits moves the loss by at most sum |dL/dz| |delta|, so
    |L_fp32 - L_fp64| <= u sum_tj |dL/dz_tj| ((H + VOCAB + slots + 1) (A_tj + 1)), with dL/dz from the float64 loss.
    Measured on an AVX-512 EPYC: at most 0.03 of this bound over every case, fused or not (1e-5 to 2e-5 of the
    loss; 1e-3 for reverse KL over the top-k alone, tail=ignore, whose 0.042 is a sum of terms of ~1 per token
    with float32 values off by 1e-5 relative: the loss's own size is no scale there). A real error is far larger:
    dropping the trained token that adds least moves the loss by 22x to 12,000x the bound (float64, every case), a
    student temperature of 1 instead of 1.5 by 4,900x to 47,000x."""
    h64 = hidden.detach().double()
    w64 = weight.detach().double()
    z64 = (h64 @ w64.t()).requires_grad_()
    mb64 = {k: v.double() if v.is_floating_point() else v for k, v in mb.items()}
    loss64, _ = make_loss_fn(cfg, **common)(z64.clone(), mb64)
    (grad_z,) = torch.autograd.grad(loss64, z64)
    magnitude_TV = h64.abs() @ w64.abs().t() + 1.0
    bound = 2.0**-24 * (H + VOCAB + slots + 1) * float((grad_z.abs() * magnitude_TV).sum())
    return float(loss64), bound


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_a_dense_teacher_given_as_hidden_states_and_its_output_weight(kind):
    """The in-process teacher's dense scores are ``[tokens, H]`` hidden states plus its weight shard: the fused loss
    forms the teacher's logits a chunk at a time; equal to handing over ``h_t @ W_t^T`` whole."""
    gen = torch.Generator().manual_seed(4)
    mb = _micro_batch("dense", "teacher_topk", gen)
    teacher_hidden, teacher_weight = torch.randn(B, S, 12, generator=gen), torch.randn(V, 12, generator=gen)
    del mb["teacher_logits"]
    cfg = LossConfig(kind=kind, mode="dense", chunk_size=4)
    hidden = torch.randn(B, S, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    common = dict(vocab_size=VOCAB, teacher_temperature=1.3, normalizer=5.0, scale=1.0)
    fused, _ = make_loss_fn(cfg, output=_Switch(weight), teacher_weight=teacher_weight, **common)(
        hidden, {**mb, "teacher_hidden": teacher_hidden}
    )
    ref, _ = make_loss_fn(cfg, **common)(
        hidden @ weight.t(), {**mb, "teacher_logits": teacher_hidden @ teacher_weight.t()}
    )
    assert float(fused) == pytest.approx(float(ref), rel=1e-6)
    with pytest.raises(ValueError, match="no teacher output weight was given"):
        make_loss_fn(cfg, output=_Switch(weight), **common)(hidden, {**mb, "teacher_hidden": teacher_hidden})


def test_a_gradient_other_than_the_hint_is_refused():
    gen = torch.Generator().manual_seed(2)
    mb = _micro_batch("topk", "teacher_topk", gen)
    hidden = torch.randn(B, S, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    loss_fn = make_loss_fn(LossConfig(mode="topk", topk=K), vocab_size=VOCAB, teacher_temperature=1.0,
                           normalizer=5.0, scale=1.0, output=_Switch(weight), grad_hint=1.0)  # fmt: skip
    loss, _ = loss_fn(hidden, mb)
    with pytest.raises(RuntimeError, match="wrote its weight gradient for an incoming gradient of 1 but got 3"):
        (3 * loss).backward()


def test_a_micro_batch_with_nothing_trained_gives_zero_loss_and_gradients():
    gen = torch.Generator().manual_seed(0)
    mb = _micro_batch("topk", "teacher_topk", gen)
    mb["loss_mask"].zero_()
    hidden = torch.randn(B, S, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    loss_fn = make_loss_fn(LossConfig(mode="topk", topk=K), vocab_size=VOCAB, teacher_temperature=1.0,
                           normalizer=1.0, scale=1.0, output=_Switch(weight))  # fmt: skip
    loss, stats = loss_fn(hidden, mb)
    loss.backward()
    assert float(loss) == 0 and stats.tokens == 0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


@pytest.mark.parametrize("grad_hint", [None, 1.0])
def test_a_frozen_output_weight_gets_no_gradient_and_the_hidden_states_the_same(grad_hint):
    """A LoRA student's output layer is frozen: no weight gradient is formed (nor a ``.grad`` created for the hint),
    and the hidden states' gradient is the trainable weight's."""
    gen = torch.Generator().manual_seed(4)
    mb = _micro_batch("topk", "teacher_topk", gen)
    hidden = torch.randn(B, S, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    grads = {}
    for frozen in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(not frozen)
        loss_fn = make_loss_fn(LossConfig(mode="topk", topk=K, fused_output="on"), vocab_size=VOCAB,
                               teacher_temperature=1.0, normalizer=5.0, scale=1.0, output=_Switch(w),
                               grad_hint=grad_hint)  # fmt: skip
        loss, _ = loss_fn(h, mb)
        loss.backward()
        grads[frozen] = h.grad
        assert (w.grad is None) == frozen
    assert torch.equal(grads[True], grads[False])


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sum"])
def test_reduction_coefficients_reproduce_the_reduction(reduction):
    gen = torch.Generator().manual_seed(1)
    mask = (torch.rand(2, 9, generator=gen) > 0.4).float()
    weights = torch.rand(2, 9, generator=gen)
    segments = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])  # also packed rows: sequence_mean over segment ids
    per_token = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    for segment_ids in (None, segments):
        kwargs = {} if reduction == "sum" else {"normalizer": 3.0, "segment_ids": segment_ids}
        coeff = reduction_coefficients(mask, weights, reduction, **kwargs)
        want = reduce_loss(per_token * weights.double(), mask, reduction, **kwargs)
        assert float((coeff * per_token).sum()) == pytest.approx(float(want), rel=1e-12)


# ---- through Megatron's schedule: the model's hidden-state switch -------------------------------------------------


def _random_topk(batch, vocab: int, k: int = 8) -> dict[str, torch.Tensor]:
    """A teacher's top-k columns for ``batch`` (seeded: the same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    n, s = batch.tokens.shape
    values, ids = torch.log_softmax(torch.randn(n, s, vocab, generator=gen) * 3, dim=-1).topk(k, dim=-1)
    return {"teacher_topk_ids": ids, "teacher_topk_logprobs": values}


def _switch_body(layout: dict, dirs: dict[str, str], packed: bool):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.interfaces import TeacherScores
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.output import HiddenStateOutput
    from megatron_opd.testing.shapes import SHAPES
    from tests.test_packing import _batch, step_losses

    parallel = ParallelConfig(**layout)
    initialize_distributed(parallel)
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    one_stage = ps.get_pipeline_model_parallel_world_size() == 1
    out = {}
    for name, hf_dir in dirs.items():
        vocab = SHAPES[name].vocab_size
        batch = _batch(vocab)
        columns = _random_topk(batch, vocab)
        if packed:
            micro_batches = batch.packed_micro_batches(
                2, columns, pad_multiple=tp, token_budget=None if one_stage else 68
            )
        else:
            micro_batches = batch.micro_batches(2, columns, trim=one_stage, pad_multiple=8 * tp)
        cfg = LossConfig(kind="jsd", mode="topk", topk=8, beta=0.3, reduction="sequence_mean", chunk_size=16)
        chunks = build_and_load(hf_dir, parallel, trainable=True)[1]
        switch = HiddenStateOutput(chunks)
        grads, stats = {}, {}
        for fused in (False, True):
            for chunk in chunks:
                chunk.zero_grad()
            loss_fn = make_loss_fn(cfg, vocab_size=vocab, teacher_temperature=1.0, normalizer=3.0, scale=1.0,
                                   output=switch if fused else None,
                                   grad_hint=1 / len(micro_batches) if fused else None)  # fmt: skip
            if fused:
                with switch.active():
                    outputs = forward_backward(chunks, micro_batches, loss_fn)
            else:
                outputs = forward_backward(chunks, micro_batches, loss_fn)
            for chunk in chunks:  # sequence-parallel norms: each TP rank holds its tokens' share
                for param in chunk.parameters():
                    if getattr(param, "sequence_parallel", False) and param.grad is not None:
                        dist.all_reduce(param.grad, group=tp_group)
            grads[fused] = {  # this rank's shards (the tied output weight's copy on the last stage included)
                (i, name): param.grad.clone()
                for i, chunk in enumerate(chunks)
                for name, param in chunk.named_parameters()
            }
            stats[fused] = [s.as_dict() for s in outputs]
        # Outside the block the model gives logits again.
        logits = chunks[-1](batch.tokens[:2, :8], torch.arange(8)[None].expand(2, 8), None) if one_stage else None
        # Two training steps, fused against today's path.
        losses = {}
        scores = TeacherScores(topk_ids=columns["teacher_topk_ids"], topk_logprobs=columns["teacher_topk_logprobs"])
        for fused_output in ("off", "on"):
            cfg_step = LossConfig(kind="jsd", mode="topk", topk=8, beta=0.3, fused_output=fused_output)
            losses[fused_output] = step_losses(hf_dir, parallel, batch, scores, cfg_step, vocab, packed, 2)
        out[name] = (grads, stats, None if logits is None else tuple(logits.shape), losses)
    return out


SWITCH_LAYOUTS = {
    "tp1": (1, dict(), False),
    "tp2": (2, dict(tensor_model_parallel_size=2), False),
    "tp2_sp_packed": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), True),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), False),
}


@pytest.mark.parametrize("layout", list(SWITCH_LAYOUTS))
def test_hidden_state_switch_through_megatron(layout, tmp_path):
    """Tied (``llama_tied``: the gradient reaches the shared embedding) and untied with padded vocabulary rows
    (``qwen2_mha_v97``): every parameter's gradient within 1e-5 relative, the statistics and two steps' losses
    within 1e-6."""
    from megatron_opd.testing.multiprocess import run_distributed
    from megatron_opd.testing.shapes import make_shapes

    dirs = make_shapes(tmp_path, ("llama_tied", "qwen2_mha_v97"))
    world, kwargs, packed = SWITCH_LAYOUTS[layout]
    results = run_distributed(_switch_body, world, args=(kwargs, dirs, packed), timeout=400)
    for name in dirs:
        for rank, rank_out in enumerate(results):
            grads, stats, logits_shape, losses = rank_out[name]
            for ref, got in zip(stats[False], stats[True]):
                for key, value in ref.items():
                    assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), f"{layout}/{name}: {key}"
            if logits_shape is not None:  # outside the switch: logits again
                assert logits_shape[-1] >= SHAPES_VOCAB[name] // kwargs.get("tensor_model_parallel_size", 1)
            assert set(grads[True]) == set(grads[False])
            assert sum(bool(g.abs().max() > 0) for g in grads[False].values()) >= len(grads[False]) - 2  # padded shards
            for param, ref in grads[False].items():
                if ref.abs().max() == 0:  # an embedding shard of padded rows only (vocabulary 97 at TP=2)
                    assert grads[True][param].abs().max() == 0, f"{layout}/{name}: {param} on rank {rank}"
                    continue
                rel = float((grads[True][param] - ref).abs().max() / ref.abs().max())
                assert rel <= 1e-5, f"{layout}/{name}: gradient of {param} on rank {rank} differs by {rel:.2e}"
        losses = results[-1][name][3]  # the last rank: the last pipeline stage
        assert losses["on"] == pytest.approx(losses["off"], rel=1e-6), f"{layout}/{name}: {losses}"
        assert losses["off"][1] != losses["off"][0]


SHAPES_VOCAB = {"llama_tied": 1001, "qwen2_mha_v97": 97}


def test_config_refuses_the_fused_output_layer_where_it_cannot_apply():
    from megatron_opd.trainer.objective import fused_output_applies

    with pytest.raises(ValueError, match="loss.fused_output=on fuses the output layer into a distillation"):
        LossConfig(kind="sft", fused_output="on")
    with pytest.raises(ValueError, match="loss.fused_output must be auto, on or off"):
        LossConfig(fused_output="yes")
    assert fused_output_applies(LossConfig()) and not fused_output_applies(LossConfig(fused_output="off"))
    assert not fused_output_applies(LossConfig(kind="sft"))  # auto: SFT keeps the output layer


def test_fp32_hidden_states_meet_a_bf16_weight():
    """Megatron's Float16Module returns the last stage's output in fp32 while the weight is bf16 (GPU runs)."""
    gen = torch.Generator().manual_seed(3)
    mb = _micro_batch("topk", "teacher_topk", gen)
    hidden = torch.randn(B, S, H, generator=gen, requires_grad=True)
    weight = (torch.randn(V, H, generator=gen) / 2).bfloat16().requires_grad_()
    cfg = LossConfig(mode="topk", topk=K)
    common = dict(vocab_size=VOCAB, teacher_temperature=1.0, normalizer=5.0, scale=1.0)
    fused, _ = make_loss_fn(cfg, output=_Switch(weight), grad_hint=1.0, **common)(hidden, mb)
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref, _ = make_loss_fn(cfg, **common)(hidden.bfloat16() @ weight.t(), mb)
    ref.backward()
    assert float(fused) == pytest.approx(float(ref), rel=1e-2)
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0], hidden.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(grads[1].float(), weight.grad.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind,mode,tail", [("reverse_kl", "topk", "bucket"), ("forward_kl", "topk", "ignore"),
                                            ("jsd", "dense", None)])  # fmt: skip
def test_fused_on_the_gpu(kind, mode, tail, dtype):
    """On a GPU (the loss's Triton kernels, cuBLAS chunk products) at a real vocabulary width: fp32 as tight as on
    CPU; bf16 within bounds set from the H100 (the fused path rounds the same products, chunk by chunk)."""
    b, s, h, v, vocab, k = 2, 300, 256, 8192, 8000, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    mask = (torch.rand(b, s, generator=gen, device="cuda") > 0.2).float()
    mb = {"loss_mask": mask, "labels": torch.randint(0, vocab, (b, s), generator=gen, device="cuda"),
          "seq_weights": torch.tensor([1.0, 0.5], device="cuda")}  # fmt: skip
    if mode == "dense":
        mb["teacher_logits"] = (torch.randn(b, s, v, generator=gen, device="cuda") * 2).to(torch_dtype)
    else:
        t = torch.log_softmax(torch.randn(b, s, vocab, generator=gen, device="cuda") * 2, dim=-1)
        mb["teacher_topk_logprobs"], mb["teacher_topk_ids"] = t.topk(k, dim=-1)
    cfg = LossConfig(kind=kind, mode=mode, topk=k, tail=tail or "bucket", chunk_size=128)
    hidden = torch.randn(b, s, h, generator=gen, device="cuda").to(torch_dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, device="cuda") / 8).to(torch_dtype).requires_grad_()
    common = dict(vocab_size=vocab, teacher_temperature=1.0, normalizer=float(mask.sum()), scale=1.0)
    results = []
    for fused in (False, True):
        hidden.grad = weight.grad = None
        if fused:
            loss, _ = make_loss_fn(cfg, output=_Switch(weight), grad_hint=1.0, **common)(hidden, mb)
        else:
            loss, _ = make_loss_fn(cfg, **common)(hidden @ weight.t(), mb)
        loss.backward()
        results.append((float(loss), hidden.grad.float(), weight.grad.float()))
    (ref, ref_h, ref_w), (got, got_h, got_w) = results
    bound = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 3e-2)}[dtype]
    rel_h = float((got_h - ref_h).norm() / ref_h.norm())
    rel_w = float((got_w - ref_w).norm() / ref_w.norm())
    print(f"{kind} {mode} {dtype}: loss {abs(got - ref) / abs(ref):.2e}, grad h {rel_h:.2e}, grad W {rel_w:.2e}")
    assert abs(got - ref) <= bound[0] * abs(ref)
    assert rel_h <= bound[1] and rel_w <= bound[1]
