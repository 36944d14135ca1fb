"""Device detection, torchrun environment parsing, and imports that need no optional accelerator package."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_opd.distributed import LaunchEnv, ParallelConfig, detect_accelerator


def test_cpu_machine_uses_gloo():
    if torch.cuda.is_available():
        pytest.skip("CUDA machine")
    accel = detect_accelerator()
    assert (accel.type, accel.backend, accel.device(3)) == ("cpu", "gloo", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        detect_accelerator("cuda")
    with pytest.raises(RuntimeError, match="torch_npu"):
        detect_accelerator("npu")
    with pytest.raises(ValueError, match="device must be one of"):
        detect_accelerator("tpu")


def test_launch_env_reads_torchrun_variables(monkeypatch):
    for key, value in dict(
        RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", MASTER_ADDR="10.0.0.2", MASTER_PORT="6000"
    ).items():
        monkeypatch.setenv(key, value)
    assert LaunchEnv.from_environ() == LaunchEnv(5, 1, 8, "10.0.0.2", 6000)


def test_parallel_config_validation():
    assert ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).model_parallel_size == 4
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be >= 1"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size >= 2"):
        ParallelConfig(virtual_pipeline_model_parallel_size=2)


_BLOCKED = ("transformer_engine", "apex", "torch_npu", "mindspeed", "triton", "vllm")
# Modules that extend an optional package (classes vLLM's factories instantiate) exist only where it is installed;
# nothing else may import them at module level, and they must fail with a plain ImportError.
_EXTENSIONS = {"megatron_opd.weight_sync.gloo_engine": "vllm"}

_IMPORT_ALL = f"""
import importlib, pkgutil, sys
for name in {_BLOCKED!r}:
    sys.modules[name] = None  # makes 'import name' raise ImportError, as on a machine without it
import megatron_opd, kernels
names = [m.name for pkg in (megatron_opd, kernels) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    if name in {_EXTENSIONS!r}:
        try:
            importlib.import_module(name)
        except ImportError as err:
            assert {_EXTENSIONS!r}[name] in str(err), err
            continue
        raise AssertionError(name + " imported without " + {_EXTENSIONS!r}[name])
    importlib.import_module(name)
from megatron_opd.distributed import has_transformer_engine, detect_accelerator
assert not has_transformer_engine()
print("imported", len(names), "modules")
"""


def test_package_imports_without_optional_accelerator_packages():
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported" in out.stdout
