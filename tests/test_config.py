"""Configs load from YAML and command-line overrides, with errors that name the bad key."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from megatron_opd.config import ConfigError, load_config, parse_args
from megatron_opd.distributed import ParallelConfig
from megatron_opd.models import ModelBuildConfig


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
