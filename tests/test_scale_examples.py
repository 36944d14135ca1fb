"""The scale-out recipes (examples/scale): they parse with the trainer's own loader, the launcher wires the
teacher-server, vLLM and trainer commands to each other on a Slurm node list, and the memory estimate counts every
parameter once and splits it as the name mapping says. CPU only, nothing is started but tiny local processes."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest
import torch

from megatron_opd.config import ConfigError, load_config
from megatron_opd.launch import cli
from megatron_opd.launch.layout import load_recipe
from megatron_opd.launch.nodes import expand_nodelist, job_hosts
from megatron_opd.launch.plan import TRAINER, VLLM_API_SERVER, Plan, Process, build_plan
from megatron_opd.launch.recipe_memory import student_memory
from megatron_opd.launch.run import run_node, this_node
from megatron_opd.teacher import serve
from megatron_opd.trainer.config import TrainConfig
from megatron_opd.trainer.memory import KNOWN_CONFIGS, hf_config, meta_model, shard_parameters, stage_params

SCALE = Path(__file__).resolve().parents[1] / "examples" / "scale"
QWEN = SCALE / "qwen3-32b_to_qwen3-1.7b.launch.yaml"
LLAMA = SCALE / "llama-70b_to_llama-8b.launch.yaml"
DEEPSEEK = SCALE / "deepseek-v3_to_llama-8b.launch.yaml"
DEEPSEEK_VLLM = SCALE / "deepseek-v3-fp8-vllm_to_llama-8b.launch.yaml"


# ---- recipes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "launch, mode, teacher_model",
    [(QWEN, "one_step_off", "Qwen3-32B"), (LLAMA, "two_step_off", "Llama-3.1-70B-Instruct")],
)
def test_recipes_parse_with_the_trainers_loader(launch, mode, teacher_model):
    recipe = load_recipe(launch)  # the loader raises on any unknown key, in both files
    cfg = recipe.train
    assert (cfg.teacher.backend, cfg.rollout.backend, cfg.scheduler.mode) == ("server", "vllm", mode)
    assert (cfg.loss.mode, cfg.loss.topk, cfg.optim.bf16) == ("topk", 64, True)
    assert Path(cfg.teacher.path).name == teacher_model
    assert cfg.train.prompts_per_step * cfg.rollout.n >= 256


@pytest.mark.parametrize("launch, backend, topk", [(DEEPSEEK, "server", 64), (DEEPSEEK_VLLM, "vllm", 20)])
def test_deepseek_recipes_distil_across_tokenizers(launch, backend, topk):
    """No small public model shares DeepSeek-V3's tokenizer: the Llama student's loss maps the teacher's top-k."""
    cfg = load_recipe(launch).train
    assert (cfg.teacher.backend, cfg.rollout.backend, cfg.loss.mode, cfg.loss.topk) == (backend, "vllm", "topk", topk)
    assert cfg.loss.cross_tokenizer == "aligned" and Path(cfg.teacher.path).name == "DeepSeek-V3"
    assert Path(cfg.student.path).name == "Llama-3.1-8B-Instruct"


def test_an_unknown_key_in_a_recipe_is_refused(tmp_path):
    text = (SCALE / "qwen3-32b_to_qwen3-1.7b.yaml").read_text().replace("  topk: 64", "  top_k: 64")
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(ConfigError, match="loss.top_k"):
        load_config(TrainConfig, tmp_path / "typo.yaml")


# ---- node lists --------------------------------------------------------------------------------------------------
def test_slurm_nodelists_expand_like_scontrol():
    assert expand_nodelist("gpu[01-03]") == ["gpu01", "gpu02", "gpu03"]
    assert expand_nodelist("gpu[08-10,12],login1") == ["gpu08", "gpu09", "gpu10", "gpu12", "login1"]
    assert expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_nodelist("gpu[01-03")
    assert job_hosts("a,b") == ["a", "b"]
    assert job_hosts(None, {}) is None


# ---- the dry run -------------------------------------------------------------------------------------------------
def _dry_run(recipe: Path, nodelist: str, monkeypatch, capsys) -> dict[str, list[tuple[dict, list[str]]]]:
    """Run the launcher's dry run inside a fake Slurm allocation with no scontrol; host -> [(env, argv)]."""
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the launcher parses the node list itself
    assert cli.main([str(recipe), "--dry-run"]) == 0
    blocks: dict[str, list] = {}
    host = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("# node "):
            host = line.split(": ", 1)[1]
            blocks[host] = []
        elif line.strip() and not line.startswith("#"):
            words = shlex.split(line, comments=True)
            env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=")[0].isupper())
            blocks[host].append((env, [w for w in words if w.split("=")[0] not in env]))
    return blocks


def _vllm_parser():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # what vLLM's OpenAI server parses
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _flag(argv: list[str], name: str) -> str:
    (value,) = [w.split("=", 1)[1] for w in argv if w.startswith(f"{name}=")]
    return value


def _module_args(argv: list[str], module: str) -> list[str]:
    return argv[argv.index(module) + 1 :]


def _check_wiring(blocks: dict[str, list[tuple[dict, list[str]]]]) -> tuple[TrainConfig, dict]:
    """Every address the trainer is given is where a server of the dry run binds; world sizes match layouts."""
    teachers, vllm, trainers, api_keys = {}, [], [], set()
    for host, commands in blocks.items():
        used = [g for env, _ in commands for g in env["CUDA_VISIBLE_DEVICES"].split(",")]
        assert len(used) == len(set(used)), f"{host} gives a GPU to two processes"
        for env, argv in commands:
            gpus = len(env["CUDA_VISIBLE_DEVICES"].split(","))
            if "megatron_opd.teacher.serve" in argv:
                args = serve.parse_args(_module_args(argv, "megatron_opd.teacher.serve"))  # the server's real flags
                nnodes, nproc = int(_flag(argv, "--nnodes")), int(_flag(argv, "--nproc-per-node"))
                assert nnodes * nproc == args.tp * args.pp * args.ep and nproc == gpus
                assert args.host == "0.0.0.0" and args.token_file
                master = _flag(argv, "--master-addr")
                if _flag(argv, "--node-rank") == "0":  # global rank 0 runs the request loop, on this node
                    assert master == host
                    teachers[f"{host}:{args.port}"] = (args, nnodes)
            elif VLLM_API_SERVER in argv:  # a vLLM teacher: its flags read with vLLM's own parser
                args = _vllm_parser().parse_args(_module_args(argv, VLLM_API_SERVER))
                assert args.tensor_parallel_size * args.pipeline_parallel_size == gpus * args.nnodes
                assert args.host == "0.0.0.0"
                api_keys.add(env["VLLM_API_KEY"])  # read from the token file on the node, kept off the command line
                if args.node_rank == 0:
                    assert not args.headless and (args.nnodes == 1 or args.master_addr == host)
                    teachers[f"http://{host}:{args.port}"] = (args, args.nnodes)
                else:
                    assert args.headless
            elif "megatron_opd.rollout.vllm_server" in argv:
                args = _module_args(argv, "megatron_opd.rollout.vllm_server")
                assert int(args[args.index("--tensor-parallel-size") + 1]) == gpus
                vllm.append(f"{host}:{args[args.index('--port') + 1]}")
            else:
                assert "megatron_opd.train" in argv, argv
                trainers.append((host, argv))
    node_ranks = sorted(int(_flag(argv, "--node-rank")) for _, argv in trainers)
    assert node_ranks == list(range(len(trainers)))
    host0, argv = next((h, a) for h, a in trainers if _flag(a, "--node-rank") == "0")
    train_args = _module_args(argv, "megatron_opd.train")
    cfg = load_config(TrainConfig, train_args[1], train_args[2:])
    cfg.validate()  # the overrides complete the config: addresses, token
    assert cfg.teacher.address.split(",") == list(teachers)
    assert cfg.rollout.address.split(",") == vllm and len(set(vllm)) == len(vllm)
    assert cfg.rollout.sync_address == host0 == _flag(argv, "--master-addr")
    if cfg.teacher.backend == "vllm":
        assert {a.max_logprobs for a, _ in teachers.values()} == {cfg.loss.topk}
        assert api_keys == {f"$(cat {cfg.teacher.token_file})"}
    else:
        assert {a.token_file for a, _ in teachers.values()} == {cfg.teacher.token_file}
        assert {a.topk for a, _ in teachers.values()} == {cfg.loss.topk}
    world = int(_flag(argv, "--nnodes")) * int(_flag(argv, "--nproc-per-node"))
    assert world % cfg.parallel.model_parallel_size == 0
    return cfg, teachers


def test_dry_run_wires_three_nodes_of_a_slurm_job(monkeypatch, capsys):
    blocks = _dry_run(QWEN, "gpu[01-03]", monkeypatch, capsys)
    assert list(blocks) == ["gpu01", "gpu02", "gpu03"]
    cfg, teachers = _check_wiring(blocks)
    assert list(teachers) == ["gpu02:5555", "gpu02:5556"]
    assert cfg.rollout.address == ",".join(f"gpu03:{8000 + i}" for i in range(8))
    assert [len(blocks[h]) for h in blocks] == [1, 2, 8]


def test_dry_run_spans_the_70b_teacher_over_two_nodes(monkeypatch, capsys):
    blocks = _dry_run(LLAMA, "gpu[01-04]", monkeypatch, capsys)
    cfg, teachers = _check_wiring(blocks)
    ((address, (args, nnodes)),) = teachers.items()
    assert address == "gpu03:5555" and (args.tp, args.pp, nnodes) == (8, 2, 2)
    rank1 = [argv for _, argv in blocks["gpu04"]]
    assert len(rank1) == 1 and _flag(rank1[0], "--node-rank") == "1" and _flag(rank1[0], "--master-addr") == "gpu03"
    assert cfg.rollout.address.split(",") == [f"gpu02:{8000 + i}" for i in range(4)]


def test_dry_run_spans_the_deepseek_teacher_over_four_nodes_in_uneven_stages_and_expert_parallelism(
    monkeypatch, capsys
):
    blocks = _dry_run(DEEPSEEK, "gpu[01-06]", monkeypatch, capsys)
    cfg, teachers = _check_wiring(blocks)
    ((address, (args, nnodes)),) = teachers.items()
    assert address == "gpu03:5555" and (args.tp, args.pp, args.ep, nnodes) == (8, 2, 2, 4)
    assert (args.first_stage_layers, args.last_stage_layers) == (32, None)  # 61 layers: 32 + 29
    ranks = [_flag(argv, "--node-rank") for host in ("gpu03", "gpu04", "gpu05", "gpu06") for _, argv in blocks[host]]
    assert ranks == ["0", "1", "2", "3"]


@pytest.mark.parametrize("pp", [1, 2])
def test_dry_run_starts_the_vllm_teacher(pp, tmp_path, monkeypatch, capsys):
    """At TP=8 on one H200 node (the recipe), and at TP=8 x PP=2 over two nodes (H100s: vLLM's multi-node mode,
    the second node headless)."""
    launch = tmp_path / DEEPSEEK_VLLM.name
    text = DEEPSEEK_VLLM.read_text().replace("train_config: ", f"train_config: {SCALE}/")
    launch.write_text(text.replace("  nodes: [2]\n  tp: 8\n  pp: 1", f"  nodes: {[2, 3][:pp]}\n  tp: 8\n  pp: {pp}"))
    blocks = _dry_run(launch, f"gpu[01-0{2 + pp}]", monkeypatch, capsys)
    cfg, teachers = _check_wiring(blocks)
    ((address, (args, nnodes)),) = teachers.items()
    assert address == cfg.teacher.address == "http://gpu03:5555" and (args.pipeline_parallel_size, nnodes) == (pp, pp)
    assert args.max_model_len is None  # cross-tokenizer: the teacher's sequences have their own lengths


def test_vllm_commands_parse_with_vllms_own_parser(monkeypatch, capsys):
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # what megatron_opd.rollout.vllm_server runs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    blocks = _dry_run(LLAMA, "gpu[01-04]", monkeypatch, capsys)
    commands = [argv for _, argv in blocks["gpu02"]]
    assert len(commands) == 4
    for argv in commands:
        args = parser.parse_args(_module_args(argv, "megatron_opd.rollout.vllm_server"))
        assert (args.tensor_parallel_size, args.max_model_len, args.load_format) == (2, 2560, "dummy")


def test_too_few_nodes_is_an_error():
    with pytest.raises(ValueError, match="needs 4 nodes, the job has 3"):
        build_plan(load_recipe(LLAMA), ["a", "b", "c"])


# ---- running a node ----------------------------------------------------------------------------------------------
def test_this_node_from_slurm_or_hostname():
    assert this_node(["a", "b", "c"], None, {"SLURM_NODEID": "2"}) == 2
    assert this_node(["a", "b"], 1, {}) == 1
    with pytest.raises(ValueError, match="not in the node list"):
        this_node(["surely-not-this-host"], None, {})


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_a_node_runs_its_servers_and_exits_with_the_trainer(tmp_path):
    pid = str(tmp_path / "server.pid")
    server = _python(f"import os, time; open('{pid}.tmp', 'w').write(str(os.getpid())); os.replace('{pid}.tmp', '{pid}')"
                     "; time.sleep(60)")  # fmt: skip
    trainer = _python(f"import os, time\nwhile not os.path.exists('{pid}'): time.sleep(0.05)\nraise SystemExit(3)")
    plan = Plan(hosts=["here"], processes=[Process("vllm-0", 0, (0,), server), Process(TRAINER, 0, (1,), trainer)])
    assert run_node(plan, 0, tmp_path, wait_timeout_s=30) == 3  # the trainer's status is the node's
    with pytest.raises(ProcessLookupError):  # and the server did not outlive its node's launcher
        os.kill(int(Path(pid).read_text()), 0)


def test_a_server_that_dies_stops_its_node_before_the_trainer_starts(tmp_path):
    marker = tmp_path / "trainer-started"
    dead = Process("teacher-0", 0, (0,), _python("raise SystemExit(5)"))
    trainer = Process(TRAINER, 0, (1,), _python(f"open({str(marker)!r}, 'w')"))
    plan = Plan(hosts=["here"], processes=[dead, trainer], teacher_addresses=["127.0.0.1:1"])
    assert run_node(plan, 0, tmp_path, wait_timeout_s=30) == 5
    assert not marker.exists()


# ---- memory ------------------------------------------------------------------------------------------------------
def _meta(name: str) -> torch.nn.Module:
    return meta_model(hf_config(f"/models/{name}"))


def _total(shards, tp: int) -> int:
    """Elements summed over every TP rank of every stage."""
    return sum(s.per_rank * (tp if s.split else 1) for s in shards)


@pytest.mark.parametrize("name, published", [("Llama-3.1-70B-Instruct", 70.6e9), ("Llama-3.1-8B-Instruct", 8.03e9)])
def test_shards_hold_every_parameter_once(name, published):
    model = _meta(name)
    shards = shard_parameters(model, tp=8, pp=2, vocab_multiple=None)
    count = sum(p.numel() for p in model.parameters())
    assert _total(shards, 8) == count
    assert abs(count - published) / published < 0.002


def test_a_tp_split_weight_is_one_tp_th_per_device():
    cfg = KNOWN_CONFIGS["Llama-3.1-70B-Instruct"]
    h, f, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * 128
    shards = {s.name: s for s in shard_parameters(_meta("Llama-3.1-70B-Instruct"), tp=8, pp=2)}
    assert shards["model.layers.0.mlp.down_proj.weight"].per_rank * 8 == h * f
    assert shards["model.layers.0.self_attn.k_proj.weight"].per_rank * 8 == kv * h
    assert shards["model.layers.0.input_layernorm.weight"].per_rank == h  # replicated
    assert shards["lm_head.weight"].per_rank == 129024 // 8 * h  # 128256 padded to a multiple of 128 x 8
    assert (shards["model.layers.39.mlp.up_proj.weight"].stage, shards["model.layers.40.mlp.up_proj.weight"].stage) == (
        0,
        1,
    )
    # Per device: 40 layers on each stage, the embedding on the first, the final norm and output layer on the last.
    layer = (2 * h * h + 2 * h * kv + 3 * h * f) // 8 + 2 * h
    vocab = 129024 // 8 * h
    assert stage_params(list(shards.values()), 2) == [40 * layer + vocab, 40 * layer + h + vocab]


def test_a_tied_output_layer_is_a_second_copy_on_the_last_stage():
    model = _meta("Qwen3-1.7B")
    count = sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert abs(count - 1.72e9) / 1.72e9 < 0.005
    assert _total(shard_parameters(model, tp=2, pp=1, vocab_multiple=None), 2) == count
    shards = shard_parameters(model, tp=2, pp=2, vocab_multiple=None)
    embedding = 151936 * 2048
    assert _total(shards, 2) == count + embedding


def test_a_parameter_without_a_rule_is_reported():
    from transformers import LlamaConfig

    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256)  # fmt: skip
    model = meta_model(tiny)
    assert _total(shard_parameters(model, tp=2, pp=1, vocab_multiple=None), 2) == sum(
        p.numel() for p in model.parameters()
    )
    model.model.layers[1].mlp.register_parameter("scale", torch.nn.Parameter(torch.empty(64, device="meta")))
    with pytest.raises(ValueError, match=r"no name-mapping rule places \['model.layers.1.mlp.scale'\]"):
        shard_parameters(model, tp=2, pp=1)


def test_student_memory_follows_the_distributed_optimizer():
    (row,) = student_memory(load_recipe(LLAMA))  # TP=4, PP=1, DP=2
    params = 8_030_261_248 // 4
    assert abs(row.params - params) / params < 0.01  # the padded vocabulary adds a little
    assert (row.weights, row.grads, row.optimizer) == (2 * row.params, 4 * row.params, 12 * row.params / 2)
    assert row.total < 79.6 * (1 << 30)


def test_memory_table_lists_every_job(capsys):
    assert cli.main([str(QWEN), "--memory"]) == 0
    out = capsys.readouterr().out
    for job in ("teacher server | TP=4 PP=1 x2", "student (trainer) | TP=1 PP=1 DP=8", "vllm server | TP=1, x8"):
        assert job in out


# DeepSeek-V3's published sizes, counted here from the config facts alone (the multi-token-prediction layer left out).
H, LAYERS, DENSE, VOCAB, HEADS, EXPERTS = 7168, 61, 3, 129280, 128, 256
Q_RANK, KV_RANK, NOPE, ROPE, V_DIM, FFN, EXPERT_FFN = 1536, 512, 128, 64, 128, 18432, 2048
MLA = H * Q_RANK + Q_RANK + Q_RANK * HEADS * (NOPE + ROPE) + H * (KV_RANK + ROPE) + KV_RANK
MLA += KV_RANK * HEADS * (NOPE + V_DIM) + HEADS * V_DIM * H  # q_a, its norm, q_b, kv_a, its norm, kv_b, o_proj
ROUTED = (LAYERS - DENSE) * EXPERTS * 3 * H * EXPERT_FFN
SHARED_AND_ROUTER = (LAYERS - DENSE) * (3 * H * EXPERT_FFN + EXPERTS * H)
DENSE_PART = 2 * VOCAB * H + H + LAYERS * (MLA + 2 * H) + DENSE * 3 * H * FFN + SHARED_AND_ROUTER


def test_deepseek_v3_counts_671b_and_a_thirty_second_of_the_experts_per_gpu():
    model = _meta("DeepSeek-V3")
    count = sum(p.numel() for p in model.parameters())
    assert count == DENSE_PART + ROUTED == 671_026_404_352  # 671.0e9 (the checkpoint's 685B adds 14B of MTP)
    shards = shard_parameters(model, tp=8, pp=1, ep=4)  # one stage: every layer's share on each GPU
    assert sum(s.per_rank * (8 if s.split else 1) for s in shards) == (  # one expert-parallel rank's TP group
        count + 2 * (130048 - VOCAB) * H - ROUTED + ROUTED // 4  # vocabulary padded to 1,024 x 127; experts / EP
    )
    # norms, the key/value down projection (whole on every TP rank: families/deepseek_v3.py), routers
    replicated = LAYERS * (2 * H + Q_RANK + KV_RANK + H * (KV_RANK + ROPE)) + H + (LAYERS - DENSE) * EXPERTS * H
    (per_gpu,) = stage_params(shards, 1)
    assert per_gpu == (DENSE_PART - 2 * VOCAB * H - replicated) // 8 + 2 * 130048 * H // 8 + replicated + ROUTED // 32
    # The bf16 recipe's teacher: TP=8 x EP=2 and two uneven stages, layers 0-31 (the 3 dense ones among them) and 32-60
    # (the output layer): 29 MoE layers each, so each stage's GPU holds the same routed experts, 1/16 of 29 layers'.
    staged = shard_parameters(model, tp=8, pp=2, ep=2, stage_layers=[32, 29])
    routed = [sum(s.per_rank for s in staged if s.stage == stage and ".experts." in s.name) for stage in (0, 1)]
    assert routed == [ROUTED // (LAYERS - DENSE) * 29 // 16] * 2
    assert {s.name.split(".")[2] for s in staged if s.stage == 1 and ".layers." in s.name} == {
        str(layer) for layer in range(32, 61)
    }


def test_deepseek_v3_memory_fits_as_a_bf16_server_and_as_an_fp8_vllm_teacher():
    from megatron_opd.launch.recipe_memory import recipe_memory
    from megatron_opd.trainer.memory import GIB

    servers = [row for row in recipe_memory(load_recipe(DEEPSEEK)) if row.job == "teacher server"]
    assert [row.layout for row in servers] == [f"TP=8 PP=2 EP=2 x1, stage {stage}" for stage in (0, 1)]
    for server in servers:
        assert server.weights == 2 * server.params and 40 * GIB < server.total < 79.6 * GIB
    (teacher,) = [row for row in recipe_memory(load_recipe(DEEPSEEK_VLLM)) if row.job == "vllm teacher"]
    # FP8: every layer's 2-D weight but the routers, 1 byte and one fp32 scale per 128 x 128 block; the rest bf16.
    # vLLM holds the two attention down-projections whole on each TP rank.
    down = LAYERS * H * (Q_RANK + KV_RANK + ROPE)
    norms = LAYERS * (2 * H + Q_RANK + KV_RANK) + H
    routers = (LAYERS - DENSE) * EXPERTS * H
    fp8 = DENSE_PART + ROUTED - 2 * VOCAB * H - norms - routers
    bf16 = 2 * VOCAB * H // 8 + norms + routers
    per_gpu = (fp8 - down) / 8 + down
    assert teacher.weights == pytest.approx(per_gpu * (1 + 4 / 128**2) + 2 * bf16, rel=1e-4)  # scales: edge blocks
    assert teacher.params == (fp8 - down) // 8 + down + bf16
    assert 70 * GIB < teacher.weights < 80 * GIB and teacher.total < 0.9 * 139.8 * GIB + 1
    kv_tokens = teacher.activations / (LAYERS * (KV_RANK + ROPE) * 2)  # the latent and rotary key, every TP rank
    assert f"KV cache holds {kv_tokens / 1e3:.0f}k tokens" in teacher.note
