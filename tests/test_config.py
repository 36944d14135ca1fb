"""Configs load from YAML and command-line overrides, with errors that name the bad key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_opd.config import ConfigError, load_config, parse_args
from megatron_opd.distributed import ParallelConfig
from megatron_opd.models import ModelBuildConfig
from megatron_opd.trainer.config import TrainConfig


@dataclass
class _Job:
    name: str = "job"
    """Run name."""
    steps: int = 10
    """Number of steps."""
    lr: float = 1e-5
    """Learning rate."""
    teacher_dir: str | None = None
    """Optional path."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    build: ModelBuildConfig = field(default_factory=ModelBuildConfig)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("steps: 3\nparallel:\n  tensor_model_parallel_size: 2\nbuild:\n  dtype: bf16\n")
    cfg = load_config(_Job, path, ["parallel.pipeline_model_parallel_size=2", "lr=3e-4", "teacher_dir=/x"])
    assert (cfg.steps, cfg.lr, cfg.teacher_dir) == (3, 3e-4, "/x")
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.build.dtype == "bf16" and cfg.build.make_vocab_size_divisible_by == 128  # default kept
    assert parse_args(_Job, ["--config", str(path), "steps=7"]).steps == 7


def test_bad_keys_and_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel"):
        load_config(_Job, None, ["parallel.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="steps: expected an integer"):
        load_config(_Job, None, ["steps=many"])
    with pytest.raises(ConfigError, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        load_config(_Job, None, ["parallel.sequence_parallel=true"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr must be a finite number > 0 (e.g. 1e-5), got -1"),
        ("optim.lr=0", "optim.lr must be a finite number > 0"),
        ("optim.min_lr=-1e-6", "optim.min_lr must be in [0, optim.lr=1e-05] (where the decay ends), got -1e-06"),
        ("optim.min_lr=1e-3", "optim.min_lr must be in [0, optim.lr=1e-05]"),
        ("optim.lr_warmup_steps=-1", "optim.lr_warmup_steps must be >= 0 (0: no warm-up), got -1"),
        ("optim.lr_decay_steps=0", "optim.lr_decay_steps=0 must be > optim.lr_warmup_steps=0"),
        ("optim.adam_beta1=1", "optim.adam_beta1 must be in [0, 1) (e.g. 0.9, 0.999), got 1"),
        ("optim.adam_beta2=-0.1", "optim.adam_beta2 must be in [0, 1)"),
        ("optim.adam_eps=0", "optim.adam_eps must be a finite number > 0 (e.g. 1e-8), got 0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0 (0: off), got -0.1"),
        ("optim.clip_grad=-1", "optim.clip_grad must be a finite number >= 0 (0: no clipping), got -1"),
    ],
)
def test_optimizer_fields_are_checked_by_name(override, message):
    from megatron_opd.trainer.config import TrainConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(TrainConfig, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.max_prompts=0", "eval.max_prompts must be >= 1, got 0; to run without evaluation, set data.eval_files"),
        ("eval.every=-1", "eval.every must be >= 0 (0: before the first and after the last step), got -1"),
    ],
)
def test_evaluation_fields_are_checked_by_name(override, message):
    from megatron_opd.trainer.config import TrainConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(TrainConfig, [override])


def test_warm_up_must_end_before_the_last_step():
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl", "train.steps=10"]
    parse_args(TrainConfig, [*base, "optim.lr_warmup_steps=9"]).validate()
    cfg = parse_args(TrainConfig, [*base, "optim.lr_warmup_steps=10"])
    with pytest.raises(ValueError, match=re.escape("optim.lr_warmup_steps=10 must be < train.steps=10")):
        cfg.validate()


def test_choices_spelled_like_yaml_booleans_are_read_as_words(tmp_path):
    """YAML 1.1 reads ``off``/``on`` as booleans: ``loss.fused_output: off`` must still mean "off"."""
    from megatron_opd.config import load_config
    from megatron_opd.trainer.config import TrainConfig

    path = tmp_path / "c.yaml"
    path.write_text("loss:\n  fused_output: off\n  cross_tokenizer: off\n")
    cfg = load_config(TrainConfig, str(path), ["loss.fused_output=on"])
    assert cfg.loss.fused_output == "on" and cfg.loss.cross_tokenizer == "off"
    cfg = load_config(TrainConfig, str(path), [])
    assert cfg.loss.fused_output == "off"


def test_asynchronous_modes_with_the_built_in_sampler_are_refused_before_any_model():
    """``validate`` runs before the models are built: the paths here do not exist."""
    from megatron_opd.trainer.config import TrainConfig

    base = ["student.path=s", "teacher.path=t", "data.train_files=x.jsonl"]
    parse_args(TrainConfig, [*base, "scheduler.mode=one_step_off", "rollout.backend=vllm"]).validate()
    for mode in ("one_step_off", "two_step_off"):
        cfg = parse_args(TrainConfig, [*base, f"scheduler.mode={mode}"])
        with pytest.raises(ValueError, match=f"scheduler.mode={mode} .*set rollout.backend=vllm"):
            cfg.validate()


EXAMPLES = sorted(
    p for p in (Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml") if not p.name.endswith(".launch.yaml")
)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_example_config_parses(path):
    """Every trainer config under examples/ loads with the trainer's loader (which refuses an unknown key)."""
    load_config(TrainConfig, path)


def test_thinking_example_leaves_room_for_the_trace():
    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "examples/thinking/qwen3_thinking.yaml")
    cfg.validate()
    assert cfg.data.chat_template_kwargs == {"enable_thinking": True}
    assert cfg.rollout.max_new_tokens >= 4096 and cfg.train.max_seq_len >= cfg.rollout.max_new_tokens
    assert cfg.build.recompute == "full"


def test_chat_template_kwargs_from_yaml_and_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chat_template_kwargs:\n    enable_thinking: true\n    level: 2\n")
    # A dotted override sets one variable and keeps the file's others; a YAML mapping replaces them all.
    dotted = load_config(TrainConfig, path, ["data.chat_template_kwargs.enable_thinking=false"])
    assert dotted.data.chat_template_kwargs == {"enable_thinking": False, "level": 2}
    whole = load_config(TrainConfig, None, ["data.chat_template_kwargs={enable_thinking: false}"])
    assert whole.data.chat_template_kwargs == {"enable_thinking": False}
    assert load_config(TrainConfig).data.chat_template_kwargs == {}
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs.*\['add_generation_prompt'\]"):
        load_config(TrainConfig, None, ["data.chat_template_kwargs.add_generation_prompt=false"])
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: expected a mapping"):
        load_config(TrainConfig, None, ["data.chat_template_kwargs=true"])
