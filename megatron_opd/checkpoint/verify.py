"""Check a conversion end to end: transformers' logits on the Hugging Face side, Megatron-Core's on the dist_ckpt side.

Both models run in float32 on a few random sequences; the reported error is
``max |megatron - transformers| / max |transformers|``. This loads each model whole (one after the
other, in a fresh process), so it is meant for models that fit in memory in float32. transformers loads an FP8
block-quantised folder only with accelerate on a GPU: such a source is first dequantised (to its ``torch_dtype``, as
the conversion does by default) into a temporary copy, so the check covers the weight mapping, not the dequantisation
(``tests/test_fp8_checkpoints.py`` checks that against a reference).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_opd.checkpoint.workers import run_in_fresh_process

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogitsComparison:
    """How far Megatron's logits are from transformers' on the same tokens."""

    max_rel_error: float
    """max |megatron - transformers| / max |transformers| over every position and vocabulary entry."""
    max_abs_error: float
    num_sequences: int
    seq_len: int


def random_tokens(vocab_size: int, num_sequences: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[num_sequences, seq_len]`` token ids drawn uniformly from the true (unpadded) vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_sequences, seq_len), generator=generator)


def megatron_logits(chunks: list, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full ``[b, s, V]`` logits of ``tokens`` ``[b, s]`` on the last pipeline stage's TP rank 0 (and CP rank 0),
    else None.

    A collective over the model's tensor-, pipeline- and context-parallel groups: call it on every rank. With
    context parallelism the sequence is split as the training step splits it (``models.context_parallel``) and the
    logits are gathered back whole.
    """
    from megatron.core import parallel_state

    from megatron_opd.distributed.gather import gather_vocab_shards
    from megatron_opd.models.context_parallel import ContextParallelSplit, split_micro_batch
    from megatron_opd.models.forward_backward import forward_backward

    tp_group = parallel_state.get_tensor_model_parallel_group()
    split = ContextParallelSplit.current()
    mb = {"tokens": tokens}
    if split is not None:
        mb = split_micro_batch(mb, split, per_token=set(), pad_multiple=split.pad_multiple(chunks[0].config))

    def collect(logits, batch):
        full = gather_vocab_shards(logits.detach().float(), tp_group)[..., :vocab_size]
        if split is not None:  # this rank's positions -> the whole sequence, without the padding
            full = split.gather(full)[:, : tokens.shape[1]]
        return logits.sum() * 0.0, full.cpu()

    with torch.no_grad():
        data = forward_backward(chunks, [mb], collect, forward_only=True)
    if data and parallel_state.get_tensor_model_parallel_rank() == 0 and (split is None or split.rank == 0):
        return data[0]
    return None


def compare_logits(ours: torch.Tensor, reference: torch.Tensor) -> LogitsComparison:
    if ours.shape != reference.shape:
        raise ValueError(f"logits shapes differ: Megatron {tuple(ours.shape)}, transformers {tuple(reference.shape)}")
    diff = (ours.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item() or 1.0
    return LogitsComparison(diff / scale, diff, reference.shape[0], reference.shape[1])


def dequantised_copy(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``hf_dir``'s weights that megatron-opd loads, FP8 ones dequantised to the config's dtype, a tensor at a time,
    with its ``config.json`` minus ``quantization_config``: a folder transformers loads without a quantizer."""
    import json

    from megatron_opd.dtypes import parse_dtype
    from megatron_opd.models.fp8 import SCALE_SUFFIX, without_quantization
    from megatron_opd.models.hf_config import load_architecture
    from megatron_opd.models.hf_io import HFCheckpointReader, HFCheckpointWriter
    from megatron_opd.models.mtp import mtp_layer_tensors

    arch = load_architecture(hf_dir)
    reader = HFCheckpointReader(hf_dir, dequantize_dtype=parse_dtype(arch.torch_dtype))
    skipped = {n for names in mtp_layer_tensors(reader, arch.num_layers).values() for n in names}
    writer = HFCheckpointWriter(out_dir)
    for name in reader.names():
        if name not in skipped and not name.endswith(SCALE_SUFFIX):
            writer.add(name, reader.get(name))
    writer.close()
    (Path(out_dir) / "config.json").write_text(json.dumps(without_quantization(reader.config), indent=2))
    return Path(out_dir)


def _reference_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_opd.models.hf_io import HFCheckpointReader
    from megatron_opd.models.reference import hf_logits

    if HFCheckpointReader(hf_dir).quantization is None:
        return hf_logits(hf_dir, tokens)
    with tempfile.TemporaryDirectory(prefix="megatron_opd_dequantised_") as tmp:
        return hf_logits(dequantised_copy(hf_dir, tmp), tokens)


def _verify(hf_dir: str, ckpt_dir: str, num_sequences: int, seq_len: int, seed: int) -> LogitsComparison:
    import warnings

    import torch.distributed as dist

    # This is our own short-lived process: keep its output to the result, not to optional-backend notices.
    for module in (r"megatron\..*", r"torch\.distributed\.checkpoint\..*"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)

    from megatron_opd.checkpoint.mcore_io import load_model_checkpoint
    from megatron_opd.distributed.cpu_compat import apply_cpu_patches
    from megatron_opd.distributed.parallel import ParallelConfig, destroy_distributed, initialize_model_parallel
    from megatron_opd.models.builder import ModelBuildConfig, build_model
    from megatron_opd.models.hf_config import load_architecture

    arch = load_architecture(hf_dir)
    tokens = random_tokens(arch.vocab_size, num_sequences, seq_len, seed)
    reference = _reference_logits(hf_dir, tokens)  # transformers' model is freed before Megatron's is built

    apply_cpu_patches()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelConfig())
        # The local layer spec on every machine: the comparison is about the weights, not the kernels.
        build = ModelBuildConfig(dtype="fp32", use_transformer_engine=False)
        chunks = build_model(arch, ParallelConfig(), build, trainable=False)
        load_model_checkpoint(chunks, ckpt_dir)
        ours = megatron_logits(chunks, tokens, arch.vocab_size)
    finally:
        destroy_distributed()
    assert ours is not None
    return compare_logits(ours, reference)


def verify_conversion(
    hf_dir: str | os.PathLike,
    ckpt_dir: str | os.PathLike,
    *,
    num_sequences: int = 4,
    seq_len: int = 32,
    seed: int = 0,
) -> LogitsComparison:
    """Compare transformers on ``hf_dir`` with Megatron-Core (TP=1) on the ``dist_ckpt`` in ``ckpt_dir``."""
    result = run_in_fresh_process(_verify, str(hf_dir), str(ckpt_dir), num_sequences, seq_len, seed)
    logger.info(
        "verify: max relative logits error %.3e (max abs %.3e) on %d random sequences of %d tokens",
        result.max_rel_error,
        result.max_abs_error,
        result.num_sequences,
        result.seq_len,
    )
    return result
