"""DeepSeek-V3 (multi-latent attention with YaRN, DeepSeek's routing) matches transformers at TP=1 and TP=2 (SP);
training at TP=2 is refused (Megatron-Core's local MLA gets the rotary key's gradient wrong there).

The tiny model (``families/deepseek_v3.TINY_DEEPSEEK``) routes with every DeepSeek feature: sigmoid scores plus a
random expert bias, 16 experts in 4 groups of which each token may use the best 2, top-4 among those, a shared
expert, a dense first layer. The test tokens keep every routing decision clear of a tie (a margin measured in
transformers' own router), so a match checks the arithmetic, not tie-breaking.
"""

from __future__ import annotations

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed

SEQ = 16
MARGIN = 1e-4  # smallest gap between a chosen and a passed-over group or expert score; errors here are ~1e-7


def _tokens(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (2, 2, SEQ), generator=gen)  # [micro-batches, batch, sequence]


def _routing_margin(router, hidden: torch.Tensor) -> float:
    """The smallest gap, over ``hidden``'s tokens, between the last group/expert transformers' ``router`` picks and
    the first it passes over (group scores: the sum of a group's top-2 biased scores)."""
    scores = torch.sigmoid(hidden.reshape(-1, router.weight.shape[1]).double() @ router.weight.double().T)
    biased = scores + router.e_score_correction_bias.double()
    groups = biased.view(len(biased), router.num_group, -1)
    group_scores = groups.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
    group_gap = group_scores[:, router.topk_group - 1] - group_scores[:, router.topk_group]
    chosen = groups.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
    in_chosen = groups.gather(1, chosen[..., None].expand(-1, -1, groups.shape[-1])).flatten(1)
    ranked = in_chosen.sort(dim=-1, descending=True).values
    expert_gap = ranked[:, router.top_k - 1] - ranked[:, router.top_k]
    return float(torch.minimum(group_gap, expert_gap).min())


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    """The matrix's tiny DeepSeek-V3 (q-LoRA) and the same without a query latent (one ``q_proj``)."""
    from megatron_opd.testing.shapes import make_shape
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("deepseek_v3")
    return {
        "q_lora": str(make_shape("deepseek_v3_mla", root / "q_lora")),
        "no_q_lora": str(make_tiny_hf_model("deepseek_v3", root / "no_q_lora", seed=3, q_lora_rank=None)),
    }


def _reference(hf_dir: str, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """transformers' logits ``[micro-batches, b, s, V]`` and the routing margin of these tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    assert routers, "no DeepSeek router in the transformers model"
    margins = []
    hooks = [r.register_forward_hook(lambda m, args, out: margins.append(_routing_margin(m, args[0]))) for r in routers]
    with torch.no_grad():
        logits = torch.stack([model(input_ids=t).logits.float() for t in tokens])
    for hook in hooks:
        hook.remove()
    return logits, min(margins)


def _body(hf_dirs: dict[str, str], tokens: torch.Tensor):
    """In one job of two ranks: logits at TP=1 and TP=2 (sequence-parallel) and cross-entropy gradients at TP=1, then
    the refusal of a TP=2 backward (Megatron's local MLA gets the rotary key's gradient wrong there)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.distributed import ParallelConfig, initialize_distributed, initialize_model_parallel
    from megatron_opd.distributed.gather import gather_vocab_shards
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.models.reference import full_tensors
    from megatron_opd.models.source import build_and_load

    def run(hf_dir: str, parallel: ParallelConfig, trainable: bool):
        arch, chunks = build_and_load(hf_dir, parallel, trainable=trainable)
        group = ps.get_tensor_model_parallel_group()

        def ce(logits, batch):
            full = gather_vocab_shards(logits.detach(), group)[..., : arch.vocab_size].clone()
            labels = torch.roll(batch["tokens"], -1, dims=1)
            return vocab_parallel_cross_entropy(logits.float(), labels).mean(), full  # CE works in place

        logits = forward_backward(chunks, [{"tokens": t} for t in tokens], ce, forward_only=not trainable)
        return torch.stack(logits), full_tensors(chunks, arch, group, of="grad") if trainable else None

    initialize_distributed(ParallelConfig())
    results = {("tp1", name): run(hf_dir, ParallelConfig(), trainable=True) for name, hf_dir in hf_dirs.items()}
    tp2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)  # Megatron's MoE needs SP with TP
    initialize_model_parallel(tp2)
    results.update({("tp2", name): run(hf_dir, tp2, trainable=False) for name, hf_dir in hf_dirs.items()})
    try:
        run(hf_dirs["q_lora"], tp2, trainable=True)
        results["tp2 backward"] = "ran"
    except RuntimeError as err:
        results["tp2 backward"] = str(err)
    return results if ps.get_tensor_model_parallel_rank() == 0 else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_logits_match_transformers_at_tp1_and_tp2(deepseek_dirs):
    tokens = _tokens(1000)
    refs = {}
    for name, hf_dir in deepseek_dirs.items():
        refs[name], margin = _reference(hf_dir, tokens)
        assert margin >= MARGIN, f"{name}: the test tokens route within {margin:.1e} of a tie; pick other tokens"
    (results,) = [r for r in run_distributed(_body, 2, args=(deepseek_dirs, tokens), timeout=600) if r is not None]
    for (layout, name), (logits, grads) in ((k, v) for k, v in results.items() if isinstance(k, tuple)):
        ref = refs[name]
        assert logits.shape == ref.shape, (layout, name, logits.shape, ref.shape)
        rel = _rel(logits, ref)
        assert rel <= 1e-5, f"{layout}/{name}: max relative error {rel:.2e} vs transformers"
        if layout == "tp1":  # trains: the router and the key/value latent get gradients
            assert all(grads[n].abs().max() > 0 for n in grads if "router" in n or "kv_down" in n), name
    assert "cannot train at tensor_model_parallel_size > 1" in results["tp2 backward"], results["tp2 backward"]
