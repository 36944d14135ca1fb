"""The converter's command line (``opd-convert``; ``tools/checkpoint/convert.py`` in a checkout): both directions with
``--verify``, exit codes, messages."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_opd.checkpoint.convert import main as convert_main
from megatron_opd.checkpoint.convert import parse_size

REPO = Path(__file__).resolve().parents[1]
CONVERT = REPO / "tools" / "checkpoint" / "convert.py"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CONVERT), *args], capture_output=True, text=True, timeout=600, cwd=REPO)


def refused(args: list[str]) -> int:
    """The command's ``main(args)`` in this process, for an input it refuses before any work; the log levels it sets
    for its own output are put back after."""
    loggers = [logging.getLogger(name) for name in ("megatron_opd.checkpoint", "megatron_opd.checkpoint.verify")]
    levels = [logger.level for logger in loggers]
    try:
        return convert_main(args)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@pytest.fixture(scope="module")
def qwen2_ckpt(tiny_model_dirs, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The tied-embedding Qwen2 converted at TP=2 x PP=2 x VP=2 by the CLI, with --verify."""
    ckpt = tmp_path_factory.mktemp("cli") / "mcore"
    args = ("--hf-dir", tiny_model_dirs["qwen2"], "--out", str(ckpt), "--tp", "2", "--pp", "2", "--vp", "2")
    return cli("hf-to-mcore", *args, "--verify"), ckpt


def test_hf_to_mcore_with_verify(qwen2_ckpt, tiny_model_dirs, capsys):
    done, ckpt = qwen2_ckpt
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify: max relative error of logits" in done.stdout and ": OK" in done.stdout, done.stdout
    assert "tensors" in done.stderr  # the progress bar counts tensors as well as bytes
    # Refused before any work (the command's exit status is main's): in this process, not another start-up.
    assert refused(["hf-to-mcore", "--hf-dir", tiny_model_dirs["qwen2"], "--out", str(ckpt)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err


def test_mcore_to_hf_with_verify(qwen2_ckpt, tmp_path, capsys):
    _, ckpt = qwen2_ckpt
    done = cli("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back"), "--verify", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": OK" in done.stdout and (tmp_path / "back" / "config.json").is_file()
    assert refused(["mcore-to-hf", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    # a LoRA student's adapters as PEFT: refused for a checkpoint without adapters (its export: tests/test_lora.py)
    assert refused(["lora-to-peft", "--ckpt", str(ckpt), "--out", str(tmp_path / "peft")]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err


def test_verify_detects_a_wrong_checkpoint(qwen2_ckpt, tiny_model_dirs, tmp_path):
    """The --verify comparison can fail: the dist_ckpt checked against a slightly different HF model."""
    from safetensors.torch import load_file, save_file

    from megatron_opd.checkpoint import verify_conversion

    _, ckpt = qwen2_ckpt
    src, other = Path(tiny_model_dirs["qwen2"]), tmp_path / "other"
    other.mkdir()
    for f in src.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tensors = load_file(other / "model.safetensors")
    tensors["model.layers.3.mlp.down_proj.weight"] *= 1.01
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    differs = verify_conversion(other, ckpt, num_sequences=2, seq_len=8)
    assert differs.max_rel_error > 1e-4, differs


@pytest.mark.parametrize(
    ("text", "size"), [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("1000", 1000), ("1.5MB", 1_500_000)]
)
def test_max_shard_size_parsing(text, size):
    assert parse_size(text) == size
