"""The losses under 1, 2 and 4 gloo ranks against the float64 single-process full-vocabulary reference.

Each rank builds the same full-vocabulary data from a shared seed, keeps its ``V/TP`` shard, and compares its loss
and its shard's gradient with the reference (autograd through ``test_losses.reference_*``). One spawned job per
world size loops over every kind x mode x tail x dtype x temperature x chunking case and returns all errors, since
each spawn costs seconds. A last job initialises Megatron-Core at TP=2 x DP=2 and checks ``group=None`` picks the
tensor-parallel group, not the world.

Shape legend: ``T`` tokens, ``V`` padded global vocabulary, ``K`` teacher top-k, ``R`` student top-k.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_opd.losses import dense_divergence, topk_divergence, union_divergence
from megatron_opd.losses.vocab_parallel import resolve_group
from megatron_opd.testing.multiprocess import run_distributed
from tests.test_losses import make_topk, make_union, reference_dense, reference_topk, reference_union, rel_err

KINDS = ("forward_kl", "reverse_kl", "jsd")
TAILS = ("bucket", "renorm", "ignore")
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}


def _case_data(seed: int, n_tokens: int, padded: int, vocab_size: int, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student_TV = torch.randn(n_tokens, padded, generator=g, dtype=torch.float64) * 2.5
    teacher_TV = torch.randn(n_tokens, padded, generator=g, dtype=torch.float64) * 2.5
    # Top-k from the teacher's full-vocabulary distribution: its true top-k on even tokens, random ids (top-k mass
    # far below 1) on odd ones.
    ids_top, lp_top = make_topk(teacher_TV[:, :vocab_size], k, g, low_mass=False)
    ids_rand, lp_rand = make_topk(teacher_TV[:, :vocab_size], k, g, low_mass=True)
    odd_T1 = (torch.arange(n_tokens) % 2 == 1)[:, None]
    # Union: the student's own top ids (some repeating the teacher's, some -1) and the teacher's log-probs at them.
    union = make_union(student_TV, teacher_TV[:, :vocab_size], k, max(2, k - 2), g)
    return {
        "student": student_TV,
        "teacher": teacher_TV,
        "ids": torch.where(odd_T1, ids_rand, ids_top),
        "logprobs": torch.where(odd_T1, lp_rand, lp_top),
        "weights": torch.randn(n_tokens, generator=g, dtype=torch.float64),
        "union_teacher_ids": union[0],
        "union_teacher_logprobs": union[1],
        "student_ids": union[2],
        "logprobs_at_student_ids": union[3],
    }


def _shard_errors(
    data: dict[str, torch.Tensor],
    vocab_size: int,
    group: dist.ProcessGroup | None,
    tp_rank: int,
    tp_size: int,
    label: str,
) -> list[tuple[str, float, float, float]]:
    """Every case on this rank: (name, loss error, gradient error, tolerance)."""
    padded = data["student"].shape[1]
    width = padded // tp_size
    cols = slice(tp_rank * width, (tp_rank + 1) * width)
    weights_T = data["weights"]
    out = []
    references: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # in place and not share a reference
    for dtype in (torch.float64, torch.float32):
        student_TV = data["student"].to(dtype)
        teacher_TV = data["teacher"].to(dtype)
        logprobs_TK = data["logprobs"].to(dtype)
        union_lp = (data["union_teacher_logprobs"].to(dtype), data["logprobs_at_student_ids"].to(dtype))
        # In place (as the trainer calls them): the torch path keeps the student's exponentials in its logits.
        for ts, tt, chunk, inplace in (
            (1.0, 1.0, None, False),
            (1.6, 0.7, 4, False),
            (1.6, 0.7, 4, True),
            (1.0, 1.0, None, True),
        ):
            modes = (
                [("dense", kind, None) for kind in KINDS]
                + [("topk", kind, tail) for kind in KINDS for tail in TAILS]
                + [("union", kind, tail) for kind in KINDS for tail in TAILS]
            )
            for mode, kind, tail in modes:
                leaf_TV = student_TV[:, cols].clone().requires_grad_(True)
                x_TV = leaf_TV * 1.0 if inplace else leaf_TV  # in place needs a non-leaf, as a model's logits are
                ref_x_TV = student_TV.double().clone().requires_grad_(True)
                key = (mode, kind, tail, dtype, ts, tt)
                common = dict(beta=0.3, student_temperature=ts, chunk_size=chunk, group=group, vocab_size=vocab_size)
                common["inplace_backward"] = inplace
                if mode == "dense":
                    loss_T = dense_divergence(x_TV, teacher_TV[:, cols], kind, teacher_temperature=tt, **common)
                    ref_T = reference_dense(ref_x_TV, teacher_TV, kind, 0.3, ts, tt, vocab_size)
                elif mode == "topk":
                    loss_T = topk_divergence(x_TV, data["ids"], logprobs_TK, kind, tail=tail, **common)
                    ref_T = reference_topk(ref_x_TV, data["ids"], logprobs_TK, kind, 0.3, tail, ts, vocab_size)
                else:
                    # The coverage term on the cases with a student temperature.
                    coverage = 0.4 if ts != 1.0 else 0.0
                    ids = (data["union_teacher_ids"], union_lp[0], data["student_ids"], union_lp[1])
                    loss_T = union_divergence(
                        x_TV, ids[0], ids[1], ids[2], ids[3], kind, tail=tail, coverage_weight=coverage, **common
                    )
                    if key not in references:  # the per-token reference is slow: once per case
                        ref_T = reference_union(ref_x_TV, *ids, kind, 0.3, tail, ts, vocab_size, coverage)
                (loss_T * weights_T.to(loss_T.dtype)).sum().backward()
                if key not in references:
                    (ref_T * weights_T).sum().backward()
                    references[key] = (ref_T.detach(), ref_x_TV.grad)
                ref_T, ref_grad_TV = references[key]
                name = (
                    f"{label} {mode} {kind} {tail or ''} {str(dtype)[6:]} T=({ts},{tt}) chunk={chunk} inplace={inplace}"
                )
                grad_err = rel_err(leaf_TV.grad, ref_grad_TV[:, cols])
                out.append((name, rel_err(loss_T, ref_T), grad_err, TOLERANCE[dtype]))
    return out


def _world_job() -> list[tuple[str, float, float, float]]:
    """All cases on WORLD, with padding that spills into the last shard and one layout where a shard is empty."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = []
    # 13 tokens (not a multiple of the chunk), 37 columns per rank, 5 padding columns.
    data = _case_data(seed=11, n_tokens=13, padded=37 * world, vocab_size=37 * world - 5, k=6)
    errors += _shard_errors(data, 37 * world - 5, group, rank, world, "pad5")
    # Width 10 per rank and a vocabulary ending 2 columns into the second-to-last shard: the last rank of a
    # 2- or 4-rank group holds only padding.
    if world > 1:
        vocab_size = 10 * (world - 2) + 8 if world > 2 else 8
        data = _case_data(seed=12, n_tokens=5, padded=10 * world, vocab_size=vocab_size, k=3)
        errors += _shard_errors(data, vocab_size, group, rank, world, "empty-shard")
    # Every rank must return the very same loss (it is replicated, not partial).
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    loss = dense_divergence(x, x.flip(-1), "jsd", group=group)
    gathered = [torch.empty_like(loss) for _ in range(world)]
    dist.all_gather(gathered, loss, group=group)
    errors.append(("replicated", max(float((g - loss).abs().max()) for g in gathered), 0.0, 0.0))
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_full_vocabulary_reference(world_size: int) -> None:
    per_rank = run_distributed(_world_job, world_size, timeout=240)
    failures = []
    for rank, errors in enumerate(per_rank):
        assert len(errors) >= 25
        for name, loss_err, grad_err, tol in errors:
            if loss_err > tol or grad_err > tol:
                failures.append(f"rank {rank} {name}: loss {loss_err:.2e} grad {grad_err:.2e} (tol {tol:.0e})")
    assert not failures, "\n".join(failures)


def _megatron_job() -> list[tuple[str, float, float, float]]:
    from megatron.core import parallel_state

    # Imported but not initialised: group=None is a single process.
    assert resolve_group(None) is None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        assert resolve_group(None) is parallel_state.get_tensor_model_parallel_group()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank()
        # Each data-parallel replica has its own batch: summing over the world instead of the TP group would mix
        # them (and see 4 shards of a 2-shard vocabulary).
        data = _case_data(seed=100 + dp_rank, n_tokens=6, padded=2 * 23, vocab_size=45, k=4)
        errors = []
        for mode, kind in (("dense", "jsd"), ("topk", "forward_kl")):
            x_TV = data["student"][:, tp_rank * 23 : (tp_rank + 1) * 23].clone().requires_grad_(True)
            ref_x_TV = data["student"].clone().requires_grad_(True)
            if mode == "dense":
                loss_T = dense_divergence(
                    x_TV, data["teacher"][:, tp_rank * 23 : (tp_rank + 1) * 23], kind, vocab_size=45
                )
                ref_T = reference_dense(ref_x_TV, data["teacher"], kind, 0.5, 1.0, 1.0, 45)
            else:
                loss_T = topk_divergence(x_TV, data["ids"], data["logprobs"], kind, vocab_size=45)
                ref_T = reference_topk(ref_x_TV, data["ids"], data["logprobs"], kind, 0.5, "bucket", 1.0, 45)
            loss_T.sum().backward()
            ref_T.sum().backward()
            grad_err = rel_err(x_TV.grad, ref_x_TV.grad[:, tp_rank * 23 : (tp_rank + 1) * 23])
            errors.append((f"megatron tp group {mode} {kind}", rel_err(loss_T, ref_T), grad_err, 1e-5))
        return errors
    finally:
        parallel_state.destroy_model_parallel()


def test_group_none_uses_megatron_tensor_parallel_group() -> None:
    per_rank = run_distributed(_megatron_job, 4, timeout=240)
    for rank, errors in enumerate(per_rank):
        for name, loss_err, grad_err, tol in errors:
            assert loss_err <= tol and grad_err <= tol, f"rank {rank} {name}: {loss_err:.2e} {grad_err:.2e}"
