"""Checkpoint conversion fails early and clearly, and never leaves a half-written or clobbered output."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_opd.checkpoint import OutputExistsError, convert_hf_to_mcore, convert_mcore_to_hf
from megatron_opd.checkpoint.safetensors_out import plan_shards
from megatron_opd.checkpoint.workers import split_contiguous
from megatron_opd.dtypes import TensorMeta
from megatron_opd.models import CheckpointError, UnsupportedArchitectureError
from megatron_opd.models.hf_io import HFCheckpointReader, HFCheckpointWriter
from megatron_opd.testing.multiprocess import run_distributed


@pytest.fixture
def sharded(tiny_model_dirs, tmp_path) -> Path:
    """The tiny Llama as several safetensors shards with an index."""
    src = Path(tiny_model_dirs["llama"])
    dst = tmp_path / "sharded"
    reader = HFCheckpointReader(src)
    writer = HFCheckpointWriter(dst, max_shard_bytes=150_000)
    for name in reader.names():
        writer.add(name, reader.get(name))
    writer.close()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _shard_of(hf_dir: Path, tensor: str) -> Path:
    return hf_dir / json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _nothing_written(tmp_path: Path) -> bool:
    return not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_unsupported_architecture(sharded, tmp_path):
    cfg = json.loads((sharded / "config.json").read_text())
    cfg.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    (sharded / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="gpt_neox"):
        convert_hf_to_mcore(sharded, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_missing_shard_names_tensor_and_file(sharded, tmp_path):
    shard = _shard_of(sharded, "model.layers.2.mlp.up_proj.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {shard.name} .* is missing"):
        convert_hf_to_mcore(sharded, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_truncated_shard(sharded, tmp_path):
    shard = _shard_of(sharded, "model.layers.1.self_attn.q_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated"):
        convert_hf_to_mcore(sharded, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_corrupted_safetensors_header(sharded, tmp_path):
    shard = _shard_of(sharded, "model.norm.weight")
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage inside the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted"):
        convert_hf_to_mcore(sharded, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_wrong_shape_names_tensor_and_file(sharded, tmp_path):
    name = "model.layers.3.self_attn.v_proj.weight"
    shard = _shard_of(sharded, name)
    reader = HFCheckpointReader(sharded)
    tensors = {n: reader.get(n) for n, f in reader.weight_map.items() if f == shard.name}
    tensors[name] = torch.zeros(48, 64)
    from safetensors.torch import save_file

    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.* in {shard.name} has shape \(48, 64\).*\(64, 64\)"):
        convert_hf_to_mcore(sharded, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_refuses_to_overwrite_without_force(tiny_model_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous checkpoint")
    with pytest.raises(OutputExistsError, match="--force"):
        convert_hf_to_mcore(tiny_model_dirs["qwen3"], out)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    (ckpt / ".metadata").write_bytes(b"")
    with pytest.raises(OutputExistsError, match="--force"):
        convert_mcore_to_hf(ckpt, out, hf_config_dir=tiny_model_dirs["qwen3"])
    assert (out / "keep.txt").read_text() == "previous checkpoint"
    with pytest.raises(ValueError, match="would replace the input"):
        convert_hf_to_mcore(tiny_model_dirs["qwen3"], tiny_model_dirs["qwen3"], force=True)


def test_mcore_to_hf_rejects_non_checkpoints(tiny_model_dirs, tmp_path):
    with pytest.raises(CheckpointError, match="not a complete torch_dist checkpoint"):
        convert_mcore_to_hf(tiny_model_dirs["llama"], tmp_path / "out")
    fake = tmp_path / "fake_ckpt"
    fake.mkdir()
    (fake / "metadata.json").write_text("{}")
    (fake / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="--hf-config-dir"):
        convert_mcore_to_hf(fake, tmp_path / "out")


def _mismatch_body(hf_dir: str, tmp: str) -> list[str]:
    """Convert, then export with a config.json of another depth, then with a damaged .metadata."""
    from megatron_opd.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf

    tmp_path = Path(tmp)
    ckpt = tmp_path / "ckpt"
    convert_hf_to_mcore(hf_dir, ckpt)
    other = tmp_path / "other_config"
    other.mkdir()
    cfg = json.loads((ckpt / "hf_config" / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (other / "config.json").write_text(json.dumps(cfg))
    messages = []
    for kwargs in (dict(hf_config_dir=other), dict()):
        try:
            convert_mcore_to_hf(ckpt, tmp_path / "out", **kwargs)
            messages.append("no error")
        except CheckpointError as err:
            messages.append(str(err))
        (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:100])
    return messages


def test_mcore_to_hf_rejects_a_mismatched_config_or_damaged_metadata(tiny_model_dirs, tmp_path):
    (messages,) = run_distributed(
        _mismatch_body, 1, args=(tiny_model_dirs["qwen3"], str(tmp_path)), init_process_group=False
    )
    depth, damaged = messages
    assert re.search(r"decoder\.layers\..* has shape \(4, .*config\.json implies \(6, ", depth), depth
    assert "metadata is corrupted or truncated" in damaged, damaged
    assert _nothing_written(tmp_path)


def _failing_conversion_body(hf_dir: str, out: str):
    """Replace ``out`` with --force while the 10th tensor read fails (think: a disk error); then retry."""
    from megatron_opd.checkpoint import convert_hf_to_mcore
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.models import hf_io

    out_dir = Path(out)
    calls = {"n": 0}
    real_get = hf_io.HFCheckpointReader.get

    def flaky_get(self, name, expected_shape=None):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError(f"Input/output error reading {name}")
        return real_get(self, name, expected_shape)

    hf_io.HFCheckpointReader.get = flaky_get
    try:
        convert_hf_to_mcore(hf_dir, out, ParallelConfig(tensor_model_parallel_size=2), force=True)
        failure = None
    except OSError as err:
        failure = str(err)
    finally:
        hf_io.HFCheckpointReader.get = real_get
    after_failure = (sorted(p.name for p in out_dir.iterdir()), sorted(p.name for p in out_dir.parent.glob(".out.*")))
    retried = convert_hf_to_mcore(hf_dir, out, ParallelConfig(tensor_model_parallel_size=2), force=True)
    return failure, calls["n"], after_failure, retried.tensors


def test_failed_conversion_leaves_existing_output_untouched(tiny_model_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous checkpoint")
    (result,) = run_distributed(
        _failing_conversion_body, 1, args=(tiny_model_dirs["qwen2"], str(out)), init_process_group=False
    )
    failure, reads, (files_after_failure, leftovers_after_failure), tensors = result
    assert failure is not None and "Input/output error" in failure and reads >= 10
    assert files_after_failure == ["keep.txt"] and leftovers_after_failure == []
    assert tensors > 0 and (out / "metadata.json").is_file(), "the retry with --force must replace the folder"
    assert not (out / "keep.txt").exists()
    assert not list(tmp_path.glob(".out.*")), "staging or replaced folders were left behind"


def test_split_contiguous_balances_bytes_and_covers_everything():
    items = list(range(10))
    sizes = [100, 1, 1, 1, 100, 1, 1, 1, 100, 1]
    parts = [split_contiguous(items, sizes, 3, p) for p in range(3)]
    assert [x for part in parts for x in part] == items
    totals = [sum(sizes[i] for i in part) for part in parts]
    assert all(abs(t - sum(sizes) / 3) <= 3 for t in totals), totals  # each run within a few small items


def test_planned_shards_match_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.randn(4, 4).half(),
    }
    plan = plan_shards([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], max_shard_bytes=70)
    assert len(plan.files) == 3
    plan.create_files(tmp_path)
    for name in ("d", "b", "a", "c"):  # any order: every tensor has its own place
        plan.write(tmp_path, name, tensors[name])
    plan.write_index(tmp_path)
    loaded = {}
    for shard in plan.files:
        loaded.update(load_file(tmp_path / shard.name))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with pytest.raises(ValueError, match="planned"):
        plan.write(tmp_path, "a", torch.randn(5, 3))
