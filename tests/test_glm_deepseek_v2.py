"""GLM-4.5 (``glm4_moe``), GLM-4.7-Flash (``glm4_moe_lite``) and DeepSeek-V2 (``deepseek_v2``): what their files say
that the trainer cannot honour is refused by name before any model, the architecture read from transformers' own
configs is the one the layers build, and GLM's multi-token-prediction layers are skipped with one log line.

Their layers run in the shape matrix (``glm4_moe_partial_bias``, ``glm4_moe_lite_mla``, ``deepseek_v2_softmax``:
logits, sampler, converter, export, in-process teacher) and in ``tests/test_moe_router.py`` (vLLM)."""

from __future__ import annotations

import pytest

from megatron_opd.model_files import UnsupportedArchitectureError
from megatron_opd.models.hf_config import architecture_from_hf_config
from megatron_opd.testing.tiny_models import tiny_hf_config


def _cfg(family: str, **overrides) -> dict:
    return {**tiny_hf_config(family).to_dict(), **overrides}


def test_transformers_configs_read_as_the_layers_build_them():
    glm = architecture_from_hf_config(_cfg("glm4_moe"))
    assert (glm.qkv_bias, glm.qk_norm, glm.rope.partial_rotary_factor) == (True, True, 0.5)
    assert glm.moe.layers == (1, 2, 3) and glm.moe.shared_expert_ffn_hidden_size == 32
    assert (glm.routing.score_function, glm.routing.expert_bias, glm.routing.n_group) == ("sigmoid", True, 2)
    lite = architecture_from_hf_config(_cfg("glm4_moe_lite"))  # dense layer 0 named by mlp_layer_types only
    assert lite.mla.q_lora_rank == 24 and lite.moe.layers == (1, 2, 3) and lite.routing.expert_bias
    v2 = architecture_from_hf_config(_cfg("deepseek_v2"))
    assert v2.mla.q_lora_rank is None and not v2.moe.norm_topk_prob and v2.mla.yarn_factor == 4.0
    assert (v2.routing.score_function, v2.routing.expert_bias, v2.routing.n_group) == ("softmax", False, 2)
    # greedy: transformers ignores the groups, and so does the trainer
    assert architecture_from_hf_config(_cfg("deepseek_v2", topk_method="greedy")).routing.n_group == 1


@pytest.mark.parametrize(
    "family, overrides, words",
    [
        ("glm4_moe", dict(norm_topk_prob=False), "norm_topk_prob=false is not supported for glm4_moe"),
        ("glm4_moe", dict(num_experts_per_tok=4), "num_experts_per_tok == 2 \\* topk_group"),
        ("glm4_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("glm4_moe_lite", dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "mlp_layer_types="),
        ("glm4_moe_lite", dict(first_k_dense_replace=2), "first_k_dense_replace=2 disagrees with mlp_layer_types"),
        ("glm4_moe_lite", dict(rope_interleave=False), "rope_interleave=false"),
        ("glm4_moe_lite", dict(attention_bias=True), "attention_bias=true"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
        ("deepseek_v2", dict(num_experts_per_tok=5), "the 1 chosen groups hold fewer than 5 experts"),
        ("deepseek_v2", dict(num_key_value_heads=2), "num_key_value_heads=2: multi-latent attention"),
    ],
)
def test_what_the_layers_cannot_honour_is_refused_by_name(family, overrides, words):
    with pytest.raises(UnsupportedArchitectureError, match=words):
        architecture_from_hf_config(_cfg(family, **overrides))


def test_glm_mtp_layers_are_skipped_with_one_line(tmp_path):
    """GLM-4.5 publishes ``num_nextn_predict_layers`` MTP layers as ``model.layers.<num_hidden_layers>.*``, as
    DeepSeek-V3 does: the loader names them in one line and loads none, the export declares none."""
    import json

    from safetensors.torch import load_file, save_file

    from megatron_opd.models.hf_io import HFCheckpointReader
    from megatron_opd.models.mtp import mtp_layer_tensors, skipped_mtp_message, without_mtp
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    hf_dir = make_tiny_hf_model("glm4_moe", tmp_path / "glm", num_hidden_layers=2)
    tensors = load_file(hf_dir / "model.safetensors")
    mtp = {
        k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if k.startswith("model.layers.1.")
    }
    save_file({**tensors, **mtp}, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    reader = HFCheckpointReader(hf_dir)
    assert sorted(mtp_layer_tensors(reader, 2)[2]) == sorted(mtp)
    assert f"skipping {len(mtp)} tensors of multi-token-prediction layer(s) [2]" in skipped_mtp_message(reader, 2)
    assert without_mtp(reader.config)["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("experts, n_group, topk_group, top_k", [(8, 2, 1, 2), (160, 8, 3, 6)])  # tiny, published
def test_deepseek_v2_groups_rank_by_their_best_score(experts, n_group, topk_group, top_k):
    """transformers' DeepSeek-V2 (``group_limited_greedy``) keeps the groups with the best single score, Megatron-Core
    the groups with the best sum of their top ``top_k / topk_group``: they route many tokens apart, at the tiny
    shape's top-2 of the best 1 of 2 groups and at the published DeepSeek-V2's top-6 of the best 3 of 8. The group-max
    selection (:mod:`megatron_opd.models.group_routers`) is transformers' choice, with its weights, also as the
    default of routing replay's hook (which records it; given routes replace it). The family's MoE layers run it:
    the shape matrix's ``deepseek_v2_softmax`` (logits, EP=2, converter, sampler)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import group_limited_topk
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from megatron_opd.models.group_routers import _GroupMaxSelection, group_max_topk
    from megatron_opd.models.route_replay import RouteReplay

    config = tiny_hf_config("deepseek_v2")
    config.n_routed_experts = config.num_experts = experts
    config.n_group, config.topk_group, config.num_experts_per_tok = n_group, topk_group, top_k
    gate = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(gate.weight, std=0.1, generator=torch.Generator().manual_seed(0))  # flat: groups close
    hidden = torch.randn(512, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, index = gate(hidden)
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    theirs = index.sort(-1)
    values, ours = group_max_topk(scores, top_k, n_group, topk_group)
    order = ours.sort(-1)
    assert torch.equal(order.values, theirs.values)
    scaled = values.gather(1, order.indices) * config.routed_scaling_factor
    torch.testing.assert_close(scaled, weights.gather(1, theirs.indices), rtol=0, atol=0)
    megatron = group_limited_topk(scores, top_k, len(scores), experts, n_group, topk_group)[1].sort(-1).values
    differ = (megatron != theirs.values).any(-1).float().mean().item()
    assert differ > 0.05, f"Megatron's group ranking routes only {differ:.1%} of tokens apart: the test shows nothing"

    replay = RouteReplay(0)
    replay.record = True
    megatron_default = lambda s, k, num_groups, group_topk: group_limited_topk(  # noqa: E731
        s, k, len(s), experts, num_groups, group_topk
    )
    _, chosen = _GroupMaxSelection(replay).get_replay_topk(scores, top_k, n_group, topk_group, megatron_default)
    assert torch.equal(chosen, ours) and torch.equal(replay.recorded, ours)
    replay.current = megatron
    assert torch.equal(_GroupMaxSelection(replay).get_replay_topk(scores, top_k, n_group, topk_group)[1], megatron)
    assert torch.equal(_GroupMaxSelection(None).get_replay_topk(scores, top_k, n_group, topk_group)[1], ours)
