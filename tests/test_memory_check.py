"""The trainer's start-up memory check (``trainer/memory.py``, wired in ``trainer/setup.py:check_inputs``): it refuses
a layout that cannot fit before any weight is loaded, and its parameter, gradient and optimizer bytes are those
Megatron allocates (a CPU student, counted tensor by tensor)."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.config import load_config
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.trainer.config import TrainConfig
from megatron_opd.trainer.memory import GIB, MemoryCheckError, check_trainer_memory

QWEN_32B_TO_1_7B = [
    "student.path=/models/Qwen3-1.7B",  # no folder here: the sizes come from KNOWN_CONFIGS
    "teacher.path=/models/Qwen3-32B",
    "train.max_seq_len=4096",
    "train.micro_batch_size=2",
    "train.prompts_per_step=64",
    "train.device_memory_gib=80",
]


def test_a_32b_in_process_teacher_is_refused_and_fits_as_a_server():
    from megatron_opd.trainer.setup import check_memory

    cfg = load_config(TrainConfig, None, QWEN_32B_TO_1_7B)
    # Eight H100s at TP=1: bf16 and the distributed optimizer, as the trainer resolves them on a GPU.
    with pytest.raises(MemoryCheckError) as refused:
        check_trainer_memory(cfg, 8, "cuda", cfg.train.device_memory_gib)
    message = str(refused.value)
    assert "has 80 GiB" in message and "teacher (in-process)" in message
    for advice in ("teacher.backend=server", "parallel.tensor_model_parallel_size", "train.skip_memory_check=true"):
        assert advice in message
    # The trainer's own call (this CPU: fp32) refuses it as well, and starts with the check skipped.
    with pytest.raises(MemoryCheckError):
        check_memory(cfg)
    check_memory(load_config(TrainConfig, None, [*QWEN_32B_TO_1_7B, "train.skip_memory_check=true"]))

    server = load_config(TrainConfig, None, [*QWEN_32B_TO_1_7B, "teacher.backend=server", "teacher.address=h:1"])
    peak, table = check_trainer_memory(server, 8, "cuda", 80)
    assert [row.job for row in peak.rows] == ["student (trainer)"]
    assert 10 * GIB < peak.total < 80 * GIB and "student (trainer) | TP=1 PP=1 DP=8" in table
    # A colocated vLLM engine reserves its share of the same GPU.
    vllm = load_config(TrainConfig, None, [*QWEN_32B_TO_1_7B, "teacher.backend=server", "teacher.address=h:1",
                                           "rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.3"])  # fmt: skip
    colocated, _ = check_trainer_memory(vllm, 8, "cuda", 80)
    assert colocated.total == pytest.approx(peak.total + 0.3 * 80 * GIB)


def _allocated_bytes(student_dir: str) -> dict[str, int]:
    """A CPU student as the trainer builds it, after one optimizer step: bytes of its parameters, of its DDP
    gradient buffers and of Adam's moments."""
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.student import Student, precision_plan

    initialize_distributed(ParallelConfig())
    optim = OptimConfig()
    chunks = build_and_load(student_dir, ParallelConfig(), trainable=True)[1]
    student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10)
    for chunk in student.model:
        chunk.zero_grad_buffer()
    student.optimizer.step()  # Adam allocates its moments at the first step
    params = {id(p): p for chunk in student.model for p in chunk.parameters()}
    optimizers = getattr(student.optimizer, "chained_optimizers", [student.optimizer])
    moments = [
        state[key] for opt in optimizers for state in opt.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")
    ]
    return {
        "weights": sum(p.numel() * p.element_size() for p in params.values()),
        "grads": sum(
            b.grad_data.numel() * b.grad_data.element_size()
            for c in student.model
            for b in [*c.buffers, *c.expert_parallel_buffers]  # an MoE model's experts have buffers of their own
        ),
        "optimizer": sum(m.numel() * m.element_size() for m in moments),
    }


@pytest.mark.parametrize("shape", ["qwen3", "deepseek_v3_mla"])
def test_parameter_gradient_and_optimizer_bytes_are_the_allocated_ones(shape, tiny_model_dirs, shape_dirs):
    """qwen3: a 1,001-token vocabulary, which Megatron pads to 1,024 rows. deepseek_v3_mla: multi-latent attention
    (q-LoRA, the two latent norms), a dense first layer, routed and shared experts; its expert bias is a buffer, in
    neither count."""
    student_dir = tiny_model_dirs[shape] if shape in tiny_model_dirs else str(shape_dirs[shape])
    allocated = run_distributed(_allocated_bytes, 1, args=(student_dir,), timeout=240)[0]
    cfg = load_config(TrainConfig, None, [f"student.path={student_dir}", "loss.kind=sft", "train.max_seq_len=64"])
    peak, _ = check_trainer_memory(cfg, 1, "cpu", None)
    (row,) = peak.rows
    assert {"weights": row.weights, "grads": row.grads, "optimizer": row.optimizer} == allocated


class _LiveBytes:
    """Peak bytes of the tensors alive at once, counted by storage (views and ``.view``-s of one buffer once) from
    every aten op's outputs while active; a storage leaves the count when it is freed. Tensors that existed
    before (``existing``: the weights, their gradients and views of them) are not counted."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        self.live = self.peak = 0
        live: dict[int, int] = {}
        before = {t.untyped_storage()._cdata for t in existing}

        def free(key: int) -> None:
            self.live -= live.pop(key)

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if (
                        isinstance(t, torch.Tensor)
                        and (key := t.untyped_storage()._cdata) not in live
                        and key not in before
                    ):
                        storage = t.untyped_storage()
                        live[storage._cdata] = storage.nbytes()
                        tracker.live += storage.nbytes()
                        weakref.finalize(storage, free, storage._cdata)
                        tracker.peak = max(tracker.peak, tracker.live)
                return out

        self.mode = Mode()


def _measured_activation_bytes(cases: list[tuple[str, int, str | None, int]]) -> list[int]:
    """Per ``(model folder, tokens, recompute granularity, loss chunk)``: the peak of live tensor bytes over one
    update of a CPU student (fp32) as the trainer runs it: forward to the final hidden states, the fused output
    layer's loss a chunk of tokens at a time, backward."""
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.losses.fused_output import fused_output_loss
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.output import HiddenStateOutput

    initialize_distributed(ParallelConfig())
    peaks = []
    for path, tokens, recompute, chunk in cases:
        torch.manual_seed(0)
        model = build_and_load(path, ParallelConfig(), ModelBuildConfig(recompute_granularity=recompute))[1][0]
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        ids, target = torch.randint(0, 1000, (1, tokens)), torch.randint(0, 1000, (tokens,))

        def cross_entropy(logits, index, target=target):
            return torch.nn.functional.cross_entropy(logits, target[index], reduction="none")

        params = list(model.parameters())
        head, live = HiddenStateOutput([model]), _LiveBytes(params + [p.grad for p in params])
        with live.mode:
            with head.active():
                hidden = model(ids, torch.arange(tokens)[None], None).reshape(tokens, -1)
            loss = fused_output_loss(
                hidden, head.weight, torch.full((tokens,), 1 / tokens), torch.ones(tokens, dtype=torch.bool),
                cross_entropy, rows=chunk, grad_hint=1.0,
            )[0]  # fmt: skip
            loss.backward()
        peaks.append(live.peak)
    return peaks


def test_activation_estimate_is_within_a_quarter_of_the_live_tensor_peak(tiny_model_dirs):
    """The activation term against the peak of live tensor bytes of one update, at two model shapes (Qwen3:
    QK-norm; Llama: none), two lengths, with and without full recomputation (fp32, CPU flash SDPA)."""
    cases = [
        ("qwen3", 512, None, 256),
        ("qwen3", 128, None, 128),
        ("qwen3", 512, "full", 64),
        ("llama", 512, None, 256),
        ("llama", 256, "full", 256),
    ]
    folders = [(tiny_model_dirs[family], tokens, recompute, chunk) for family, tokens, recompute, chunk in cases]
    measured = run_distributed(_measured_activation_bytes, 1, args=(folders,), timeout=240)[0]
    ratios = {}
    for (family, tokens, recompute, chunk), peak in zip(cases, measured):
        overrides = [f"student.path={tiny_model_dirs[family]}", f"train.max_seq_len={tokens}",
                     "train.micro_batch_size=1", f"loss.chunk_size={chunk}", "teacher.backend=server",
                     "teacher.address=h:1"]  # fmt: skip
        if recompute:
            overrides.append(f"build.recompute_granularity={recompute}")
        (row,) = check_trainer_memory(load_config(TrainConfig, None, overrides), 1, "cpu", None)[0].rows
        ratios[(family, tokens, recompute)] = row.activations / peak  # 0.92-0.98 measured
    assert all(0.75 <= r <= 1.25 for r in ratios.values()), ratios


def _qwen3_counts(h, layers, nq, nkv, d, vocab, tied, ffn=0, experts=0, expert_ffn=0):
    """(dense, routed-expert) parameter counts of a Qwen3(-MoE) from its config.json sizes, by hand: per layer
    q/k/v/o, QK-norm, two norms and a SwiGLU MLP (or a router and ``experts`` SwiGLU experts); the embedding, an
    untied output layer and the final norm."""
    attention = h * nq * d + 2 * h * nkv * d + nq * d * h + 2 * d + 2 * h
    mlp = experts * h if experts else 3 * h * ffn
    dense = layers * (attention + mlp) + vocab * h * (1 if tied else 2) + h
    return dense, layers * experts * 3 * h * expert_ffn


QWEN3_30B_A3B = dict(h=2048, layers=48, nq=32, nkv=4, d=128, vocab=151936, tied=False, experts=128, expert_ffn=768)
QWEN3_1_7B = dict(h=2048, layers=28, nq=16, nkv=8, d=128, vocab=151936, tied=True, ffn=6144)
"""``KNOWN_CONFIGS``' sizes (151,936 rows need no vocabulary padding at TP=1)."""


def test_distributed_optimizer_state_is_sharded_over_megatron_s_groups():
    """Megatron's distributed optimizer shards the dense parameters' state (fp32 master copy and Adam's moments, 12
    bytes a parameter) over the data-parallel group with the context-parallel ranks (world / (TP·PP)), a routed
    expert's over the expert data-parallel group (world / (ETP·EP·PP)). Qwen3-30B-A3B at EP=8 on 8 GPUs keeps its
    experts' whole state on each GPU (EDP = 1): about 112 GiB, refused on 80 GiB (was 77 GiB, counted over DP=8:
    it passed and ran out of memory at the first step); at CP=2 the dense model's state is shared by 8 ranks."""
    dense, experts = _qwen3_counts(**QWEN3_30B_A3B)
    assert 30.4e9 < dense + experts < 30.6e9 and experts > 0.9 * (dense + experts)
    base = ["loss.kind=sft", "train.max_seq_len=4096", "train.micro_batch_size=1", "train.prompts_per_step=64"]
    moe, dense_model = (
        ["student.path=/models/Qwen3-30B-A3B", "parallel.expert_model_parallel_size=8"],
        ["student.path=/models/Qwen3-1.7B"],
    )
    cp2 = ["parallel.context_parallel_size=2"]
    layouts = {  # name: (overrides, world, dense shards = world / (TP·PP), expert shards = world / (ETP·EP·PP))
        "moe ep8": (moe, 8, 8, 1),
        "moe ep8 cp2": ([*moe, *cp2], 16, 16, 2),
        "dense cp2": ([*dense_model, *cp2], 8, 8, None),
    }
    for name, (overrides, world, dense_shards, expert_shards) in layouts.items():
        dense, experts = _qwen3_counts(**(QWEN3_30B_A3B if name.startswith("moe") else QWEN3_1_7B))
        cfg = load_config(TrainConfig, None, [*base, *overrides])
        peak, _ = check_trainer_memory(cfg, world, "cuda", None)  # bf16 and the distributed optimizer on a GPU
        (row,) = peak.rows
        per_device = dense + experts // 8
        assert row.params == per_device and row.weights == 2 * per_device and row.grads == 4 * per_device, name
        expected = 12 * dense / dense_shards + (12 * experts / 8 / expert_shards if experts else 0)
        assert row.optimizer == pytest.approx(expected, rel=1e-12), name
        if name == "moe ep8":
            assert 105 * GIB < peak.total < 120 * GIB, peak.total / GIB
            with pytest.raises(MemoryCheckError, match="has 80 GiB"):
                check_trainer_memory(cfg, world, "cuda", 80)
