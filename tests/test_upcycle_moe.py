"""``megatron_opd.models.upcycle`` (``tools/upcycle_moe.py``; the quick start's ``--moe`` student): the upcycled
Qwen3-MoE computes the dense model's logits, in transformers and as megatron-opd's Megatron model, and every expert
starts as the dense MLP."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed


def _megatron_logits(hf_dir: str, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.checkpoint.verify import megatron_logits
    from megatron_opd.distributed import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig())
    return megatron_logits(build_and_load(hf_dir, ParallelConfig())[1], tokens, vocab)


def test_upcycled_moe_computes_the_dense_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_opd.models.upcycle import upcycle_to_moe
    from megatron_opd.tasks import digits

    dense_dir = digits.make_model(tmp_path / "dense", "student", seed=1)  # the quick start's student (tied)
    moe_dir = upcycle_to_moe(dense_dir, tmp_path / "moe", experts=4, top_k=2)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir).float().eval()
    moe = AutoModelForCausalLM.from_pretrained(moe_dir).float().eval()
    assert moe.config.model_type == "qwen3_moe" and moe.config.tie_word_embeddings
    experts = moe.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[0], experts.gate_up_proj[3])
    vocab = dense.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = dense(tokens).logits
        torch.testing.assert_close(moe(tokens).logits, want, rtol=1e-5, atol=1e-5)
    ours = run_distributed(_megatron_logits, 1, args=(str(moe_dir), tokens, vocab), timeout=240)[0]
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_upcycling_refuses_what_it_cannot_read(tmp_path):
    from megatron_opd.models.upcycle import upcycle_to_moe
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    llama = make_tiny_hf_model("llama", tmp_path / "llama")
    refusal = r"no Mixture-of-Experts family upcycles model_type='llama'; upcycling reads \['qwen3'\]"
    with pytest.raises(ValueError, match=refusal):
        upcycle_to_moe(llama, tmp_path / "out")
    with pytest.raises(ValueError, match="top_k must be in"):
        upcycle_to_moe(llama, tmp_path / "out", experts=2, top_k=3)
