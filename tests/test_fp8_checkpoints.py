"""DeepSeek-V3 checkpoints as they are published: FP8 block-quantised weights and multi-token-prediction layers.

The FP8 copy of the tiny DeepSeek-V3 is written here as DeepSeek's is: every attention and MLP/expert projection
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per block (blocks of 16 x 12, so the tiny matrices have
several blocks and partial ones at their edges; a non-square block catches swapped rows and columns), norms,
embeddings, head, router and expert bias unquantised, one MTP layer (index ``num_hidden_layers``) with its own
tensors, in several safetensors shards. References are independent of the package: a dequantisation that loops
over blocks, transformers' logits of the dequantised float32 model, and the dequantised tensors themselves.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_opd.model_files import CheckpointError
from megatron_opd.models.fp8 import dequantize_block_fp8
from megatron_opd.models.hf_io import HFCheckpointReader, HFCheckpointWriter
from megatron_opd.models.reference import hf_logits
from megatron_opd.testing.multiprocess import run_distributed

BLOCK = (16, 12)
FP8_MAX = 448.0  # largest float8_e4m3fn
SEQ = 16
MTP_LINE = "multi-token-prediction layer(s)"


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 format: each block scaled so its largest magnitude is the FP8 maximum; the inverse scales."""
    rows, cols = block
    grid = (math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
    scale_inv = torch.empty(grid, dtype=torch.float32)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            scale_inv[i, j] = part.abs().max().clamp_min(1e-12) / FP8_MAX
            quantized[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (part / scale_inv[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantized, scale_inv


def reference_dequantize(
    quantized: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Block by block: the float32 product of the FP8 values and the block's scale, cast to ``dtype``."""
    rows, cols = block
    out = torch.full(quantized.shape, float("nan"), dtype=dtype)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            span = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[span] = (quantized[span].to(torch.float32) * scale_inv[i, j].item()).to(dtype)
    return out


def _quantised(name: str) -> bool:
    """DeepSeek-V3 quantises the attention and MLP/expert projections (``*_proj.weight``) and MTP's ``eh_proj``."""
    return name.endswith("_proj.weight")


def _mtp_tensors(reader: HFCheckpointReader, layers: int, hidden: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP layer (index ``layers``): a copy of the last decoder layer plus its own tensors."""
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    gen = torch.Generator().manual_seed(7)
    out = {mtp + n[len(last) :]: reader.get(n) for n in reader.names() if n.startswith(last)}
    vocab = reader.entry("model.embed_tokens.weight").shape[0]
    for name, shape in {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "embed_tokens.weight": (vocab, hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
    }.items():
        out[mtp + name] = torch.randn(shape, generator=gen)
    return out


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[str, Path]:
    """The tiny DeepSeek-V3 (``src``), its FP8 copy with an MTP layer (``fp8``) and the dequantised float32 model
    transformers loads as the reference (``dequantised``, no MTP layer, no ``quantization_config``)."""
    from megatron_opd.testing.shapes import make_shape

    root = tmp_path_factory.mktemp("fp8")
    src = make_shape("deepseek_v3_mla", root / "src")
    config = json.loads((src / "config.json").read_text())
    reader = HFCheckpointReader(src)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    fp8, dequantised = root / "fp8", root / "dequantised"
    writer = HFCheckpointWriter(fp8, max_shard_bytes=400_000)  # several shards and an index
    reference = {}
    tensors = {n: reader.get(n) for n in reader.names()} | _mtp_tensors(reader, layers, hidden)
    for name, tensor in tensors.items():
        mtp = name.startswith(f"model.layers.{layers}.")
        if _quantised(name):
            quantized, scale_inv = quantize_blocks(tensor, BLOCK)
            writer.add(name, quantized)
            writer.add(name + "_scale_inv", scale_inv)
            tensor = reference_dequantize(quantized, scale_inv, BLOCK, torch.float32)
        else:
            writer.add(name, tensor)
        if not mtp:
            reference[name] = tensor
    writer.close()
    quantization = dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=list(BLOCK))
    (fp8 / "config.json").write_text(
        json.dumps({**config, "num_nextn_predict_layers": 1, "quantization_config": quantization}, indent=2)
    )
    dequantised.mkdir()
    save_file(reference, dequantised / "model.safetensors", metadata={"format": "pt"})
    (dequantised / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    assert len(list(fp8.glob("*.safetensors"))) > 1
    return {"src": src, "fp8": fp8, "dequantised": dequantised}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, block", [((24, 64), (16, 12)), ((112, 16), (8, 8)), ((300, 200), (128, 128))])
def test_dequantize_equals_blockwise_reference(shape, block, dtype):
    """Partial edge blocks (24 rows in blocks of 16, 64 columns in blocks of 12; 300 x 200 in DeepSeek's 128s)."""
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    quantized, scale_inv = quantize_blocks(weight, block)
    got = dequantize_block_fp8(quantized, scale_inv, block, dtype)
    want = reference_dequantize(quantized, scale_inv, block, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert (got.float() - weight).abs().max() <= weight.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_reader_dequantises_tensors_with_a_scale(fp8_dirs):
    """Through the reader: tensors with a ``_scale_inv`` dequantised (the run's dtype), the rest as stored."""
    fp8 = HFCheckpointReader(fp8_dirs["fp8"])
    dequantised = HFCheckpointReader(fp8_dirs["dequantised"])
    in_bf16 = HFCheckpointReader(fp8_dirs["fp8"], dequantize_dtype=torch.bfloat16)
    assert fp8.quantization is not None and fp8.quantization.block_size == BLOCK
    quantized = [n for n in dequantised.names() if n + "_scale_inv" in fp8]
    assert quantized and all(_quantised(n) for n in quantized)
    assert any(n.endswith("mlp.gate.weight") for n in dequantised.names() if n not in quantized)
    for name in dequantised.names():
        assert torch.equal(fp8.get(name), dequantised.get(name)), name
        if name in quantized:
            want = reference_dequantize(
                fp8.get_stored(name), fp8.get_stored(name + "_scale_inv"), BLOCK, torch.bfloat16
            )
            assert torch.equal(in_bf16.get(name), want), name


def _capture_lines(records: list[str]) -> logging.Handler:
    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    handler = Collect(logging.INFO)
    logger = logging.getLogger("megatron_opd")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _fp8_job(fp8_dir: str, root: str, tokens: torch.Tensor):
    """One process: the Megatron model loaded from the FP8 checkpoint (its logits), then the converter's round trips
    in the checkpoint's dtype (float32) and in bf16; the MTP lines each step logged."""
    from megatron_opd.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.forward_backward import forward_backward

    records: list[str] = []
    _capture_lines(records)
    initialize_distributed(ParallelConfig())
    arch, chunks = build_and_load(fp8_dir, ParallelConfig(), trainable=False)

    def collect(logits, batch):
        return logits.sum() * 0.0, logits.detach()[..., : arch.vocab_size].float()

    with torch.no_grad():
        logits = torch.stack(forward_backward(chunks, [{"tokens": t} for t in tokens], collect, forward_only=True))
    lines = {"load": [r for r in records if MTP_LINE in r]}
    for dtype in (None, "bf16"):
        records.clear()
        ckpt, back = Path(root) / f"mcore_{dtype}", Path(root) / f"back_{dtype}"
        convert_hf_to_mcore(fp8_dir, ckpt, dtype=dtype)
        lines[f"hf-to-mcore {dtype}"] = [r for r in records if MTP_LINE in r]
        convert_mcore_to_hf(ckpt, back)
    return logits, lines


@pytest.fixture(scope="module")
def fp8_job(fp8_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_converted")
    tokens = torch.randint(0, 1000, (2, 2, SEQ), generator=torch.Generator().manual_seed(0))
    (result,) = run_distributed(_fp8_job, 1, args=(str(fp8_dirs["fp8"]), str(root), tokens), timeout=600)
    return tokens, root, result


def test_megatron_model_from_fp8_matches_transformers_on_dequantised_weights(fp8_dirs, fp8_job):
    tokens, _, (logits, lines) = fp8_job
    ref = torch.stack([hf_logits(fp8_dirs["dequantised"], t) for t in tokens])
    assert logits.shape == ref.shape
    rel = float((logits - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, f"max relative error {rel:.2e} vs transformers on the dequantised weights"
    (line,) = lines["load"]
    mtp_tensors = len([n for n in HFCheckpointReader(fp8_dirs["fp8"]).names() if n.startswith("model.layers.4.")])
    assert line.startswith("megatron_opd.models.loading:") and f"skipping {mtp_tensors} tensors" in line, line
    assert "[4]" in line and "num_nextn_predict_layers=1" in line, line


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_converter_round_trip_gives_dequantised_tensors(fp8_dirs, fp8_job, dtype):
    """HF (FP8) -> dist_ckpt -> HF: the dequantised tensors (float32, or cast to bf16) bitwise, no MTP layer (and
    ``num_nextn_predict_layers`` 0 in the exported config.json), no ``quantization_config`` in either config.json;
    the MTP line once per conversion."""
    _, root, (_, lines) = fp8_job
    back, want = HFCheckpointReader(root / f"back_{dtype}"), HFCheckpointReader(fp8_dirs["dequantised"])
    assert sorted(back.names()) == sorted(want.names())
    for name in want.names():
        expected = want.get(name) if dtype is None else want.get(name).to(torch.bfloat16)
        if name.endswith("e_score_correction_bias"):  # Megatron's expert-bias buffer is float32 in any run dtype
            expected = expected.float()
        got = back.get(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    source = json.loads((fp8_dirs["fp8"] / "config.json").read_text())
    exported = json.loads((root / f"back_{dtype}" / "config.json").read_text())
    stored = json.loads((root / f"mcore_{dtype}" / "hf_config" / "config.json").read_text())
    assert "quantization_config" not in exported and "quantization_config" not in stored
    source.pop("quantization_config")
    assert stored == source
    # The MTP layer is not exported (no model.layers.4.* above): config.json declares none either.
    assert source["num_nextn_predict_layers"] == 1
    assert not any(name.startswith("model.layers.4.") for name in back.names())
    assert exported == {**source, "dtype": "bfloat16" if dtype else "float32", "num_nextn_predict_layers": 0}
    (line,) = lines[f"hf-to-mcore {dtype}"]
    assert line.startswith("megatron_opd.checkpoint.hf_to_mcore:") and "[4]" in line, line


def test_verify_of_an_fp8_source(fp8_dirs, fp8_job):
    """``convert.py --verify``: transformers cannot load the FP8 folder here (no accelerate, no GPU), so the check runs
    it on a dequantised copy; the conversion in the source's dtype then verifies as lossless."""
    from megatron_opd.checkpoint.verify import verify_conversion

    _, root, _ = fp8_job
    result = verify_conversion(fp8_dirs["fp8"], root / "mcore_None", num_sequences=2, seq_len=8)
    assert result.max_rel_error <= 1e-5, result


def test_vllm_rollout_engine_config_is_unquantised(fp8_dirs, tmp_path):
    """A student loaded from an FP8 checkpoint syncs dequantised weights: its vLLM engine must not build FP8 layers."""
    from megatron_opd.rollout.vllm_setup import engine_model_dir

    config = json.loads((engine_model_dir(fp8_dirs["fp8"], tmp_path, 1000) / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v3"


def _with_config(fp8_dirs, tmp_path, **quantization) -> Path:
    """A copy of the FP8 checkpoint whose ``quantization_config`` has ``quantization`` (None: drop the field)."""
    folder = tmp_path / "changed"
    folder.mkdir(parents=True)
    for path in fp8_dirs["fp8"].iterdir():
        (folder / path.name).symlink_to(path)
    config = json.loads((fp8_dirs["fp8"] / "config.json").read_text())
    (folder / "config.json").unlink()
    if quantization.get("drop"):
        config.pop("quantization_config")
    else:
        config["quantization_config"] = {**config["quantization_config"], **quantization}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(quant_method="gptq"), "quant_method='gptq' is not supported"),
        (dict(fmt="e5m2"), "fmt='e5m2' is not supported"),
        (dict(activation_scheme="static"), "activation_scheme='static' is not supported"),
        (dict(weight_block_size=None), "weight_block_size=None must be two positive integers"),
        (dict(weight_block_size=[128]), "weight_block_size=[128] must be two positive integers"),
    ],
)
def test_other_quantisation_is_refused_by_name(fp8_dirs, tmp_path, change, words):
    """By the reader every loader uses, and by the converter before it writes anything."""
    from megatron_opd.checkpoint import convert_hf_to_mcore

    folder = _with_config(fp8_dirs, tmp_path, **change)
    with pytest.raises(CheckpointError, match="quantization_config") as err:
        HFCheckpointReader(folder)
    assert words in str(err.value) and "fp8_cast_bf16" in str(err.value)
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        convert_hf_to_mcore(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inconsistent_fp8_checkpoints_are_refused(fp8_dirs, tmp_path):
    """A scale without ``quantization_config``, a block size the scales disagree with."""
    name = "model.layers.0.self_attn.q_a_proj.weight"
    with pytest.raises(CheckpointError, match="has a 'model.*_scale_inv' companion but .* has no quantization_config"):
        HFCheckpointReader(_with_config(fp8_dirs, tmp_path / "a", drop=True)).get(name)
    with pytest.raises(CheckpointError, match=r"needs \(1, 1\); the checkpoint and its config.json disagree"):
        HFCheckpointReader(_with_config(fp8_dirs, tmp_path / "b", weight_block_size=[128, 128])).get(name)
