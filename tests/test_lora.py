"""LoRA students (``models/lora.py``): adapters sharded over TP equal one unsharded adapter, a new one changes nothing,
merged weights give the adapter's logits, and only adapter parameters are trained."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_opd.distributed import ParallelConfig
from megatron_opd.models.lora import LoRAConfig, adapter_elements
from megatron_opd.testing.multiprocess import run_distributed

STEPS = 3
LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2": ParallelConfig(tensor_model_parallel_size=2),
    "tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
}


def _tokens(vocab: int = 1000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (2, 2, 16), generator=gen)  # [micro-batches, batch, sequence]


def _run(parallel: ParallelConfig, model_dir: str, tokens: torch.Tensor, ckpt: str, save: bool) -> dict:
    """At ``parallel``: the base logits, the logits with fresh adapters, the adapters after STEPS optimizer steps
    (gathered), the adapter forward's logits and the merged model's. ``save``: write the trained model to the
    dist_ckpt ``ckpt``; else first load ``ckpt`` into a fresh adapted model and gather its adapters."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.distributed.gather import gather_vocab_shards
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.lora import adapter_elements, adapter_parameters, add_lora, full_adapters, merge_lora
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.objective import MicroBatchStats
    from megatron_opd.trainer.student import Student, precision_plan

    tp_group = ps.get_tensor_model_parallel_group()
    arch, chunks = build_and_load(model_dir, parallel, trainable=True)
    result = {}
    batches = [{"tokens": t} for t in tokens]

    def logits():
        def collect(out, batch):
            return out.sum() * 0.0, gather_vocab_shards(out.detach(), tp_group)[..., : arch.vocab_size]

        with torch.no_grad():
            return torch.stack(forward_backward(chunks, batches, collect, forward_only=True))

    def ce(out, batch):
        labels = torch.roll(batch["tokens"], -1, dims=1)
        loss = vocab_parallel_cross_entropy(out.float(), labels).mean()
        return loss, MicroBatchStats.of({"loss": loss.detach()}, loss.device)

    if not save:
        from megatron_opd.checkpoint.mcore_io import chunks_sharded_state_dict, load_dist_checkpoint

        _, fresh = build_and_load(model_dir, parallel, trainable=True)
        add_lora(fresh, LoRAConfig(rank=4, alpha=8.0), seed=1)  # another A: the load must replace it
        fresh[0].load_state_dict(load_dist_checkpoint(chunks_sharded_state_dict(fresh), ckpt)["model"])
        result["resumed"] = full_adapters(fresh, arch, tp_group)
    result["base"] = logits()
    result["adapted"] = add_lora(chunks, LoRAConfig(rank=4, alpha=8.0), seed=0)
    result["expected"] = 4 * arch.num_layers  # every target in every layer
    result["fresh"] = logits()
    adapters = adapter_parameters(chunks)
    trainable = {name for chunk in chunks for name, p in chunk.named_parameters() if p.requires_grad}
    result["trainable_are_adapters"] = trainable == set(adapters)
    # adam_eps above the gradients: Adam's update is then about linear in them, not their sign, which would turn
    # float rounding in a near-zero gradient into a whole step's difference between layouts.
    # TP=1 here is two data-parallel ranks: Megatron's distributed optimizer there (the GPU default), sharding the
    # adapters' state over them; the plain optimizer at TP=2.
    distributed = parallel.tensor_model_parallel_size == 1
    optim = OptimConfig(lr=1e-2, adam_eps=1e-2, use_distributed_optimizer=distributed)
    student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10)
    in_buffers = {id(p) for c in student.model for b in [*c.buffers, *c.expert_parallel_buffers] for p in b.params}
    optimizers = getattr(student.optimizer, "chained_optimizers", [student.optimizer])
    if distributed:  # its groups hold fp32 shards of the buffers' parameters
        groups = [g for o in optimizers for g in o.model_float16_groups + o.model_fp32_groups]
    else:
        groups = [g["params"] for o in optimizers for g in o.param_groups]
    in_optimizer = {id(p) for g in groups for p in g}
    ids = {id(p) for p in adapters.values()}  # the distributed optimizer holds this rank's share of them
    result["optimizer_holds_adapters_only"] = (
        in_buffers == ids and (in_optimizer <= ids if distributed else in_optimizer == ids) and in_optimizer
    )
    result["distributed"] = distributed
    for _ in range(STEPS):
        step = student.step(batches, ce)
    student.finish_param_sync()  # the distributed optimizer's parameter all-gather, when overlapped
    result["grad_norm"] = step.grad_norm
    lora = LoRAConfig(rank=4, alpha=8.0)
    buffers = [b for c in student.model for b in [*c.buffers, *c.expert_parallel_buffers]]
    moments = [s[k] for o in optimizers for s in o.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    result["memory"] = {  # what the memory check counts (fp32: 4 bytes of gradient, 8 of Adam moments) vs allocated
        "estimate": adapter_elements(arch, lora, tp_group.size(), range(arch.num_layers)),
        "params": sum(p.numel() for p in adapters.values()),
        "grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        "moment_bytes": sum(m.numel() * m.element_size() for m in moments),
    }
    with_grads = {name for chunk in chunks for name, p in chunk.named_parameters() if hasattr(p, "main_grad")}
    result["grads_are_adapters"] = with_grads == set(adapters)
    result["adapters"] = full_adapters(chunks, arch, tp_group)
    if save:
        from megatron.core import dist_checkpointing

        from megatron_opd.checkpoint import convert_mcore_to_hf
        from megatron_opd.checkpoint.mcore_io import chunks_sharded_state_dict

        dist_checkpointing.save(chunks_sharded_state_dict(chunks), ckpt)
        convert_mcore_to_hf(ckpt, f"{ckpt}_hf", hf_config_dir=model_dir, force=True)  # merges the adapters
        _save_adapters(chunks, model_dir, ckpt)
    result["lora_logits"] = logits()
    result["merged"] = merge_lora(chunks)
    result["merged_logits"] = logits()
    return result


def _save_adapters(chunks: list, model_dir: str, ckpt: str) -> None:
    """The trained adapters saved as the trainer saves a LoRA student: adapter-only, the base recorded (a
    collective)."""
    from megatron.core import dist_checkpointing

    from megatron_opd.checkpoint.adapters import adapter_entries, adapter_record
    from megatron_opd.checkpoint.mcore_io import chunks_sharded_state_dict
    from megatron_opd.trainer.config import StudentConfig

    os.makedirs(f"{ckpt}_adapters", exist_ok=True)
    state = {key: adapter_entries(value) for key, value in chunks_sharded_state_dict(chunks).items()}
    state["trainer"] = {"adapters": adapter_record(StudentConfig(path=model_dir, lora=LoRAConfig(rank=4, alpha=8.0)))}
    dist_checkpointing.save(state, f"{ckpt}_adapters")


def _export_adapters(model_dir: str, ckpt: str) -> None:
    """The adapter-only checkpoint merged into the Hugging Face base and into a dist_ckpt of it (``ckpt``: its frozen
    weights are the base's), and written as a PEFT folder: in this process (in the two-rank job each costs seconds of
    collectives on shared cores; the converter forms its own one-process group and leaves none behind)."""
    from megatron_opd.checkpoint.lora_export import export_peft_adapter, merge_adapter_checkpoint, to_hugging_face

    adapters = f"{ckpt}_adapters"
    to_hugging_face(adapters, f"{ckpt}_merged_on_hf", force=True)  # as opd-convert mcore-to-hf: the recorded base
    merge_adapter_checkpoint(adapters, f"{ckpt}_merged_on_mcore", base=ckpt, hf_config_dir=model_dir, force=True)
    export_peft_adapter(adapters, f"{ckpt}_peft", force=True)


def _lora_body(model_dir: str, tokens: torch.Tensor, ckpt: str) -> dict:
    from megatron_opd.distributed import initialize_distributed, initialize_model_parallel

    results = {}
    for i, (name, parallel) in enumerate(LAYOUTS.items()):
        (initialize_model_parallel if i else initialize_distributed)(parallel)
        results[name] = _run(parallel, model_dir, tokens, ckpt, save=name == "tp1")
    results["tp1"]["export"] = f"{ckpt}_hf"
    results["tp1"]["ckpt"] = ckpt
    return results


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dirs, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("lora_ckpt")
    return run_distributed(_lora_body, 2, args=(tiny_model_dirs["qwen3"], _tokens(), str(ckpt)), timeout=300)


def test_fresh_adapters_change_nothing_and_only_adapters_train(lora_runs):
    for rank, results in enumerate(lora_runs):
        for layout, r in results.items():
            where = f"rank {rank}, {layout}"
            assert r["adapted"] == r["expected"], f"{where}: {r['adapted']} layers adapted, not {r['expected']}"
            assert torch.equal(r["fresh"], r["base"]), f"{where}: B = 0 must leave the logits bit-identical"
            assert r["trainable_are_adapters"] and r["grads_are_adapters"], where
            assert r["optimizer_holds_adapters_only"], where
            assert r["grad_norm"] > 0, where
            m = r["memory"]
            assert m["estimate"] == m["params"] and m["grad_bytes"] == 4 * m["params"], (where, m)
            if not r["distributed"]:
                assert m["moment_bytes"] == 8 * m["params"], (where, m)
            else:  # sharded over the two data-parallel ranks (each buffer padded to a multiple of them)
                assert 8 * m["params"] / 2 <= m["moment_bytes"] < 8 * m["params"] / 2 + 8 * 1024, (where, m)


def test_tp2_adapters_equal_tp1_and_merged_logits_equal_adapter_forward(lora_runs):
    ref = lora_runs[0]["tp1"]
    moved = max(t.abs().max().item() for name, t in ref["adapters"].items() if name.endswith(".B"))
    assert moved > 1e-3, f"B barely moved ({moved:.1e}): the comparison would be vacuous"
    assert (ref["lora_logits"] - ref["base"]).abs().max() > 1e-4, "the adapters must change the logits"
    for rank, results in enumerate(lora_runs):
        for layout, r in results.items():
            assert set(r["adapters"]) == set(ref["adapters"])
            for name, want in ref["adapters"].items():
                got = r["adapters"][name]
                assert got.shape == want.shape, (layout, name)
                err = (got - want).abs().max().item()
                assert err <= 1e-6, f"rank {rank}, {layout}: {name} differs from TP=1 by {err:.1e}"
            torch.testing.assert_close(r["lora_logits"], ref["lora_logits"], rtol=0, atol=1e-5)
            if layout != "tp1":  # TP=1's trained adapters, saved and loaded at TP=2: the same bits
                assert set(r["resumed"]) == set(ref["adapters"])
                for name, want in ref["adapters"].items():
                    assert torch.equal(r["resumed"][name], want), f"rank {rank}, {layout}: resumed {name} differs"
            assert r["merged"] == r["adapted"]
            torch.testing.assert_close(r["merged_logits"], r["lora_logits"], rtol=0, atol=1e-5)


def test_merged_hugging_face_export_gives_the_adapter_forward_logits(lora_runs, tmp_path_factory):
    """The converter's export of the TP=1 checkpoint (``W + alpha/r B A``), run by transformers."""
    from megatron_opd.models.reference import hf_logits

    ref = lora_runs[0]["tp1"]
    exported = [hf_logits(ref["export"], t) for t in _tokens()]
    torch.testing.assert_close(torch.stack(exported), ref["lora_logits"], rtol=0, atol=1e-5)


def test_adapter_only_checkpoint_merges_into_its_base_and_loads_in_peft(lora_runs, tiny_model_dirs):
    """The TP=1 adapters in an adapter-only checkpoint: merged into the Hugging Face base, or into a dist_ckpt of it,
    the same bits as the converter's merge of the full checkpoint, whose logits transformers computes as the adapter
    forward; written as a PEFT folder (fused QKV and gate/up adapters split per projection), ``peft`` on the base
    computes the adapter forward's logits too."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_opd.models.reference import hf_logits

    ref = lora_runs[0]["tp1"]
    ckpt = Path(ref["ckpt"])
    _export_adapters(tiny_model_dirs["qwen3"], str(ckpt))

    def weights(folder):
        return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}

    full_export = weights(ref["export"])
    for merged in (f"{ckpt}_merged_on_hf", f"{ckpt}_merged_on_mcore"):
        ours = weights(merged)
        assert ours.keys() == full_export.keys(), merged
        assert all(torch.equal(ours[k], full_export[k]) for k in ours), f"{merged} differs from the full export"
    exported = torch.stack([hf_logits(f"{ckpt}_merged_on_hf", t) for t in _tokens()])
    torch.testing.assert_close(exported, ref["lora_logits"], rtol=0, atol=1e-5)

    peft_dir = Path(f"{ckpt}_peft")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    names = load_file(peft_dir / "adapter_model.safetensors")
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layers = range(len(lora_runs[0]["tp1"]["adapters"]) // 8)  # A and B of four targets a layer
    assert set(names) == {f"base_model.model.model.layers.{n}.{'self_attn' if p in projections[:4] else 'mlp'}.{p}"
                          f".lora_{f}.weight" for n in layers for p in projections for f in "AB"}  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    with torch.no_grad():
        peft_logits = torch.stack([model(input_ids=t).logits.float() for t in _tokens()])
    torch.testing.assert_close(peft_logits, ref["lora_logits"], rtol=0, atol=1e-5)


def test_bad_lora_settings_are_refused_by_name():
    for kwargs, field in [
        (dict(rank=-1), "student.lora.rank"),
        (dict(rank=8, alpha=0), "student.lora.alpha"),
        (dict(rank=8, dropout=1.0), "student.lora.dropout"),
        (dict(rank=8, target_modules=["linear_qkv", "q_proj"]), "student.lora.target_modules"),
        (dict(rank=8, target_modules=[]), "student.lora.target_modules"),
        (dict(rank=8, target_modules=["linear_qkv", "experts"]), "student.lora.target_modules"),
    ]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            LoRAConfig(**kwargs)
    assert not LoRAConfig().enabled, "LoRA is off by default"


def test_memory_check_counts_adapter_gradients_and_optimizer_state_only(tiny_model_dirs):
    from megatron_opd.config import load_config
    from megatron_opd.models import load_architecture
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.memory import check_trainer_memory

    student = tiny_model_dirs["qwen3"]
    base = [f"student.path={student}", "loss.kind=sft", "train.max_seq_len=64", "export_hf=false"]
    full, _ = check_trainer_memory(load_config(TrainConfig, None, base), 1, "cpu", None)
    lora, _ = check_trainer_memory(load_config(TrainConfig, None, [*base, "student.lora.rank=8"]), 1, "cpu", None)
    (full_row,), (lora_row,) = full.rows, lora.rows
    arch = load_architecture(student)
    adapters = adapter_elements(arch, LoRAConfig(rank=8), 1, range(arch.num_layers))
    assert 0 < adapters < full_row.params / 10
    assert lora_row.grads == 4 * adapters and lora_row.optimizer == 8 * adapters  # fp32 on CPU: Adam's two moments
    assert lora_row.weights == full_row.weights + 4 * adapters


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["build.use_transformer_engine=true"], "build.use_transformer_engine"),
        (
            ["parallel.tensor_model_parallel_size=2", "student.lora.dropout=0.1"],
            "student.lora.dropout",
        ),
    ],
)
def test_what_a_lora_student_cannot_run_yet_is_refused_before_any_model(overrides, field):
    from megatron_opd.config import load_config
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "loss.kind=sft", "data.train_files=d.jsonl", "student.lora.rank=8"]
    cfg = load_config(TrainConfig, None, [*base, *overrides])
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cfg.validate()
    load_config(TrainConfig, None, base).validate()  # the supported form passes
    layouts = ["parallel.pipeline_model_parallel_size=2", "parallel.context_parallel_size=2", "train.packing=false",
               "parallel.expert_model_parallel_size=2", "loss.kind=reverse_kl", "teacher.path=t",
               "rollout.backend=vllm"]  # fmt: skip
    load_config(TrainConfig, None, [*base, *layouts]).validate()  # tests/test_lora_layouts.py, test_weight_sync_vllm


@pytest.mark.skipif(
    not os.environ.get("MEGATRON_OPD_LORA_TRAINER"),
    reason="a trainer run and an export (~25 s of CI) whose parts run in CI elsewhere: a LoRA student's SIGTERM save at "
    "TP=2 (test_train_cli), its resume (test_resume_layouts), its merges (above); set MEGATRON_OPD_LORA_TRAINER=1",
)
def test_trainer_distils_into_a_lora_student_saves_its_adapters_and_exports_it_merged(tmp_path):
    """Two steps through ``python -m megatron_opd.train`` (one process: the TP=2 adapters equal TP=1's above): the
    adapters train, the checkpoint holds them alone with the base's path, and the trainer's export of it is the base
    with the adapted layers' weights changed (the merge itself is checked against transformers and peft above).
    The export is run here (``train._export``, as the trainer runs it): the trainer's own runs in a spawned process
    that imports the installed package, which in a git worktree is another checkout's."""
    import json

    from safetensors.torch import load_file

    from megatron_opd.checkpoint.adapters import saved_adapter_record
    from megatron_opd.checkpoint.mcore_to_hf import stored_tensors
    from megatron_opd.testing.distill_fixture import make_distill_fixture
    from megatron_opd.testing.multiprocess import run_trainer

    pair = make_distill_fixture(tmp_path / "pair")
    out_dir = tmp_path / "run"
    overrides = {"train.steps": 2, "student.lora.rank": 8, "optim.lr": 1e-2, "data.eval_files": "", "export_hf": False}
    code, out = run_trainer(pair.overrides(out_dir, **overrides), nproc=1, timeout=300)
    assert code == 0, out[-3000:]
    assert "student.lora: rank-8 adapters" in out
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2]

    final = out_dir / "checkpoints" / "step_00000002"
    weights = {key for key in stored_tensors(final) if not key.startswith(("optimizer", "rng_state"))}
    assert weights and all(".lora." in key for key in weights), sorted(weights)[:8]
    assert saved_adapter_record(final)["base"] == str(Path(pair.student).resolve())

    def weights_of(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    from megatron_opd.checkpoint.workers import run_in_fresh_process
    from megatron_opd.train import _export

    run_in_fresh_process(_export, str(final), str(tmp_path / "merged"), pair.student)
    before, after = weights_of(Path(pair.student)), weights_of(tmp_path / "merged")
    assert set(before) == set(after)
    changed = {name for name in before if not torch.equal(before[name], after[name].to(before[name].dtype))}
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed and all(name.endswith(".weight") and name.split(".")[-2] in adapted for name in changed), changed
    assert all(any(f".{layer}." in name for name in changed) for layer in adapted), "every targeted layer merged"


HF_PROJECTIONS = {
    "linear_qkv": ("self_attn.k_proj.", "self_attn.qkv_proj."),  # multi-latent attention has no key projection
    "linear_proj": ("self_attn.o_proj.",),
    "linear_fc1": ("mlp.gate_proj.", "mlp.up_proj.", "mlp.gate_up_proj.", "mlp.shared_expert.", "mlp.shared_experts."),
    "linear_fc2": ("mlp.down_proj.", "mlp.shared_expert.", "mlp.shared_experts."),
}
"""Each LoRA target's Hugging Face counterparts inside a decoder layer (routed experts are under ``mlp.experts``)."""


def _hf_target_layers(config) -> dict[str, list[int]]:
    """The reference: which decoder layers of the transformers model (built on the meta device) hold each target's
    counterparts."""
    import re

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        names = [name for name, _ in AutoModelForCausalLM.from_config(config).named_parameters()]
    located = [(int(m[1]), m[2]) for m in (re.match(r".*?layers\.(\d+)\.(.*)", n) for n in names) if m]
    return {
        target: sorted({layer for layer, rest in located if rest.startswith(prefixes)})
        for target, prefixes in HF_PROJECTIONS.items()
    }


TARGET_SHAPES = (
    "llama_tied", "phi3_fused_partial", "qwen2_moe_shared", "qwen3_moe_dense0", "mixtral_untied", "deepseek_v3_mla",
    "qwen3_next_hybrid", "qwen3_5_dense", "gpt_oss_sinks",
)  # fmt: skip
"""A shape per way a layer can lack a target: fused Hugging Face projections, shared, routed-only and stacked experts,
a dense first layer, multi-latent attention, Gated DeltaNet layers (every shape agreed on 2026-11-29)."""


def test_lora_targets_follow_the_architecture():
    from megatron_opd.models.hf_config import architecture_from_hf_config
    from megatron_opd.models.lora import target_layers
    from megatron_opd.testing.shapes import SHAPES
    from megatron_opd.testing.tiny_models import tiny_hf_config

    for name in TARGET_SHAPES:
        shape = SHAPES[name]
        config = tiny_hf_config(shape.family, **shape.hf_overrides())
        got = {
            target: list(layers)
            for target, layers in target_layers(architecture_from_hf_config(config.to_dict())).items()
        }
        assert got == _hf_target_layers(config), name


@pytest.mark.parametrize(
    "shape, targets, layout, refused, fine",
    [
        ("mixtral_untied", ["linear_qkv", "linear_fc1"], [], r"names \['linear_fc1'\], which this model", ["linear_qkv"]),
        # layers 2-3 are routed experts without a shared expert: stage 1 would train nothing
        ("qwen3_moe_dense0", ["linear_fc1"], ["parallel.pipeline_model_parallel_size=2"],
         r"pipeline stage 1 \(layers \[2, 3\]\)", ["linear_fc1", "linear_proj"]),
        # virtual chunks: stage 0 holds layers 0 and 2 (Gated DeltaNet), stage 1 layers 1 and 3 (attention)
        ("qwen3_next_hybrid", ["linear_qkv"], ["parallel.pipeline_model_parallel_size=2",
         "parallel.virtual_pipeline_model_parallel_size=2"], r"pipeline stage 0 \(layers \[0, 2\]\)",
         ["linear_qkv", "linear_fc1"]),
    ],
)  # fmt: skip
def test_lora_targets_missing_from_the_model_or_a_stage_are_refused_before_any_model(tmp_path, shape, targets, layout,
                                                                                      refused, fine):  # fmt: skip
    """The trainer's input checks (every rank, before any process group) refuse them from ``config.json`` alone,
    naming the field, instead of one pipeline stage raising while building its layers and the others waiting."""
    from megatron_opd.config import load_config
    from megatron_opd.testing.shapes import SHAPES
    from megatron_opd.testing.tiny_models import tiny_hf_config
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import check_inputs

    tiny_hf_config(SHAPES[shape].family, **SHAPES[shape].hf_overrides()).save_pretrained(tmp_path)  # no weights
    base = [f"student.path={tmp_path}", "loss.kind=sft", "data.train_files=absent.jsonl", "student.lora.rank=8",
            "build.attention=sdpa", *layout]  # fmt: skip
    with pytest.raises(ValueError, match=r"student\.lora\.target_modules") as err:
        check_inputs(load_config(TrainConfig, None, [*base, f"student.lora.target_modules=[{','.join(targets)}]"]))
    assert err.match(refused)
    with pytest.raises(Exception, match="absent.jsonl"):  # targets every stage has pass, on to the next check
        check_inputs(load_config(TrainConfig, None, [*base, f"student.lora.target_modules=[{','.join(fine)}]"]))
