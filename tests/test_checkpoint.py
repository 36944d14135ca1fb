"""Checkpoint conversion: HF -> dist_ckpt -> HF is bitwise, and Megatron loads the dist_ckpt under other layouts;
the trainer's Hugging Face export of a Megatron model is bitwise too.

References are independent of the converter: the original safetensors files (``torch.equal``),
transformers' logits, and Megatron-Core's own ``dist_checkpointing.load`` at TP=1 and TP=4. The round trip and the
export run the model-shape matrix's shapes (``megatron_opd.testing.shapes``) at its layouts.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from megatron_opd.models.families import BY_MODEL_TYPE
from megatron_opd.models.hf_io import HFCheckpointReader, HFCheckpointWriter
from megatron_opd.models.reference import hf_logits
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import MATRIX, shapes_at
from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

ROUND_TRIP = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
WRITTEN_AT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
LAYOUTS = {  # the matrix's layouts: name -> (world size, layout)
    "tp1": (1, dict()),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_pp2": (4, WRITTEN_AT),
    "pp2_vp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "tp2_ep2": (4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)),
}
GPT_OSS_LAYOUT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                      expert_tensor_parallel_size=1)  # fmt: skip
DEEPSEEK_LAYOUT = dict(  # uneven stages (one layer, then three), as DeepSeek-V3's 61 layers need
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    expert_model_parallel_size=2,
    num_layers_in_first_pipeline_stage=1,
)
ROUND_TRIP_PATH = "tools/checkpoint round trip (bitwise)"
ROUND_TRIP_CELLS = [(layout, name) for layout in MATRIX[ROUND_TRIP_PATH] for name in shapes_at(ROUND_TRIP_PATH, layout)]

# TP=4 needs 4 key/value heads. Vocabulary 1100 pads to 1152 (TP=1), 1280 (TP=2) and 1536 (TP=4), so
# every load below crosses a vocabulary-padding change.
TP4_MODELS = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=1100),
    "qwen2": dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=1100, tie_word_embeddings=True),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=1100),
}


def _resharded(src: Path, dst: Path, max_shard_bytes: int) -> Path:
    """Copy a checkpoint as several safetensors shards with an index, plus a tokenizer."""
    dst.mkdir(parents=True)
    reader = HFCheckpointReader(src)
    writer = HFCheckpointWriter(dst, max_shard_bytes=max_shard_bytes)
    for name in reader.names():
        writer.add(name, reader.get(name))
    writer.close()
    for side in src.iterdir():
        if side.suffix == ".json" and "safetensors" not in side.name:
            (dst / side.name).write_bytes(side.read_bytes())
    make_tiny_tokenizer(dst)
    return dst


@pytest.fixture(scope="module")
def sources(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """The session's tiny llama as several safetensors shards with a tokenizer, and qwen3 (vocabulary 1001)."""
    root = tmp_path_factory.mktemp("ckpt_sources")
    return {
        "llama": str(_resharded(Path(tiny_model_dirs["llama"]), root / "llama_sharded", 200_000)),
        "qwen3": tiny_model_dirs["qwen3"],
    }


@pytest.fixture(scope="module")
def tp4_sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt_tp4_sources")
    return {
        family: str(make_tiny_hf_model(family, root / family, seed=10 + i, **overrides))
        for i, (family, overrides) in enumerate(TP4_MODELS.items())
    }


def _convert_body(jobs: list[tuple[str, str, dict, str | None, int, str | None]]):
    """Run conversions on every rank of a torchrun-like job (each rank writes its share of the files)."""
    from megatron_opd.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_opd.distributed import ParallelConfig

    results = []
    for hf_dir, ckpt, layout, back, max_shard_bytes, dtype in jobs:
        written = convert_hf_to_mcore(hf_dir, ckpt, ParallelConfig(**layout), dtype=dtype)
        results.append(written.tensors)
        if back is not None:
            exported = convert_mcore_to_hf(ckpt, back, max_shard_bytes=max_shard_bytes)
            results.append(exported.tensors)
    return results


@pytest.fixture(scope="module")
def converted(sources, tp4_sources, shape_dirs, tmp_path_factory) -> dict[str, dict[str, str]]:
    """All conversions of this module in one 2-process job: the matrix's round trips (``shape@layout``), the sharded
    llama's at TP2xPP2xVP2, a bf16 one, and TP4 sources at TP2xPP2."""
    root = tmp_path_factory.mktemp("ckpt_converted")
    jobs, out = [], {}
    for layout, name in ROUND_TRIP_CELLS:
        key = f"{name}@{layout}"
        ckpt, back = root / f"{key}_mcore", root / f"{key}_back"
        jobs.append((shape_dirs[name], str(ckpt), LAYOUTS[layout][1], str(back), 5 * 10**9, None))
        out[key] = {"hf": shape_dirs[name], "mcore": str(ckpt), "back": str(back)}
    # DeepSeek-V3 (the expert bias buffer, multi-latent attention) also split over pipeline stages.
    key = "deepseek_v3_mla@tp2_pp2_ep2"
    ckpt, back = root / f"{key}_mcore", root / f"{key}_back"
    jobs.append((shape_dirs["deepseek_v3_mla"], str(ckpt), DEEPSEEK_LAYOUT, str(back), 5 * 10**9, None))
    out[key] = {"hf": shape_dirs["deepseek_v3_mla"], "mcore": str(ckpt), "back": str(back)}
    # The sharded llama's export is split into several safetensors files.
    ckpt, back = root / "llama_mcore", root / "llama_back"
    jobs.append((sources["llama"], str(ckpt), ROUND_TRIP, str(back), 300_000, None))
    out["llama"] = {"hf": sources["llama"], "mcore": str(ckpt), "back": str(back)}
    ckpt, back = root / "qwen3_bf16_mcore", root / "qwen3_bf16_back"
    jobs.append((sources["qwen3"], str(ckpt), WRITTEN_AT, str(back), 5 * 10**9, "bf16"))
    out["qwen3_bf16"] = {"hf": sources["qwen3"], "mcore": str(ckpt), "back": str(back)}
    for family, hf_dir in tp4_sources.items():
        ckpt = root / f"{family}_tp4src_mcore"
        jobs.append((hf_dir, str(ckpt), WRITTEN_AT, None, 0, None))
        out[f"{family}_tp4"] = {"hf": hf_dir, "mcore": str(ckpt)}
    # gpt-oss (stacked, interleaved experts; sinks; biases: expert TP 1) at TP=2 x PP=2 x EP=2, and an MXFP4 copy.
    from tests.test_gpt_oss import mxfp4_copy

    mxfp4 = mxfp4_copy(shape_dirs["gpt_oss_sinks"], root / "gpt_oss_mxfp4_src")
    gpt_oss_jobs = {"gpt_oss@tp2_pp2_ep2": (shape_dirs["gpt_oss_sinks"], GPT_OSS_LAYOUT),
                    "gpt_oss_mxfp4": (str(mxfp4["mxfp4"]), dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1))}  # fmt: skip
    for key, (hf_dir, layout) in gpt_oss_jobs.items():
        ckpt, back = root / f"{key}_mcore", root / f"{key}_back"
        jobs.append((hf_dir, str(ckpt), layout, str(back), 5 * 10**9, None))
        out[key] = {"hf": hf_dir, "mcore": str(ckpt), "back": str(back), "dequantised": str(mxfp4["dequantised"])}
    per_rank = run_distributed(_convert_body, 2, args=(jobs,), init_process_group=False, timeout=600)
    for tensors in zip(*per_rank):
        assert all(t > 0 for t in tensors), f"a rank wrote nothing: {tensors} (work was not split)"
    return out


def _assert_same_hf(original_dir: str | Path, exported_dir: str | Path, what: str) -> None:
    """Every tensor of ``exported_dir`` equals the original's bitwise (names, dtypes, shapes, values), and so does
    ``config.json``."""
    original, exported = HFCheckpointReader(original_dir), HFCheckpointReader(exported_dir)
    assert sorted(exported.names()) == sorted(original.names()), what
    for name in original.names():
        a, b = original.get(name), exported.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{what}: {name} changed"
    with open(Path(original_dir) / "config.json") as f, open(Path(exported_dir) / "config.json") as g:
        config = json.load(f)
        if "num_nextn_predict_layers" in config:  # DeepSeek-V3's MTP layers are never exported, nor declared
            config["num_nextn_predict_layers"] = 0
        config.update(BY_MODEL_TYPE[config["model_type"]].vllm_config_fields(config))  # completed for vLLM
        assert config == json.load(g), what


@pytest.mark.parametrize("layout, shape", ROUND_TRIP_CELLS, ids=[f"{lay}-{n}" for lay, n in ROUND_TRIP_CELLS])
def test_round_trip_is_bitwise(layout, shape, converted):
    paths = converted[f"{shape}@{layout}"]
    _assert_same_hf(paths["hf"], paths["back"], f"round trip of {shape} at {layout}")


def test_deepseek_v3_round_trip_at_tp2_pp2_ep2_is_bitwise(converted):
    """Beside the matrix's TP=2xEP=2 cell: DeepSeek-V3's four layers over two uneven pipeline stages too (the dense
    layer alone on the first)."""
    paths = converted["deepseek_v3_mla@tp2_pp2_ep2"]
    _assert_same_hf(paths["hf"], paths["back"], "round trip of deepseek_v3_mla at TP=2 x PP=2 x EP=2")


def _export_each(jobs: list[tuple[str, str, str]]) -> None:
    """The trainer's export (``megatron_opd.train._export``, what ``export_student`` runs in a fresh process) of
    every ``(checkpoint, output, config folder)``: one fresh process for all of them."""
    from megatron_opd.train import _export

    for ckpt_dir, out, hf_config_dir in jobs:
        _export(ckpt_dir, out, hf_config_dir)


def _trainer_export_body(layout: dict, shapes: dict[str, str], root: str) -> None:
    """Each shape as the trainer's student at ``layout``, saved as the trainer saves its final step, then exported
    to ``output_dir/hf`` as ``train.export_student`` does (rank 0, in a fresh process: one for all the shapes)."""
    import torch.distributed as dist

    from megatron_opd.checkpoint.source import config_dir
    from megatron_opd.checkpoint.workers import run_in_fresh_process
    from megatron_opd.config import to_dict
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.train import training_state
    from megatron_opd.trainer.checkpointing import CheckpointManager
    from megatron_opd.trainer.config import CheckpointConfig, StudentConfig, TrainConfig
    from megatron_opd.trainer.setup import build_student

    parallel = ParallelConfig(**layout)
    accel = initialize_distributed(parallel, "cpu")
    exports = []
    for name, hf_dir in shapes.items():
        out = Path(root) / name
        cfg = TrainConfig(student=StudentConfig(path=hf_dir), parallel=parallel, output_dir=str(out),
                          checkpoint=CheckpointConfig(dir=str(out / "checkpoints")))  # fmt: skip
        student = build_student(cfg, accel)
        path = CheckpointManager(cfg.checkpoint.dir).save(
            1, training_state(student, {}, 1, cfg, loading=False), {"config": to_dict(cfg)}
        )
        exports.append((str(path), str(out / "hf"), str(config_dir(cfg.student.path))))
    if dist.get_rank() == 0:
        run_in_fresh_process(_export_each, exports)
    dist.barrier()


@pytest.mark.parametrize("layout", list(MATRIX["trainer HF export (bitwise)"]))
def test_trainer_export_is_bitwise(layout, shape_dirs, tmp_path):
    """A Megatron model loaded from each shape and exported by the trainer at ``layout`` (tied embeddings, padded
    vocabulary rows, split QKV and gate/up) gives back the original safetensors bitwise."""
    world, parallel = LAYOUTS[layout]
    shapes = {name: shape_dirs[name] for name in shapes_at("trainer HF export (bitwise)", layout)}
    run_distributed(_trainer_export_body, world, args=(parallel, shapes, str(tmp_path)), timeout=600)
    for name, hf_dir in shapes.items():
        _assert_same_hf(hf_dir, tmp_path / name / "hf", f"trainer export of {name} at {layout}")


def test_bf16_conversion_is_a_cast(converted):
    """--dtype bf16: the dist_ckpt and the export hold exactly the rounded original weights."""
    paths = converted["qwen3_bf16"]
    original, exported = HFCheckpointReader(paths["hf"]), HFCheckpointReader(paths["back"])
    for name in original.names():
        b = exported.get(name)
        assert b.dtype == torch.bfloat16 and torch.equal(b, original.get(name).to(torch.bfloat16)), name
    config = json.loads((Path(paths["back"]) / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert json.loads((Path(paths["mcore"]) / "conversion.json").read_text())["dtype"] == "bfloat16"


def test_round_trip_keeps_tokenizer_and_shards(converted):
    """A sharded checkpoint with a tokenizer, at TP2xPP2xVP2: bitwise, its side files kept, the export sharded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, back = Path(converted["llama"]["hf"]), Path(converted["llama"]["back"])
    _assert_same_hf(src, back, "round trip of the sharded llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert filecmp.cmp(src / name, back / name, shallow=False), name
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((back / f).stat().st_size <= 300_000 + 20_000 for f in files)
    tokenizer = AutoTokenizer.from_pretrained(back)
    assert tokenizer.decode(tokenizer("student and teacher")["input_ids"]) == "student and teacher"
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.config.vocab_size == 1000 and model.lm_head.weight.shape == (1000, 64)


def test_dist_ckpt_holds_megatron_files(converted):
    ckpt = Path(converted["qwen2_mha_v97@tp2_pp2"]["mcore"])
    assert (ckpt / "metadata.json").is_file() and (ckpt / "common.pt").is_file() and (ckpt / ".metadata").is_file()
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    info = json.loads((ckpt / "conversion.json").read_text())
    assert info["padded_vocab_size"] == 256 and info["tensor_model_parallel_size"] == 2  # vocabulary 97
    assert (ckpt / "hf_config" / "config.json").is_file()
    assert not list(ckpt.parent.glob(".*partial*")), "staging folders were left behind"


def _load_logits_body(ckpts: dict[str, tuple[str, str]], tokens: torch.Tensor):
    """Logits of each dist_ckpt loaded by Megatron at TP=4, then at TP=1 (DP=4) in the same job."""
    from megatron.core import parallel_state as ps

    from megatron_opd.checkpoint import load_model_checkpoint
    from megatron_opd.checkpoint.verify import megatron_logits
    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel
    from megatron_opd.models import build_model, load_architecture

    out = {}
    for tp in (4, 1):
        parallel = ParallelConfig(tensor_model_parallel_size=tp)
        if tp == 4:
            initialize_distributed(parallel)
        else:
            initialize_model_parallel(parallel)
        for name, (hf_dir, ckpt) in ckpts.items():
            arch = load_architecture(hf_dir)
            chunks = build_model(arch, parallel, trainable=False)
            load_model_checkpoint(chunks, ckpt)
            vocab = chunks[0].embedding.word_embeddings.weight.shape[0] * tp
            logits = megatron_logits(chunks, tokens, arch.vocab_size)
            if ps.get_data_parallel_rank() == 0 and logits is not None:
                out[(name, tp)] = (logits, vocab)
    return out


def test_tp2_pp2_checkpoint_loads_at_tp1_and_tp4(converted):
    ckpts = {name[: -len("_tp4")]: (p["hf"], p["mcore"]) for name, p in converted.items() if name.endswith("_tp4")}
    tokens = torch.randint(0, 1100, (2, 16), generator=torch.Generator().manual_seed(1))
    per_rank = run_distributed(_load_logits_body, 4, args=(ckpts, tokens), timeout=600)
    merged = {k: v for r in per_rank for k, v in r.items()}
    assert set(merged) == {(name, tp) for name in ckpts for tp in (4, 1)}
    for (name, tp), (logits, padded_vocab) in merged.items():
        assert padded_vocab == {4: 1536, 1: 1152}[tp], "the layouts must differ in vocabulary padding"
        ref = hf_logits(ckpts[name][0], tokens)
        rel = ((logits - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-5, f"{name} at TP={tp}: max relative error {rel:.2e} vs transformers"


def test_gpt_oss_round_trip_and_mxfp4_export(converted):
    """gpt-oss at TP=2 x PP=2 x EP=2 (expert TP 1): the stacked, interleaved expert tensors, the sinks and every bias
    come back bitwise; its MXFP4 copy converts and exports as the block loop's dequantised weights, unquantised."""
    paths = converted["gpt_oss@tp2_pp2_ep2"]
    _assert_same_hf(paths["hf"], paths["back"], "round trip of gpt_oss_sinks at TP=2 x PP=2 x EP=2")
    paths = converted["gpt_oss_mxfp4"]
    _assert_same_hf(paths["dequantised"], paths["back"], "the MXFP4 gpt-oss converted and exported")


_KILLED_RUN_WITH_A_FORKED_CHILD = """
import os, sys, time
from megatron_opd.trainer.checkpointing import CheckpointManager
manager = CheckpointManager(sys.argv[1])  # held to the end, as by the trainer
manager.acquire_lock()
child = os.fork()
if child == 0:  # as dist_checkpointing's forked Manager: lets go of the output, outlives the run for a while
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
os._exit(17)  # killed: nothing released
"""


def test_a_killed_runs_forked_child_does_not_hold_the_checkpoint_lock(tmp_path):
    """A restart right after a kill finds ``checkpoint.dir`` free while a child the run forked still lives (the
    async-modes quick start's restart once failed with "is in use" by the killed run)."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN_WITH_A_FORKED_CHILD, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 17, proc.stderr[-3000:]
    child = int(proc.stdout.split()[-1])
    try:
        os.kill(child, 0)  # still alive
        with open(tmp_path / ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while anyone holds it
    finally:
        os.kill(child, signal.SIGKILL)
