"""Quick start: a tensor-parallel Megatron-Core student built from a Hugging Face checkpoint, on CPU.

    torchrun --nproc-per-node 2 examples/quickstart.py [parallel.tensor_model_parallel_size=2 family=qwen3]

Rank 0 makes a tiny random Hugging Face model and tokenizer (nothing is downloaded); every rank
builds its shard of the Megatron-Core GPTModel and loads its slice of the weights; the logits,
vocab-sharded across the tensor-parallel ranks, are compared with transformers' own forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_opd.config import parse_args
from megatron_opd.distributed import ParallelConfig, destroy_distributed, initialize_distributed
from megatron_opd.distributed.gather import gather_vocab_shards
from megatron_opd.models import ModelBuildConfig, build_model, load_architecture, load_hf_weights
from megatron_opd.models.pipeline import forward_backward

logger = logging.getLogger("quickstart")


@dataclass
class QuickStartConfig:
    """Build a TP-sharded student from a tiny local checkpoint and check it against transformers."""

    family: str = "qwen3"
    """Tiny model family to create: llama, qwen2 or qwen3."""
    workdir: str = "runs/quickstart"
    """Where the tiny Hugging Face checkpoint and tokenizer are written."""
    prompt: str = "On-policy distillation trains a small student on its own samples"
    """Text fed through both models."""
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(tensor_model_parallel_size=2))
    """Layout of the student (the process count must be a multiple of TP*PP)."""
    build: ModelBuildConfig = field(default_factory=ModelBuildConfig)
    """Model builder options."""


def prepare_checkpoint(cfg: QuickStartConfig) -> Path:
    from megatron_opd.testing.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

    hf_dir = Path(cfg.workdir) / f"tiny-{cfg.family}"
    make_tiny_hf_model(cfg.family, hf_dir)
    make_tiny_tokenizer(hf_dir, vocab_size=1000)
    return hf_dir


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = parse_args(QuickStartConfig)
    initialize_distributed(cfg.parallel)
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    hf_dir = Path(cfg.workdir) / f"tiny-{cfg.family}"
    if rank == 0:
        prepare_checkpoint(cfg)
    dist.barrier()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokens = torch.tensor([tokenizer(cfg.prompt)["input_ids"]])

    arch = load_architecture(hf_dir)
    chunks = build_model(arch, cfg.parallel, cfg.build)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    load_hf_weights(chunks, arch, hf_dir, tp_rank=tp_rank, tp_size=tp_size)
    local_params = sum(p.numel() for c in chunks for p in c.parameters())
    logger.info("rank %d: TP rank %d/%d holds %d parameters", rank, tp_rank, tp_size, local_params)

    shard_shape = {}

    def collect(logits_BSV: torch.Tensor, batch):
        shard_shape["local"] = tuple(logits_BSV.shape)
        # Gathering the vocabulary is for this demo only; training losses work on the shards.
        full = gather_vocab_shards(logits_BSV.detach(), ps.get_tensor_model_parallel_group())
        return logits_BSV.sum() * 0.0, full[..., : arch.vocab_size]

    with torch.no_grad():
        outputs = forward_backward(chunks, [{"tokens": tokens}], collect, forward_only=True)

    if outputs and tp_rank == 0:
        from transformers import AutoModelForCausalLM

        ours = outputs[0].float().cpu()
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
        with torch.no_grad():
            ref = hf_model(input_ids=tokens).logits
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"\nmegatron-opd quick start: {arch.family} student, {tokens.shape[1]} tokens")
        print(f"  layout                TP={tp_size} PP={cfg.parallel.pipeline_model_parallel_size}")
        print(
            f"  logits shard per rank {shard_shape['local']} (vocab {arch.vocab_size} padded to {chunks[-1].vocab_size})"
        )
        print(f"  max relative error vs transformers: {rel:.2e}   argmax agreement: {agree:.0%}")
        print("  PASS" if rel < 1e-4 else "  FAIL")
        if rel >= 1e-4:
            raise SystemExit(1)
    destroy_distributed()


if __name__ == "__main__":
    main()
