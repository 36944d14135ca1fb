"""Every process of a recipe on a node list: which node and GPUs, which command, and the addresses that tie the
trainer to the teacher servers and the vLLM servers."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from megatron_opd.launch.layout import Recipe

TRAINER = "trainer"


@dataclass(frozen=True)
class Process:
    """One command on one node."""

    job: str
    """``trainer``, ``teacher-R`` (replica R) or ``vllm-S`` (server S)."""
    node: int
    """Index into the node list."""
    gpus: tuple[int, ...]
    """The node's GPUs it sees (``CUDA_VISIBLE_DEVICES``)."""
    argv: tuple[str, ...]
    secret_env: tuple[tuple[str, str], ...] = ()
    """``(variable, file)``: set from the file's contents when the process starts (a secret kept off the command
    line, e.g. vLLM's ``VLLM_API_KEY``)."""

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))}

    def secrets(self) -> dict[str, str]:
        """``secret_env`` read now (on the node, once the files exist)."""
        return {name: Path(path).read_text().strip() for name, path in self.secret_env}

    def shell(self) -> str:
        """The command as one shell line, environment first (secrets as ``$(cat FILE)``)."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        env += [f'{name}="$(cat {shlex.quote(path)})"' for name, path in self.secret_env]
        return " ".join(env) + " " + shlex.join(self.argv)


@dataclass
class Plan:
    """All processes of a recipe, and the addresses the trainer is given."""

    hosts: list[str]
    processes: list[Process] = field(default_factory=list)
    teacher_addresses: list[str] = field(default_factory=list)
    """``host:port`` of every teacher replica (where its rank 0 binds); ``http://host:port`` for vLLM teachers."""
    rollout_addresses: list[str] = field(default_factory=list)
    """``host:port`` of every vLLM server."""

    def on_node(self, node: int) -> list[Process]:
        return [p for p in self.processes if p.node == node]


def _torchrun(nnodes: int, nproc: int, node_rank: int, master: str, port: int) -> list[str]:
    return [
        "torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
        f"--master-addr={master}", f"--master-port={port}",
    ]  # fmt: skip


def token_file(recipe: Recipe) -> str:
    """The teacher servers' shared secret (they bind to every interface, so one is required)."""
    return str(Path(recipe.launch.run_dir) / "teacher.token")


def _teacher_groups(recipe: Recipe) -> list[tuple[list[int], int]]:
    """Each teacher replica's ``(nodes, slot)``: replicas smaller than a node packed onto every teacher node (slot:
    its place there), larger ones over consecutive nodes."""
    layout, gpus = recipe.launch.teacher, recipe.launch.gpus_per_node
    size = layout.tp * layout.pp * layout.ep
    if size <= gpus:
        if gpus % size:
            raise ValueError(f"teacher tp x pp x ep = {size} must divide gpus_per_node={gpus} (or be a multiple of it)")
        return [([node], slot) for node in layout.nodes for slot in range(gpus // size)]
    if size % gpus or len(layout.nodes) % (size // gpus):
        raise ValueError(
            f"a teacher replica of tp x pp x ep = {size} GPUs spans {size / gpus:g} nodes: give teacher.nodes a "
            f"multiple of that many nodes (got {len(layout.nodes)}) and a tp x pp x ep that is a multiple of {gpus}"
        )
    span = size // gpus
    return [(layout.nodes[i : i + span], 0) for i in range(0, len(layout.nodes), span)]


def _teacher(recipe: Recipe, plan: Plan) -> None:
    layout, gpus = recipe.launch.teacher, recipe.launch.gpus_per_node
    per_node = min(layout.tp * layout.pp * layout.ep, gpus)
    train = recipe.train
    for replica, (nodes, slot) in enumerate(_teacher_groups(recipe)):
        master = plan.hosts[nodes[0]]
        port = layout.port + slot
        serve = [
            "-m", "megatron_opd.teacher.serve", "--model", train.teacher.path, "--tp", str(layout.tp),
            "--pp", str(layout.pp), *(["--ep", str(layout.ep)] if layout.ep > 1 else []),
            *(["--first-stage-layers", str(layout.first_stage_layers)] if layout.first_stage_layers else []),
            *(["--last-stage-layers", str(layout.last_stage_layers)] if layout.last_stage_layers else []),
            "--host", "0.0.0.0",
            "--port", str(port), "--token-file", token_file(recipe),
            "--topk", str(train.loss.topk), "--micro-batch-size", str(layout.micro_batch_size),
            "--max-batch-tokens", str(layout.max_batch_tokens),
            "--ready-file", str(Path(recipe.launch.run_dir) / f"teacher-{replica}.ready"), *layout.extra_args,
        ]  # fmt: skip
        for rank, node in enumerate(nodes):
            argv = _torchrun(len(nodes), per_node, rank, master, layout.master_port + slot) + serve
            devices = tuple(range(slot * per_node, (slot + 1) * per_node))
            plan.processes.append(Process(f"teacher-{replica}", node, devices, tuple(argv)))
        plan.teacher_addresses.append(f"{master}:{port}")


VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"


def _vllm_teacher(recipe: Recipe, plan: Plan) -> None:
    """vLLM's OpenAI-compatible server per teacher replica (``teacher.backend=vllm``): ``--max-logprobs`` of
    ``loss.topk``, the teacher token as its API key (``VLLM_API_KEY``, read from the token file on the node); a
    replica over several nodes runs vLLM's multi-node mode (``--nnodes``, ``--node-rank``, the others
    ``--headless``)."""
    from megatron_opd.trainer.objective import objective_for

    layout, gpus, train = recipe.launch.teacher, recipe.launch.gpus_per_node, recipe.train
    own_tokens = objective_for(train.loss).cross_tokenizer  # the teacher scores its own tokenization
    per_node = min(layout.tp * layout.pp, gpus)
    for replica, (nodes, slot) in enumerate(_teacher_groups(recipe)):
        master = plan.hosts[nodes[0]]
        port = layout.port + slot
        serve = [
            "python", "-m", VLLM_API_SERVER, "--model", train.teacher.path, "--host", "0.0.0.0", "--port", str(port),
            "--tensor-parallel-size", str(layout.tp), "--pipeline-parallel-size", str(layout.pp),
            "--max-logprobs", str(train.loss.topk), "--gpu-memory-utilization", str(layout.gpu_memory_utilization),
        ]  # fmt: skip
        if train.train.max_seq_len and not own_tokens:  # the teacher's own tokens: no bound
            serve += ["--max-model-len", str(train.train.max_seq_len + 1)]  # one extra token a prompt (teacher.md)
        for rank, node in enumerate(nodes):
            argv = list(serve)
            if len(nodes) > 1:
                argv += ["--nnodes", str(len(nodes)), "--node-rank", str(rank), "--master-addr", master,
                         "--master-port", str(layout.master_port + slot)]  # fmt: skip
                argv += ["--headless"] if rank else []
            devices = tuple(range(slot * per_node, (slot + 1) * per_node))
            secret = (("VLLM_API_KEY", token_file(recipe)),)
            plan.processes.append(
                Process(f"teacher-{replica}", node, devices, (*argv, *layout.extra_args), secret_env=secret)
            )
        plan.teacher_addresses.append(f"http://{master}:{port}")


def _rollout(recipe: Recipe, plan: Plan) -> None:
    layout, gpus = recipe.launch.rollout, recipe.launch.gpus_per_node
    tp = layout.tensor_parallel_size
    if tp < 1 or gpus % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide gpus_per_node={gpus}")
    server = 0
    for node in layout.nodes:
        for slot in range(gpus // tp):
            port = layout.port + slot
            argv = [
                "python", "-m", "megatron_opd.rollout.vllm_server", "--model", recipe.train.student.path,
                "--host", "0.0.0.0", "--port", str(port), "--tensor-parallel-size", str(tp),
                "--gpu-memory-utilization", str(layout.gpu_memory_utilization),
            ]  # fmt: skip
            if recipe.train.train.max_seq_len:
                argv += ["--max-model-len", str(recipe.train.train.max_seq_len)]
            devices = tuple(range(slot * tp, (slot + 1) * tp))
            plan.processes.append(Process(f"vllm-{server}", node, devices, (*argv, *layout.extra_args)))
            plan.rollout_addresses.append(f"{plan.hosts[node]}:{port}")
            server += 1


def _trainer(recipe: Recipe, plan: Plan) -> None:
    layout, gpus, parallel = recipe.launch.trainer, recipe.launch.gpus_per_node, recipe.train.parallel
    world = len(layout.nodes) * gpus
    if world % parallel.model_parallel_size:
        raise ValueError(
            f"the trainer's {world} GPUs are not a multiple of its TP x PP x CP = {parallel.model_parallel_size}"
        )
    master = plan.hosts[layout.nodes[0]]
    overrides = [
        f"teacher.address={','.join(plan.teacher_addresses)}",
        f"teacher.token_file={token_file(recipe)}",
        f"rollout.address={','.join(plan.rollout_addresses)}",
        f"rollout.sync_address={master}",
    ]
    train = ["-m", "megatron_opd.train", "--config", str(recipe.train_path), *overrides]
    for rank, node in enumerate(layout.nodes):
        argv = _torchrun(len(layout.nodes), gpus, rank, master, layout.master_port) + train
        plan.processes.append(Process(TRAINER, node, tuple(range(gpus)), tuple(argv)))


def nodes_needed(recipe: Recipe) -> int:
    launch = recipe.launch
    return 1 + max(launch.trainer.nodes + launch.teacher.nodes + launch.rollout.nodes)


def build_plan(recipe: Recipe, hosts: list[str]) -> Plan:
    """Place every job of ``recipe`` on ``hosts`` and build its command (servers first, the trainer last, since
    its command names the servers' addresses)."""
    if len(hosts) < nodes_needed(recipe):
        raise ValueError(f"{recipe.name} needs {nodes_needed(recipe)} nodes, the job has {len(hosts)}: {hosts}")
    plan = Plan(hosts=list(hosts))
    (_vllm_teacher if recipe.train.teacher.backend == "vllm" else _teacher)(recipe, plan)
    _rollout(recipe, plan)
    _trainer(recipe, plan)
    return plan


def describe(plan: Plan) -> str:
    """One block per node: its host and every command it runs (what ``--dry-run`` prints)."""
    blocks = []
    for node, host in enumerate(plan.hosts):
        lines = [f"# node {node}: {host}"]
        lines += [f"{p.shell()}  # {p.job}" for p in plan.on_node(node)] or ["# (unused)"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
