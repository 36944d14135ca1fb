"""Shared fixtures: tiny Hugging Face checkpoints built once per test session, the quick start's run, and the package
installed from its wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# One thread per process, in the test workers and in everything they start (which inherits the variable): the
# suite runs on three workers sharing the cores, and a process with more OpenMP threads than its share spins
# them against the other workers (the cross-tokenizer quick start, TP=1 with two threads: 67 s alone, 428 s beside
# one busy core; one thread: 81 s; benchmarks/CI_LOG.md, "The test suite's time").
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

from megatron_opd.testing.tiny_models import make_tiny_hf_model  # noqa: E402

# The smoke set run against the newest Megatron-Core release (``pytest -m mcore_smoke``; .ci/run): a distillation
# step at TP=2 equal to TP=1, the converter's round trip, a resume at other layouts, the CPU patches, expert
# parallelism and DeepSeek-V3's attention. Node ids or their prefixes, so the tests themselves stay unmarked.
MCORE_SMOKE = (
    "tests/test_train_step.py::test_step_equals_tp1[tp2]",
    "tests/test_checkpoint.py::test_round_trip_is_bitwise",
    "tests/test_resume_layouts.py::",
    "tests/test_cpu_compat.py::test_every_patch_is_needed_and_works",
    "tests/test_cpu_compat.py::test_grad_sync_stream_patch_is_needed_and_works",
    "tests/test_cpu_compat.py::test_optimizer_type_patch_is_needed_works_and_is_scoped",
    "tests/test_cpu_compat.py::test_moe_patches_are_needed_and_work",
    "tests/test_moe.py::test_expert_parallel_losses_and_gradients_equal_ep1",
    "tests/test_deepseek_v3.py::",  # multi-latent attention with megatron-opd's key/value down projection
)


# The README's command runs the suite on three pytest-xdist workers (``-n 3 --dist loadfile``): a file's tests run on
# one worker, so its module-scoped fixtures (a shared run, a server, a model pair) are built once; tests sharing a run
# live in one file (tests/test_quickstart.py). Files start longest first, the rest in file order, so that no long
# file is left for the end (the seconds each took on 2 cores: benchmarks/CI_LOG.md, "The test suite's time").
LONGEST_FIRST = (
    "test_quickstart.py",
    "test_quickstart_cross_tokenizer.py",  # one test of ~190 s: it cannot be split across workers
    "test_vllm_server.py",
    "test_teacher_server.py",
    "test_train_cli.py",
    "test_vllm_rollout_faults.py",
    "test_teacher_vllm.py",
    "test_weight_sync_vllm.py",
    "test_real_tokenizers.py",
    "test_scheduler_faults.py",
    "test_checkpoint.py",
    "test_multi_teacher.py",
    "test_models.py",
    "test_moe.py",
    "test_context_parallel.py",
    "test_deepseek_v3.py",
    "test_sampler.py",
    "test_checkpoint_memory.py",
    "test_fused_output.py",
    "test_checkpoint_vllm.py",
    "test_tool_rollouts.py",
    "test_packing.py",
    "test_train_step.py",
    "test_resume_layouts.py",
    "test_fp8_checkpoints.py",  # one process: the FP8 load and four conversions, ~25 s
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "mcore_smoke: the smoke set for the newest Megatron-Core (see conftest.py)")
    config.option.loadscopereorder = False  # xdist would order files by test count; LONGEST_FIRST orders them


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.startswith(MCORE_SMOKE):
            item.add_marker(pytest.mark.mcore_smoke)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order otherwise


def pytest_terminal_summary(terminalreporter) -> None:
    """The covering array's outcome per generated config (tests/test_config_space.py): ran, or refused before build."""
    from megatron_opd.testing.config_space import outcomes_file

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the session's process prints it, once every worker has written its rows
    path = outcomes_file()
    if path.exists():
        terminalreporter.section("configurations (tests/test_config_space.py)")
        for line in sorted(path.read_text().splitlines()):
            terminalreporter.write_line(line.replace("\t", ": ", 1))
        path.unlink()


# family -> overrides. Together they cover llama3 RoPE scaling, QKV bias, QK-norm, tied embeddings,
# and a vocabulary (1001) that divides by neither TP nor 128.
TINY_MODELS = {
    "llama": dict(),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(vocab_size=1001),
}


@pytest.fixture(scope="session")
def tokenizer_kinds(tmp_path_factory) -> dict:
    """``real_tokenizers.tokenizers_of_every_kind``, written and loaded once (alignment and vocabulary-map tests)."""
    from megatron_opd.testing.real_tokenizers import tokenizers_of_every_kind

    return tokenizers_of_every_kind(tmp_path_factory.mktemp("tokenizer_kinds"))


@pytest.fixture(scope="session")
def digit_tokenizers(tmp_path_factory) -> dict:
    """The digit task's tokenizers by ``digit_merges``: one token per digit (``none``), per pair, per doubled digit."""
    from megatron_opd.tasks import digits
    from megatron_opd.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("digit_tokenizers")
    return {m: load_tokenizer(digits.make_tokenizer(root / m, digit_merges=m)) for m in digits.DIGIT_MERGES}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: str(make_tiny_hf_model(family, root / family, seed=i, **overrides))
        for i, (family, overrides) in enumerate(TINY_MODELS.items())
    }


@pytest.fixture(scope="session")
def shape_dirs(tmp_path_factory):
    """Every shape of the model-shape matrix (``megatron_opd.testing.shapes``), each built once on first use:
    name -> folder."""
    from megatron_opd.testing.shapes import ShapeDirs

    return ShapeDirs(tmp_path_factory.mktemp("shapes"))


ROOT = Path(__file__).resolve().parents[1]


def run_quickstart(
    workdir: Path, *args: str, timeout: float = 900, installed: InstalledPackage | None = None
) -> tuple[subprocess.CompletedProcess, str]:
    """``examples/quickstart.py --workdir workdir args`` in the checkout, or ``installed``'s ``opd-quickstart`` from
    its empty folder; asserts it passed its bar with no library warnings."""
    # OMP_NUM_THREADS=1 (above): the quick start's own share of the cores assumes the machine is its alone.
    command, cwd, env = [sys.executable, "examples/quickstart.py"], ROOT, None
    if installed is not None:
        command, cwd, env = [str(installed.script("opd-quickstart"))], installed.empty_dir, installed.env
    proc = subprocess.run([*command, "--workdir", str(workdir), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "PASS: divergence at least halved, accuracy up 10+ points" in proc.stdout
    # What a newcomer sees is our output, not pages of library warnings.
    noise = [line for line in out.splitlines() if "Warning" in line or "warnings.warn" in line]
    assert not noise, "unfiltered library warnings:\n" + "\n".join(noise[:20])
    return proc, out


def _without_coverage() -> dict[str, str]:
    """This process's environment without what starts coverage in a child (README's coverage command)."""
    return {k: v for k, v in os.environ.items() if k not in ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG")}


@dataclass(frozen=True)
class InstalledPackage:
    """This checkout's wheel installed by pip into ``site`` (``pip install --target``), apart from the source tree,
    and an empty folder to run it from."""

    site: Path
    empty_dir: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process that imports megatron_opd from ``site``: first on the path, before the
        editable install's finder (which answers only what the path does not). Coverage is off there: it would
        record files of ``site``, which is gone by the time the report is made."""
        env = _without_coverage()
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    def script(self, name: str) -> Path:
        """A console command as pip wrote it (``site/bin``)."""
        return self.site / "bin" / name

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """``args`` (a console command or ``python ...``) in the empty folder; stdout and stderr as text."""
        return subprocess.run(list(args), cwd=self.empty_dir, env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip


# What the wheel is built from: setup.py's inputs (README.md is its long description), nothing else of the checkout.
_WHEEL_SOURCES = ("setup.py", "pyproject.toml", "README.md", "megatron_opd", "kernels", "examples/quickstart")


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                          env=_without_coverage(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def install_wheel(root: Path) -> InstalledPackage:
    """Build this checkout's wheel (``pip wheel``, no build isolation: setuptools and wheel are the venv's) from a
    copy of its sources, so that no earlier ``build/`` folder leaks into it, and install it into ``root/site``."""
    source, wheels = root / "source", root / "wheels"
    for name in _WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source))
    (wheel,) = wheels.glob("megatron_opd-*.whl")
    _pip("install", "--no-deps", "--target", str(root / "site"), str(wheel))
    (root / "empty").mkdir()
    return InstalledPackage(root / "site", root / "empty")


def other_kernels_package(tmp_path: Path) -> Path:
    """Hugging Face's `kernels` where it is installed (transformers' hub kernels), else a stand-in of the same
    import name: either must not shadow the project's kernels, nor be shadowed by them."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin and not Path(spec.origin).resolve().is_relative_to(ROOT):
        return Path(spec.origin).parents[1]
    (tmp_path / "hf" / "kernels").mkdir(parents=True)
    (tmp_path / "hf" / "kernels" / "__init__.py").write_text('"""Stand-in for Hugging Face\'s kernels package."""\n')
    return tmp_path / "hf"


def triton_kernel_device(kernel_module) -> torch.device | None:
    """Where a kernel test of ``kernel_module`` (a ``megatron_opd.kernels`` module) runs: CUDA with triton, the CPU
    under ``TRITON_INTERPRET=1`` (``tests/test_kernels_interpreted.py``), else None (the test skips)."""
    if kernel_module.triton is None:
        return None
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu") if os.environ.get("TRITON_INTERPRET") == "1" else None
