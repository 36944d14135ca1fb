"""Device detection, torchrun environment parsing, and imports that need no optional accelerator package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_opd.distributed import LaunchEnv, ParallelConfig, detect_accelerator
from tests.conftest import ROOT, other_kernels_package


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
import megatron_opd, megatron_opd.kernels as kernels
names = sorted(set(m.name for pkg in (megatron_opd, kernels) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")))
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


# Imports every module that reads the kernels, with another top-level `kernels` package first on the path.
_SIDE_BY_SIDE = """
import os, sys
hf_dir, project_dir = sys.argv[1], sys.argv[2]
sys.path[:0] = [hf_dir, project_dir]
# Only the layout under test: an editable install's finder (of this or another checkout) would answer what it misses.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import kernels
import megatron_opd.kernels.divergence_triton, megatron_opd.kernels.rmsnorm_triton
import megatron_opd.losses.local_ops, megatron_opd.losses.vocab_parallel, megatron_opd.models.norms
assert kernels.__file__.startswith(hf_dir), kernels.__file__
for module in (megatron_opd, megatron_opd.kernels, megatron_opd.kernels.rmsnorm_triton):
    assert module.__file__.startswith(project_dir), module.__file__
print("side by side:", kernels.__file__, megatron_opd.kernels.__file__)
"""


def test_kernels_import_beside_hugging_face_kernels(tmp_path):
    """The repository's kernels/ folder is megatron_opd.kernels, not a top-level `kernels`: from the source checkout
    (the megatron_opd/__init__ mapping), this project and another `kernels` first on the path both import. The
    installed wheel's layout (setup.py's package_dir): tests/test_quickstart.py."""
    # -I: neither PYTHONPATH nor the working directory (a checkout's root holds kernels/) joins the path.
    out = subprocess.run(
        [sys.executable, "-I", "-c", _SIDE_BY_SIDE, str(other_kernels_package(tmp_path)), str(ROOT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "side by side:" in out.stdout


def _probes(probe_dir) -> dict[str, dict]:
    import json

    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(probe_dir).glob("rank*.json"))}


def test_rank_jobs_start_ranks_as_torchrun_does_and_stop_them_as_it_does(tmp_path):
    """``RankJob`` (the trainer and teacher-server ranks of the tests, forked from the rank server): the same launch
    variables, arguments and working folder as under a real torchrun; the first rank to fail stops the others and
    the job exits with 1, as torchrun does; a job past its timeout fails the test."""
    import time

    from megatron_opd.testing.multiprocess import ROOT, find_free_port, run_module_job

    (tmp_path / "torchrun").mkdir()
    (tmp_path / "rank_job").mkdir()
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PROBE_DIR": str(tmp_path / "torchrun")}
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={find_free_port()}",
         "-m", "tests.rank_job_probe", "ok"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stdout[-2000:] + torchrun.stderr[-2000:]
    env["PROBE_DIR"] = str(tmp_path / "rank_job")
    code, out = run_module_job("tests.rank_job_probe", ["ok"], nproc=2, env=env, timeout=120, cwd=ROOT)
    assert code == 0, out[-3000:]
    ours, theirs = _probes(tmp_path / "rank_job"), _probes(tmp_path / "torchrun")
    assert set(theirs) == {"rank0", "rank1"}, torchrun.stdout[-2000:] + torchrun.stderr[-2000:]
    assert ours == theirs

    start = time.monotonic()
    code, out = run_module_job("tests.rank_job_probe", ["rank1_fails"], nproc=2, env=env, timeout=120, cwd=ROOT)
    assert code == 1 and "rank 1 (tests.rank_job_probe) exited with code 3" in out, out[-3000:]
    assert "rank 0 (tests.rank_job_probe) exited with code -15" in out, "rank 0 was not stopped with SIGTERM"
    assert time.monotonic() - start < 60

    with pytest.raises(pytest.fail.Exception, match="did not finish within 3 s") as hung:
        run_module_job("tests.rank_job_probe", ["hang"], nproc=1, env=env, timeout=3, cwd=ROOT)
    assert "(most recent call first)" in str(hung.value), "no stack of the hung rank in the failure"
