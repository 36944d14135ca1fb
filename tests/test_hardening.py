"""Bad inputs fail with a ValueError that names the file, field, option or token and says what to do.

Damaged dist_ckpt files, broken ``config.json``, a zero vocabulary-padding multiple, non-finite logits in the
dense loss, and a vocabulary shard passed to a loss with no tensor-parallel group to reduce over.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_opd.losses import dense_divergence, topk_divergence
from megatron_opd.models import hf_config
from megatron_opd.testing.multiprocess import run_distributed

REPO = Path(__file__).resolve().parents[1]


# --- 1. a truncated or corrupt .distcp file -------------------------------------------------------------------


def _export_error(ckpt: Path, out: Path) -> tuple[str, str]:
    from megatron_opd.checkpoint import convert_mcore_to_hf

    try:
        convert_mcore_to_hf(ckpt, out)
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return type(err).__name__, str(err)
    return "no error", ""


def _load_error(hf_dir: str, ckpt: Path) -> tuple[str, str]:
    """Build the TP=1 model and load ``ckpt`` into it, as ``verify`` and the trainer do."""
    from megatron_opd.checkpoint.mcore_io import load_model_checkpoint
    from megatron_opd.distributed.cpu_compat import apply_cpu_patches
    from megatron_opd.distributed.parallel import ParallelConfig, destroy_distributed, initialize_model_parallel
    from megatron_opd.models import load_architecture
    from megatron_opd.models.builder import ModelBuildConfig, build_model

    apply_cpu_patches()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelConfig())
        build = ModelBuildConfig(dtype="fp32", use_transformer_engine=False)
        chunks = build_model(load_architecture(hf_dir), ParallelConfig(), build, trainable=False)
        load_model_checkpoint(chunks, ckpt)
    except BaseException as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    finally:
        destroy_distributed()
    return "no error", ""


def _damaged_checkpoint_body(hf_dir: str, tmp: str) -> dict:
    """Convert once, then load and export copies with the largest .distcp truncated, with one stored item's zip
    header overwritten, and with an item damaged where only reading it tells (its central directory)."""
    from megatron_opd.checkpoint import convert_hf_to_mcore

    tmp_path = Path(tmp)
    good = tmp_path / "ckpt"
    convert_hf_to_mcore(hf_dir, good)
    largest = max(good.glob("*.distcp"), key=lambda p: p.stat().st_size).name
    out: dict = {"largest": largest}

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data = (truncated / largest).read_bytes()
    (truncated / largest).write_bytes(data[: len(data) // 2])
    out["truncated_export"] = _export_error(truncated, tmp_path / "out")
    out["truncated_load"] = _load_error(hf_dir, truncated)

    header = tmp_path / "header"
    shutil.copytree(good, header)
    with open(header / largest, "r+b") as f:  # the first item starts at byte 0
        f.write(b"\xff" * 16)
    out["header_load"] = _load_error(hf_dir, header)

    inner = tmp_path / "inner"
    shutil.copytree(good, inner)
    _overwrite_central_directory(inner, largest)
    out["inner_export"] = _export_error(inner, tmp_path / "out")
    out["out_exists"] = (tmp_path / "out").exists() or bool(list(tmp_path.glob(".out.*")))
    return out


def _overwrite_central_directory(ckpt: Path, name: str) -> None:
    """Zero 200 bytes just before the end record of ``name``'s first item: its zip signatures stay intact."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    info = min((i for i in metadata.storage_data.values() if i.relative_path == name), key=lambda i: i.offset)
    end = info.offset + info.length - 22
    with open(ckpt / name, "r+b") as f:
        f.seek(end - 200)
        f.write(b"\x00" * 200)


def test_damaged_distcp_is_a_checkpoint_error_naming_the_file(tiny_model_dirs, tmp_path):
    (out,) = run_distributed(
        _damaged_checkpoint_body, 1, args=(tiny_model_dirs["qwen3"], str(tmp_path)), init_process_group=False
    )
    largest = out["largest"]
    for case in ("truncated_export", "truncated_load"):
        kind, message = out[case]
        assert kind == "CheckpointError", (case, kind, message)
        assert f"truncated/{largest} is truncated" in message and "incomplete or damaged" in message, message
    kind, message = out["header_load"]
    assert kind == "CheckpointError" and f"header/{largest} is corrupted" in message, (kind, message)
    kind, message = out["inner_export"]
    assert kind == "CheckpointError", (kind, message)
    assert f"{tmp_path / 'inner'}: reading its .distcp files failed" in message, message
    assert "incomplete or damaged" in message
    assert not out["out_exists"], "a failed export left output behind"


# --- 2. a malformed or incomplete config.json -----------------------------------------------------------------


def _config_dir(tiny_model_dirs, tmp_path: Path, text: str | None = None, **changes) -> Path:
    cfg = json.loads((Path(tiny_model_dirs["qwen3"]) / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(text if text is not None else json.dumps(cfg))
    return tmp_path


def test_malformed_config_json_names_the_file(tiny_model_dirs, tmp_path):
    hf_dir = _config_dir(tiny_model_dirs, tmp_path, text='{"model_type": "qwen3", "hidden_size": 64,')
    with pytest.raises(hf_config.ConfigFileError, match=rf"{tmp_path / 'config.json'} is not valid JSON"):
        hf_config.load_architecture(hf_dir)


def test_config_json_missing_a_field_names_the_file_and_field(tiny_model_dirs, tmp_path):
    hf_dir = _config_dir(tiny_model_dirs, tmp_path, num_attention_heads=None)
    with pytest.raises(hf_config.ConfigFileError, match=rf"{tmp_path / 'config.json'} has no 'num_attention_heads'"):
        hf_config.load_architecture(hf_dir)
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="config.json has no 'num_hidden_layers'"):
        hf_config.architecture_from_hf_config(cfg)


def test_config_json_mistyped_field_names_the_file_and_field(tiny_model_dirs, tmp_path):
    hf_dir = _config_dir(tiny_model_dirs, tmp_path, num_hidden_layers="four")
    with pytest.raises(hf_config.ConfigFileError, match="field 'num_hidden_layers' must be a positive integer"):
        hf_config.load_architecture(hf_dir)


# --- 3. --make-vocab-size-divisible-by 0 ----------------------------------------------------------------------


def _convert_cli():
    spec = importlib.util.spec_from_file_location("convert_cli", REPO / "tools" / "checkpoint" / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", ["0", "-128"])
def test_cli_refuses_a_non_positive_vocab_padding_multiple(value, capsys, tmp_path):
    parser = _convert_cli().build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["hf-to-mcore", "--hf-dir", "x", "--out", "y", "--make-vocab-size-divisible-by", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--make-vocab-size-divisible-by: must be a positive integer" in err, err


@pytest.mark.parametrize("multiple", [0, -1])
def test_padded_vocab_size_refuses_a_non_positive_multiple(multiple, tiny_model_dirs, tmp_path):
    arch = hf_config.load_architecture(tiny_model_dirs["qwen3"])
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by .* must be a positive integer"):
        arch.padded_vocab_size(2, multiple)
    from megatron_opd.checkpoint import convert_hf_to_mcore

    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        convert_hf_to_mcore(tiny_model_dirs["qwen3"], tmp_path / "out", make_vocab_size_divisible_by=multiple)
    assert not (tmp_path / "out").exists()


# --- 4. NaN / inf logits in dense_divergence -------------------------------------------------------------------


def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize(
    ("who", "value", "what"),
    [
        ("teacher", math.nan, "a NaN or \\+inf logit"),
        ("teacher", math.inf, "a NaN or \\+inf logit"),
        ("student", math.nan, "a NaN or \\+inf logit"),
        ("student", -math.inf, "no finite logit \\(all -inf\\)"),  # the whole row
    ],
)
def test_dense_divergence_names_the_token_with_a_non_finite_logit(kind, who, value, what):
    student_BSV, teacher_BSV = _logits(2, 3, 16), _logits(2, 3, 16, seed=1)
    bad = student_BSV if who == "student" else teacher_BSV
    if value == -math.inf:
        bad[1, 2] = value
    else:
        bad[1, 2, 5] = value
    with pytest.raises(ValueError, match=rf"{who}_logits has {what} at position \(1, 2\)"):
        dense_divergence(student_BSV, teacher_BSV, kind)
    dense_divergence(student_BSV, teacher_BSV, kind, validate=False)  # unchecked: NaN (or worse, a silent 0)


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_dense_divergence_accepts_some_minus_inf_logits(kind):
    student_TV, teacher_TV = _logits(4, 16), _logits(4, 16, seed=1)
    teacher_TV[2, :15] = -math.inf  # a masked token: one finite logit is enough
    student_TV[2, 3] = -math.inf  # where the teacher has no mass either
    loss_T = dense_divergence(student_TV, teacher_TV, kind, chunk_size=3)
    assert torch.isfinite(loss_T).all()


def _nan_on_rank1_body() -> list[str]:
    """TP=2: the NaN sits in rank 1's shard; both ranks must raise (and neither hang in a later collective)."""
    rank = dist.get_rank()
    student_TV, teacher_TV = _logits(5, 32), _logits(5, 32, seed=1)
    teacher_TV[3, 20] = math.nan
    cols = slice(rank * 16, (rank + 1) * 16)
    messages = []
    for kind in ("forward_kl", "jsd"):
        try:
            dense_divergence(student_TV[:, cols], teacher_TV[:, cols], kind, group=dist.group.WORLD, vocab_size=30)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_dense_divergence_non_finite_check_under_tensor_parallelism():
    for messages in run_distributed(_nan_on_rank1_body, 2):
        assert all("teacher_logits has a NaN or +inf logit at token 3" in m for m in messages), messages


# --- 5. a vocabulary shard and no tensor-parallel group --------------------------------------------------------


def test_losses_on_a_shard_without_a_group_ask_for_one():
    student_TV, teacher_TV = _logits(4, 16), _logits(4, 16, seed=1)
    with pytest.raises(ValueError, match="no tensor-parallel group is available.*pass group="):
        dense_divergence(student_TV, teacher_TV, "forward_kl", vocab_size=32)
    ids_TK = torch.tensor([[20, 1], [2, 3], [4, 5], [6, 7]])
    logprobs_TK = torch.full((4, 2), -2.0)
    with pytest.raises(ValueError, match="no tensor-parallel group is available.*parallel state"):
        topk_divergence(student_TV, ids_TK, logprobs_TK, "forward_kl", vocab_size=32)
    # No vocab_size: the width is taken as the vocabulary, and id 20 may be the teacher's fault or a missing group.
    with pytest.raises(ValueError, match="id 20 at token 0.*no tensor-parallel group was found: pass group="):
        topk_divergence(student_TV, ids_TK, logprobs_TK, "forward_kl")
