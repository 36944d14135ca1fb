"""Checkpoint conversion: HF -> dist_ckpt -> HF is bitwise, and Megatron loads the dist_ckpt under other layouts.

References are independent of the converter: the original safetensors files (``torch.equal``),
transformers' logits, and Megatron-Core's own ``dist_checkpointing.load`` at TP=1 and TP=4.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from megatron_opd.models.hf_io import HFCheckpointReader, HFCheckpointWriter
from megatron_opd.models.reference import hf_logits
from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

ROUND_TRIP = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
WRITTEN_AT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)

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
    """The session's tiny models (llama untied, qwen2 tied, qwen3 vocab 1001), one of them sharded with a tokenizer."""
    root = tmp_path_factory.mktemp("ckpt_sources")
    dirs = dict(tiny_model_dirs)
    dirs["llama"] = str(_resharded(Path(tiny_model_dirs["llama"]), root / "llama_sharded", 200_000))
    return dirs


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
def converted(sources, tp4_sources, tmp_path_factory) -> dict[str, dict[str, str]]:
    """All conversions of this module in one 2-process job: round trips at TP2xPP2xVP2, TP4 sources at TP2xPP2."""
    root = tmp_path_factory.mktemp("ckpt_converted")
    jobs, out = [], {}
    for family, hf_dir in sources.items():
        ckpt, back = root / f"{family}_mcore", root / f"{family}_back"
        # llama's export is split into several safetensors files; the others fit one file.
        jobs.append((hf_dir, str(ckpt), ROUND_TRIP, str(back), 300_000 if family == "llama" else 5 * 10**9, None))
        out[family] = {"hf": hf_dir, "mcore": str(ckpt), "back": str(back)}
    ckpt, back = root / "qwen3_bf16_mcore", root / "qwen3_bf16_back"
    jobs.append((sources["qwen3"], str(ckpt), WRITTEN_AT, str(back), 5 * 10**9, "bf16"))
    out["qwen3_bf16"] = {"hf": sources["qwen3"], "mcore": str(ckpt), "back": str(back)}
    for family, hf_dir in tp4_sources.items():
        ckpt = root / f"{family}_tp4src_mcore"
        jobs.append((hf_dir, str(ckpt), WRITTEN_AT, None, 0, None))
        out[f"{family}_tp4"] = {"hf": hf_dir, "mcore": str(ckpt)}
    per_rank = run_distributed(_convert_body, 2, args=(jobs,), init_process_group=False, timeout=600)
    for tensors in zip(*per_rank):
        assert all(t > 0 for t in tensors), f"a rank wrote nothing: {tensors} (work was not split)"
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_round_trip_is_bitwise(family, converted):
    paths = converted[family]
    original, exported = HFCheckpointReader(paths["hf"]), HFCheckpointReader(paths["back"])
    assert sorted(exported.names()) == sorted(original.names())
    for name in original.names():
        a, b = original.get(name), exported.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} changed in the round trip"
    with open(Path(paths["hf"]) / "config.json") as f, open(Path(paths["back"]) / "config.json") as g:
        assert json.load(f) == json.load(g)


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, back = Path(converted["llama"]["hf"]), Path(converted["llama"]["back"])
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
    ckpt = Path(converted["qwen2"]["mcore"])
    assert (ckpt / "metadata.json").is_file() and (ckpt / "common.pt").is_file() and (ckpt / ".metadata").is_file()
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    info = json.loads((ckpt / "conversion.json").read_text())
    assert info["padded_vocab_size"] == 1024 and info["tensor_model_parallel_size"] == 2
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
