"""The layout file of a recipe (``*.launch.yaml``): which nodes run the trainer, the teacher servers and the vLLM
servers, on which ports. Node numbers index the job's node list (``--nodes`` or ``SLURM_JOB_NODELIST``); every
job gets whole nodes. Loaded with the trainer's own config loader, so an unknown key is an error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_opd.config import load_config
from megatron_opd.trainer.config import TrainConfig


@dataclass
class TrainerLayout:
    """The training job: one ``torchrun`` over ``nodes``, every GPU of each."""

    nodes: list[int] = field(default_factory=lambda: [0])
    """Nodes of the trainer; the first hosts torchrun's rendezvous and the weight-sync store (rank 0)."""
    master_port: int = 29500
    """torchrun's rendezvous port on the first trainer node."""


@dataclass
class TeacherLayout:
    """Teacher jobs, one per replica of ``tp x pp x ep`` GPUs: teacher servers (``torchrun -m
    megatron_opd.teacher.serve``) with ``teacher.backend=server``, vLLM's OpenAI-compatible server
    (``python -m vllm.entrypoints.openai.api_server``) with ``teacher.backend=vllm``."""

    nodes: list[int] = field(default_factory=list)
    """Nodes of the teacher. Replicas smaller than a node are packed onto each node; a larger replica spans
    ``tp x pp x ep / gpus_per_node`` consecutive nodes (TP inside a node, pipeline stages or expert-parallel ranks
    across nodes)."""
    tp: int = 1
    """Tensor-parallel size of each replica."""
    pp: int = 1
    """Pipeline-parallel size of each replica."""
    first_stage_layers: int | None = None
    """Teacher server: layers of the first pipeline stage where they do not split evenly over ``pp`` (the server's
    ``--first-stage-layers``; DeepSeek-V3's 61 layers at pp 2: 30, the last stage 31). None: an even split."""
    last_stage_layers: int | None = None
    """Teacher server: layers of the last pipeline stage (``--last-stage-layers``). None: an even split."""
    ep: int = 1
    """Teacher server of a Mixture-of-Experts model: expert-parallel size (the server's ``--ep``): ``ep`` copies of
    the dense part, each scoring a share of every batch, holding the experts between them. A vLLM teacher takes
    ``--enable-expert-parallel`` in ``extra_args`` instead (experts over its TP ranks)."""
    port: int = 5555
    """Port of a node's first replica; further replicas on the same node use the next ports."""
    master_port: int = 29600
    """torchrun's rendezvous port of a node's first replica (next ones: +1)."""
    micro_batch_size: int = 8
    """Sequences per forward micro-batch (the server's ``--micro-batch-size``; teacher server only)."""
    max_batch_tokens: int = 65536
    """Most padded positions in one forward (the server's ``--max-batch-tokens``; teacher server only)."""
    gpu_memory_utilization: float = 0.9
    """vLLM teacher: fraction of each GPU vLLM takes (weights, then KV cache)."""
    extra_args: list[str] = field(default_factory=list)
    """Further flags of ``megatron_opd.teacher.serve``, or of vLLM's server for a vLLM teacher."""


@dataclass
class RolloutLayout:
    """vLLM rollout servers (``python -m megatron_opd.rollout.vllm_server``), as many per node as fit."""

    nodes: list[int] = field(default_factory=list)
    """Nodes of the vLLM servers; each runs ``gpus_per_node / tensor_parallel_size`` servers."""
    tensor_parallel_size: int = 1
    """GPUs of one server (within a node)."""
    port: int = 8000
    """Port of a node's first server; further servers on the same node use the next ports."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU vLLM takes (weights, then KV cache)."""
    extra_args: list[str] = field(default_factory=list)
    """Further vLLM serve flags (e.g. ``--dtype bfloat16``, ``--load-format dummy``: the trainer syncs the weights
    before the first rollout)."""


@dataclass
class LaunchConfig:
    """Where each job of a recipe runs."""

    train_config: str = ""
    """The trainer's YAML, relative to this file."""
    gpus_per_node: int = 8
    """GPUs of every node."""
    gpu_memory_gib: float = 79.6
    """Memory of one GPU, for the memory estimate (an H100 80 GB reports 81,559 MiB)."""
    run_dir: str = "runs/scale"
    """Folder for the teacher's token and ready files and the servers' logs; on a shared file system for
    multi-node runs (every node reads the same token file)."""
    trainer: TrainerLayout = field(default_factory=TrainerLayout)
    """The training job."""
    teacher: TeacherLayout = field(default_factory=TeacherLayout)
    """The teacher-server jobs."""
    rollout: RolloutLayout = field(default_factory=RolloutLayout)
    """The vLLM servers."""

    def validate(self) -> None:
        """Every job has nodes of its own (checked after loading: the defaults leave them empty)."""
        jobs = {"trainer": self.trainer.nodes, "teacher": self.teacher.nodes, "rollout": self.rollout.nodes}
        for name, nodes in jobs.items():
            if not nodes:
                raise ValueError(f"{name}.nodes is empty: give the node numbers of the {name} job")
        used = [n for nodes in jobs.values() for n in nodes]
        if len(used) != len(set(used)) or min(used) < 0:
            raise ValueError(f"every job needs its own nodes (numbers >= 0, none shared), got {jobs}")
        for name in ("tp", "pp", "ep"):
            if getattr(self.teacher, name) < 1:
                raise ValueError(f"teacher.{name} must be >= 1, got {getattr(self.teacher, name)}")


@dataclass
class Recipe:
    """A trainer config and its layout."""

    launch: LaunchConfig
    train: TrainConfig
    launch_path: Path
    train_path: Path

    @property
    def name(self) -> str:
        return self.launch_path.name.removesuffix(".launch.yaml")


def load_recipe(launch_path: str | Path) -> Recipe:
    """Read a layout file and the trainer config it names; check the trainer uses teacher servers or a vLLM teacher,
    and vLLM rollout servers (the jobs the layout places). Paths inside are not checked (the models may live only on
    the cluster)."""
    launch_path = Path(launch_path)
    launch = load_config(LaunchConfig, launch_path)
    launch.validate()
    if not launch.train_config:
        raise ValueError(f"{launch_path}: train_config must name the trainer's YAML (relative to this file)")
    train_path = launch_path.parent / launch.train_config
    train = load_config(TrainConfig, train_path)
    wanted = {"teacher.backend": (train.teacher.backend, ("server", "vllm")),
              "rollout.backend": (train.rollout.backend, ("vllm",))}  # fmt: skip
    for key, (value, expected) in wanted.items():
        if value not in expected:
            choices = " or ".join(expected)
            raise ValueError(f"{train_path}: {key}={value}, but the layout starts {choices} jobs: set {choices}")
    if train.teacher.backend == "vllm" and launch.teacher.ep > 1:
        raise ValueError(
            f"{launch_path}: teacher.ep={launch.teacher.ep} is the teacher server's --ep; a vLLM teacher splits its "
            "experts over its TP ranks with extra_args [--enable-expert-parallel]: set teacher.ep: 1"
        )
    if not (train.teacher.path and train.student.path):
        raise ValueError(f"{train_path}: teacher.path and student.path are needed (the servers' --model)")
    return Recipe(launch=launch, train=train, launch_path=launch_path, train_path=train_path)
