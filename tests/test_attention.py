"""The SDPA core attention of the local spec (``build.attention=sdpa``) against a float64 softmax reference:
causal training/scoring, GQA and one KV head, decode steps against cached keys (bottom-right, not SDPA's top-left
``is_causal``), packed sequences (THD) equal to each sequence alone, gradients (``gradcheck``), dropout under
Megatron's RNG, the bad configurations it refuses, and multi-latent attention's unequal heads (padded for the
flash kernel) against Megatron's own ``DotProductAttention``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.models.attention import SDPAttention


def _config(heads=4, groups=2, head_dim=8, dropout=0.0, **extra):
    base = dict(num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, attention_dropout=dropout,
                context_parallel_size=1, window_size=None, softmax_type="vanilla", sequence_parallel=False)  # fmt: skip
    return SimpleNamespace(**{**base, **extra})


class _TP:
    def __init__(self, size: int) -> None:
        self.tp = SimpleNamespace(size=lambda: size)


def _attention(dtype=torch.float32, tp=1, softcap=None, **config) -> SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType

    return SDPAttention(_config(**config), 1, AttnMaskType.causal, "self", pg_collection=_TP(tp), softcap=softcap).to(
        dtype
    )


def _reference(q, k, v, offset: int = 0, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """float64 attention of ``q [s, b, h, d]`` over ``k, v [k, b, g, d]``; query i sits at key position offset + i
    and sees the ``window`` keys before it (None: all); ``softcap``: scores ``c * tanh(scores / c)``."""
    q, k, v = (x.double() for x in (q, k, v))
    s, b, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,kbhd->bhsk", q, k) / math.sqrt(d)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.arange(k.shape[0])[None, :] <= (offset + torch.arange(s))[:, None]
    if window is not None:
        allowed &= torch.arange(k.shape[0])[None, :] >= (offset + torch.arange(s))[:, None] - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhsk,kbhd->sbhd", probs, v).reshape(s, b, h * d)


def _qkv(s, b=2, heads=4, groups=2, d=8, k_len=None, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=gen, dtype=dtype)
    k = torch.randn(k_len or s, b, groups, d, generator=gen, dtype=dtype)
    v = torch.randn(k_len or s, b, groups, d, generator=gen, dtype=dtype)
    return q, k, v


# Sliding windows: Megatron's window_size=(3, 0) is Hugging Face's sliding_window=4 (the query and 3 keys before).
WINDOWS = pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])


def _window(window: int | None) -> dict:
    return {} if window is None else {"window_size": (window, 0)}


@WINDOWS
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "one_kv"])
def test_causal_matches_reference(heads, groups, window):
    attn = _attention(heads=heads, groups=groups, **_window(window))
    q, k, v = _qkv(13, heads=heads, groups=groups)
    out = attn(q, k, v, None)
    assert out.shape == (13, 2, heads * 8)
    torch.testing.assert_close(out.double(), _reference(q, k, v, window=window), rtol=1e-5, atol=1e-6)
    if window is not None:  # the window bites: the full causal answer differs
        assert not torch.allclose(out.double(), _reference(q, k, v), atol=1e-3)


def test_window_follows_megatrons_layer_pattern():
    """``window_attn_skip_freq`` (Gemma 3's sliding/global layers): layer 2 of [1, 0] attends to everything."""
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(window_size=(3, 0), window_attn_skip_freq=[1, 0])
    sliding, full = (SDPAttention(config, n, AttnMaskType.causal, "self", pg_collection=_TP(1)) for n in (1, 2))
    assert (sliding.window, full.window) == (3, None)
    with pytest.raises(ValueError, match="right window of 0"):
        _attention(window_size=(3, 2))


@WINDOWS
def test_decode_steps_equal_prefill(window):
    """The sampler's path: a prefill, then one query at a time against the growing cache (Megatron passes
    ``no_mask`` there); each step's output equals that row of the full causal pass."""
    from megatron.core.transformer.enums import AttnMaskType

    attn = _attention(**_window(window))
    q, k, v = _qkv(10)
    full = attn(q, k, v, None)
    torch.testing.assert_close(full.double(), _reference(q, k, v, window=window), rtol=1e-5, atol=1e-6)
    prefill = attn(q[:4], k[:4], v[:4], None)
    torch.testing.assert_close(prefill, full[:4], rtol=1e-6, atol=1e-6)
    for pos in range(4, 10):
        step = attn(q[pos : pos + 1], k[: pos + 1], v[: pos + 1], None, attn_mask_type=AttnMaskType.no_mask)
        torch.testing.assert_close(step, full[pos : pos + 1], rtol=1e-6, atol=1e-6)
    # Several new queries against a longer cache under the causal type: bottom-right aligned.
    chunk = attn(q[6:], k, v, None)
    torch.testing.assert_close(chunk.double(), _reference(q[6:], k, v, offset=6, window=window), rtol=1e-5, atol=1e-6)


@WINDOWS
@pytest.mark.parametrize("route", ["padded", "per_sequence"])
def test_packed_sequences_equal_each_sequence_alone(route, window, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_opd.models import attention

    # The lengths below cost 5 x 12^2 / 203 = 3.5x padded: bound 4 takes the padded batch, 0 one call per sequence.
    monkeypatch.setattr(attention, "PADDED_COST_BOUND", 4 if route == "padded" else 0)
    called, original = [], getattr(SDPAttention, f"_{route}")

    def spy(self, *args):
        called.append(route)
        return original(self, *args)

    monkeypatch.setattr(SDPAttention, f"_{route}", spy)
    attn = _attention(**_window(window))
    lengths = [7, 1, 12, 0, 3]
    seqs = [_qkv(n, b=1, seed=i) for i, n in enumerate(lengths)]
    q, k, v = (torch.cat([s[j][:, 0] for s in seqs]) for j in range(3))  # [t, heads, d]
    q = torch.cat([q, torch.zeros(2, *q.shape[1:])])  # two padding tokens after the last sequence
    k, v = (torch.cat([x, torch.zeros(2, *x.shape[1:])]) for x in (k, v))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (sum(lengths) + 2, 4 * 8)
    for (lo, hi), (sq, sk, sv) in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), seqs):
        if hi == lo:
            continue
        torch.testing.assert_close(out[lo:hi], attn(sq, sk, sv, None)[:, 0], rtol=1e-6, atol=1e-6)
    assert out[-2:].abs().max() == 0
    assert called, f"the {route} route was not taken"


@pytest.mark.parametrize("bound, window", [(4, None), (0, None), (4, 1)], ids=["padded", "per_sequence", "window1"])
def test_packed_gradients_gradcheck(bound, window, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_opd.models import attention

    monkeypatch.setattr(attention, "PADDED_COST_BOUND", bound)
    attn = _attention(dtype=torch.float64, heads=4, groups=2, head_dim=4, **_window(window))
    cu = torch.tensor([0, 3, 3, 4, 7], dtype=torch.int32)  # an empty sequence, a one-token one, one padding token
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3, max_seqlen_kv=3)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 4, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (torch.randn(8, 2, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, None, packed_seq_params=params), (q, k, v))
    # Nothing but padding: zeros.
    empty = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu[:1], cu_seqlens_kv=cu[:1], max_seqlen_q=0, max_seqlen_kv=0
    )
    assert attn(q, k, v, None, packed_seq_params=empty).abs().max() == 0


def test_gradients_gradcheck():
    attn = _attention(dtype=torch.float64, heads=4, groups=2, head_dim=4)
    q, k, v = (x.requires_grad_() for x in _qkv(5, b=1, d=4, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, None), (q, k, v))


def test_dropout_only_in_training_and_under_megatron_rng():
    attn = _attention(dropout=0.5, sequence_parallel=True)  # SP: the default generator, as in Megatron
    q, k, v = _qkv(8)
    attn.eval()
    torch.testing.assert_close(attn(q, k, v, None).double(), _reference(q, k, v), rtol=1e-5, atol=1e-6)
    attn.train()
    assert not torch.allclose(attn(q, k, v, None).double(), _reference(q, k, v), atol=1e-3)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"softmax_type": "sigmoid"}, "softmax_type='sigmoid' is not supported"),  # learnable: tests/test_gpt_oss.py
    ],
)
def test_refuses_what_it_cannot_run(extra, message):
    with pytest.raises(ValueError, match=message):
        _attention(**extra)


def _recompute_body(model_dir: str):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward

    initialize_distributed(ParallelConfig())
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, build in {
        "none": ModelBuildConfig(),
        "selective": ModelBuildConfig(recompute_granularity="selective"),
        "full": ModelBuildConfig(recompute_granularity="full", recompute_num_layers=2),
        "local": ModelBuildConfig(attention="local"),
    }.items():
        _, chunks = build_and_load(model_dir, ParallelConfig(), build)

        def ce(logits, mb):
            loss = vocab_parallel_cross_entropy(logits.float(), torch.roll(mb["tokens"], -1, dims=1)).mean()
            return loss, loss.detach()

        (loss,) = forward_backward(chunks, [{"tokens": tokens}], ce)
        checkpointed = chunks[0].decoder.layers[0].self_attention.checkpoint_core_attention
        results[name] = (loss, {n: p.grad.clone() for n, p in chunks[0].named_parameters()}, checkpointed)
    return results


def test_recompute_granularities_and_local_attention_give_the_same_gradients(tmp_path):
    """Selective (core attention) and full recompute, and Megatron's local attention, against the default."""
    from megatron_opd.testing.multiprocess import run_distributed
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model("qwen3", tmp_path / "m", seed=0, num_hidden_layers=2)
    (results,) = run_distributed(_recompute_body, 1, args=(str(model),), timeout=300)
    ref_loss, ref_grads, _ = results["none"]
    assert results["selective"][2] and not results["none"][2] and not results["full"][2]
    for name in ("selective", "full", "local"):
        loss, grads, _ = results[name]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for param, ref in ref_grads.items():
            torch.testing.assert_close(
                grads[param], ref, rtol=1e-5, atol=1e-7, msg=lambda m, p=param, n=name: f"{n} {p}: {m}"
            )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention": "flash"}, "build.attention must be 'sdpa' or 'local'"),
        ({"recompute_granularity": "layers"}, "build.recompute_granularity must be 'selective', 'full' or null"),
        ({"recompute_activations": True, "recompute_granularity": "selective"}, "keep one of them"),
        ({"recompute_num_layers": 0}, "build.recompute_num_layers must be >= 1"),
    ],
)
def test_build_config_refuses_bad_values(kwargs, message):
    from megatron_opd.models.builder import ModelBuildConfig

    with pytest.raises(ValueError, match=message):
        ModelBuildConfig(**kwargs)


@WINDOWS
def test_softcapped_scores_in_every_case(window, monkeypatch):
    """Gemma 2's attention logit soft-capping in each of SDPAttention's cases: causal against the float64 reference
    (and unlike uncapped attention: the cap bites), the sampler's decode steps, packed sequences by both routes, and
    the sequence split over two context-parallel ranks (its all-gather stood in by the whole sequence)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_opd.models import attention
    from megatron_opd.testing.context_parallel import stand_in_cp_ranks

    cap = 0.5
    attn = _attention(softcap=cap, **_window(window))
    q, k, v = _qkv(12)
    full = attn(q, k, v, None)
    torch.testing.assert_close(full.double(), _reference(q, k, v, window=window, softcap=cap), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(full.double(), _reference(q, k, v, window=window), atol=1e-3)
    for pos in range(4, 12):  # decode: one query against the cache, no mask
        step = attn(q[pos : pos + 1], k[: pos + 1], v[: pos + 1], None, attn_mask_type=AttnMaskType.no_mask)
        torch.testing.assert_close(step, full[pos : pos + 1], rtol=1e-6, atol=1e-6)
    lengths = [7, 1, 12, 3]
    seqs = [_qkv(n, b=1, seed=i) for i, n in enumerate(lengths)]
    qp, kp, vp = (torch.cat([x[j][:, 0] for x in seqs]) for j in range(3))  # [t, heads, d]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    for bound in (4, 0):  # the padded batch, then one call per sequence
        monkeypatch.setattr(attention, "PADDED_COST_BOUND", bound)
        out = attn(qp, kp, vp, None, packed_seq_params=params)
        for lo, hi, (sq, sk, sv) in zip(cu[:-1].tolist(), cu[1:].tolist(), seqs):
            torch.testing.assert_close(out[lo:hi], attn(sq, sk, sv, None)[:, 0], rtol=1e-6, atol=1e-6)
    for group, split, (q_s, k_s, v_s) in stand_in_cp_ranks(q, k, v):
        config = _config(context_parallel_size=2, **_window(window))
        cp = SDPAttention(config, 1, AttnMaskType.causal, "self", softcap=cap,
                          pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=group))  # fmt: skip
        torch.testing.assert_close(cp(q_s, k_s, v_s, None), split.split(full, 0), rtol=1e-5, atol=1e-6)


class _FlatBuffer:
    """Megatron's global memory buffer (``DotProductAttention``'s score matrix) on the CPU."""

    def get_tensor(self, shape, dtype, name):
        return torch.empty(shape, dtype=dtype)


def _mla_core_attentions(tp: int, monkeypatch):
    """``SDPAttention`` and Megatron's ``DotProductAttention`` as the ``deepseek_v3_mla`` shape's MLA layer builds its
    core attention on one of ``tp`` ranks (query/key heads of 24, value heads of 12, Megatron's YaRN softmax scale);
    ``DotProductAttention`` has no value head size of its own: it takes ``kv_channels`` = the value head size."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import _yarn_get_mscale

    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models.builder import ModelBuildConfig, transformer_config
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.shapes import SHAPES
    from megatron_opd.testing.tiny_models import tiny_hf_config

    shape = SHAPES["deepseek_v3_mla"]
    arch = architecture_from_hf_config(tiny_hf_config(shape.family, **shape.hf_overrides()).to_dict(), shape.family)
    config = transformer_config(arch, ParallelConfig(), ModelBuildConfig())
    qk_width = config.qk_head_dim + config.qk_pos_emb_head_dim
    assert (qk_width, config.v_head_dim) == (24, 12)
    scale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2 / math.sqrt(qk_width)
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", _FlatBuffer)
    sdpa = SDPAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale, pg_collection=_TP(tp),
                        k_channels=qk_width, v_channels=config.v_head_dim)  # fmt: skip
    # sequence_parallel: no dropout RNG fork (dropout is 0 here)
    local = SimpleNamespace(**{**vars(config), "kv_channels": config.v_head_dim, "sequence_parallel": True})
    megatron = DotProductAttention(local, 1, AttnMaskType.causal, "self", softmax_scale=scale, pg_collection=_TP(tp))
    return sdpa, megatron, config.num_attention_heads // tp, qk_width, config.v_head_dim


def _causal_mask(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # Megatron's: True = masked out


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_value_heads_padded_for_flash_equal_megatrons_attention(tp, monkeypatch):
    """Multi-latent attention's unequal heads (``equal_head_widths``): causal, explicit-mask, decode, packed and
    context-parallel calls of ``SDPAttention`` on the ``deepseek_v3_mla`` layer's core attention (its heads at TP=1
    and on one of two TP ranks) give Megatron's ``DotProductAttention``'s outputs and q/k/v gradients, with torch's
    flash kernel forced (which refuses the unpadded heads)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_opd.models import attention
    from megatron_opd.testing.context_parallel import stand_in_cp_ranks

    sdpa, megatron, heads, dq, dv = _mla_core_attentions(tp, monkeypatch)
    gen = torch.Generator().manual_seed(tp)

    def qkv(s: int, b: int = 2):
        return [torch.randn(s, b, heads, d, generator=gen).requires_grad_() for d in (dq, dq, dv)]

    def outputs_and_grads(attend, inputs, weight):
        out = attend(*inputs)
        return out, *torch.autograd.grad((out * weight).sum(), inputs)

    def assert_same(got, want):
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"TP={tp} {n}: {m}")

    with pytest.raises(RuntimeError):  # the flash kernel refuses unequal heads: the forced backend is the check
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in qkv(4)))
    s = 11
    q, k, v = qkv(s)
    weight = torch.randn(s, 2, heads * dv, generator=gen)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        causal = outputs_and_grads(lambda *x: sdpa(*x, None), (q, k, v), weight)
        masked = outputs_and_grads(lambda *x: sdpa(*x, _causal_mask(s)), (q, k, v), weight)
        decode = [sdpa(q[i : i + 1], k[: i + 1], v[: i + 1], None, attn_mask_type=AttnMaskType.no_mask) for i in (0, 7)]
    reference = outputs_and_grads(lambda *x: megatron(*x, _causal_mask(s)), (q, k, v), weight)
    assert causal[0].shape == (s, 2, heads * dv)
    assert_same(causal, reference)
    assert_same(masked, reference)
    for i, step in zip((0, 7), decode):
        torch.testing.assert_close(step, reference[0][i : i + 1], rtol=1e-6, atol=1e-6)

    # Packed sequences (THD), both routes, against Megatron's attention of each sequence alone.
    lengths = [5, 1, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    packed = [x[:, 0] for x in qkv(sum(lengths), b=1)]  # [t, heads, d]
    weight = torch.randn(sum(lengths), heads * dv, generator=gen)
    pieces = [
        outputs_and_grads(lambda *x, n=hi - lo: megatron(*(y[:, None] for y in x), _causal_mask(n))[:, 0],
                          [x[lo:hi].detach().requires_grad_() for x in packed], weight[lo:hi])
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist())
    ]  # fmt: skip
    reference = [torch.cat(parts) for parts in zip(*pieces)]
    for bound in (4, 0):  # the padded batch, then one call per sequence
        monkeypatch.setattr(attention, "PADDED_COST_BOUND", bound)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            got = outputs_and_grads(lambda *x: sdpa(*x, None, packed_seq_params=params), packed, weight)
        assert_same(got, reference)

    # The sequence split over two context-parallel ranks (the all-gather stood in by the whole sequence).
    s = 8
    q, k, v = (x.detach() for x in qkv(s))
    full = megatron(q, k, v, _causal_mask(s))
    for _, split, (q_s, k_s, v_s) in stand_in_cp_ranks(q, k, v):
        monkeypatch.setattr(sdpa, "context_parallel", split)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.testing.assert_close(sdpa(q_s, k_s, v_s, None), split.split(full, 0), rtol=1e-6, atol=1e-6)
