"""Run a function on N rank processes with a real ``torch.distributed`` process group.

Every parallel feature of megatron-opd is tested on CPU with gloo. This helper starts one process per
rank, gives each a fresh port, collects every rank's return value or traceback, and turns a hung collective
into a ``TimeoutError`` instead of a hung CI. Ranks fork from a server process that has imported torch and
Megatron-Core once (multiprocessing's ``forkserver``; ~5 s of CPU per rank otherwise): it only imports, so no
state leaks from the parent or between ranks, and each rank gets the parent's environment at its start.

    def body(tp):                      # module-level, so it can be pickled
        ...                            # torch.distributed is initialised here
        return some_tensor

    results = run_distributed(body, world_size=4, args=(2,))
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_opd.distributed.ports import find_free_port  # noqa: F401 - the tests' import of it

# What the rank server imports before it forks ranks: first the filters for known-harmless library warnings, then
# "__main__" (a script's own bodies, as spawn would import it) and the heavy imports.
_PRELOAD = [
    "megatron_opd.testing.quiet_ranks",
    "__main__",
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "transformers",
    "megatron_opd.train",  # what a trainer rank imports first (``RankJob``)
    # The vLLM server's imports (a start otherwise spends 8 s of CPU importing them; 3 s more here), where installed:
    # the fork server passes over a module it cannot import.
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launchers.api_server.entry",
    __name__,
]

# After the first rank fails, the others get this long to finish or fail before they are killed
# (they are usually blocked in a collective that will never complete).
_FAILURE_GRACE_S = 10.0


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant.

    torchrun starts each worker in a session of its own, so killing torchrun's group alone would orphan its ranks
    (a server serves on, a trainer keeps the output pipe open); the descendants are collected before anything dies.
    """
    import signal

    import psutil

    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_process_group(
    command: Sequence[str], *, env: dict[str, str], cwd: str | os.PathLike, timeout: float
) -> tuple[int, str]:
    """Run ``command`` in its own session and return ``(returncode, stdout+stderr)``; whatever it leaves behind
    (torchrun workers, dist_checkpointing's helper processes holding the pipe) is killed with it. A run past
    ``timeout`` fails the calling test with the output's tail.

    Every process it starts carries a marker in its environment, so that one whose parent died first (a rank that
    torchrun left behind, re-parented to init and no longer anyone's descendant) is found and killed too."""
    import subprocess
    import uuid

    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        list(command), cwd=cwd, env={**env, _RUN_MARKER: marker}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        _kill_marked(marker)
        out, _ = proc.communicate()
        import pytest

        pytest.fail(f"{' '.join(command[:6])} ... did not finish within {timeout} s:\n{out[-3000:]}")
    finally:
        kill_tree(proc.pid)
        _kill_marked(marker)
    return proc.returncode, out


_RUN_MARKER = "MEGATRON_OPD_TEST_RUN"


def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment says ``run_process_group`` started it with ``marker``."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get(_RUN_MARKER) == marker:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


ROOT = Path(__file__).resolve().parents[2]
"""The repository root. Jobs of the package's own modules never start there (``RankJob``): an import that resolves
only from the checkout (a top-level folder of the repository) must fail in the tests as it fails for an installed
package."""


def outside_folder() -> Path:
    """A fresh empty folder outside the repository: a job's working directory, as a user's would be."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="megatron-opd-job-"))


def trainer_command(overrides: Sequence[str], nproc: int = 2) -> list[str]:
    """``torchrun --nproc-per-node nproc -m megatron_opd.train overrides`` on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={find_free_port()}", "-m", "megatron_opd.train", *overrides]  # fmt: skip


def trainer_env(fault: str | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with one thread per rank, unbuffered output, ``fault`` as the fault-injection hook
    (``MEGATRON_OPD_FAULT``, unset otherwise) and ``env``'s extra variables."""
    from megatron_opd.faults import FAULT_ENV

    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out.pop(FAULT_ENV, None)
    if fault:
        out[FAULT_ENV] = fault
    return {**out, **(env or {})}


def run_trainer(
    overrides: Sequence[str],
    *,
    nproc: int = 2,
    fault: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 400,
) -> tuple[int, str]:
    """The one way tests run the trainer to its end: ``python -m megatron_opd.train overrides`` on ``nproc`` ranks
    started as torchrun starts them, forked from the rank server (``run_module_job``); (exit code, output). The
    trainer under a real torchrun: the README's quick start, the pre-emption test (``trainer_command``),
    test_launch.py."""
    return run_module_job("megatron_opd.train", overrides, nproc=nproc, env=trainer_env(fault, env), timeout=timeout)


def run_module_job(
    module: str,
    argv: Sequence[str],
    *,
    nproc: int,
    env: dict[str, str],
    timeout: float,
    cwd: str | os.PathLike | None = None,
) -> tuple[int, str]:
    """``RankJob`` to its end: (exit code, every rank's output). Whatever the ranks leave behind is killed, and a job
    past ``timeout`` fails the calling test with the output's tail."""
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="rank-job-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
    try:
        job = RankJob(module, argv, nproc=nproc, env=env, log_file=log_path, cwd=cwd)
        try:
            code = job.wait(timeout)
        except TimeoutError:
            code = None
            job.dump_stacks()  # where every rank hangs, into the log
        finally:
            job.kill()  # what the ranks started and left behind (all of it, past the timeout)
        out = log_path.read_text(errors="replace")
        if code is None:
            import pytest

            pytest.fail(f"python -m {module} on {nproc} ranks did not finish within {timeout} s:\n{out[-3000:]}")
        return code, out
    finally:
        log_path.unlink(missing_ok=True)


class RankJob:
    """``torchrun --nproc-per-node nproc -m module argv`` without torchrun: each rank forks from the rank server
    (torch and Megatron-Core imported once per test worker; a trainer rank spends 4 s of CPU importing otherwise, and
    torchrun's agent 1.6 s more), gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``...) and a session of its own, and runs ``module`` as ``__main__`` with its
    output appended to ``log_file``. As torchrun's agent does, the first rank to fail stops the others (SIGTERM,
    then SIGKILL after a grace) and the job's exit code is then 1. ``poll``/``wait``/``returncode`` as
    ``subprocess.Popen``'s; ``kill`` ends every rank and what it started. Without ``launch_env``, a process that is
    no rank of a job (a vLLM server: torchrun's variables would make it one).

    Without ``cwd`` the ranks start in a fresh folder outside the repository, and a working folder outside the
    repository also takes the repository root off ``sys.path`` (the test process has it there): the job sees what
    an installed package sees. Paths in ``argv`` must then be absolute."""

    def __init__(
        self,
        module: str,
        argv: Sequence[str],
        *,
        nproc: int,
        env: dict[str, str],
        log_file: str | os.PathLike,
        cwd: str | os.PathLike | None = None,
        launch_env: bool = True,
    ) -> None:
        import threading

        self._own_cwd = cwd is None
        cwd = outside_folder() if cwd is None else cwd
        self.cwd = Path(cwd)

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        port = find_free_port()
        Path(log_file).touch()
        self.module, self.log_file, self.returncode = module, str(log_file), None
        self.procs = [
            ctx.Process(target=_module_rank_main,
                        args=(module, list(argv), rank, nproc, port, dict(env), str(cwd), str(log_file), launch_env))
            for rank in range(nproc)
        ]  # fmt: skip
        for proc in self.procs:
            proc.start()
        self._done = threading.Event()
        threading.Thread(target=self._supervise, daemon=True, name=f"rank job {module}").start()

    def _supervise(self) -> None:
        import signal
        from multiprocessing.connection import wait

        failed_at, code, reported = None, 0, set()
        while len(reported) < len(self.procs):
            wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.5)
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None and rank not in reported:
                    reported.add(rank)
                    if proc.exitcode != 0:  # torchrun's agent names the failed ranks too
                        with open(self.log_file, "a") as log:
                            log.write(f"[rank job] rank {rank} ({self.module}) exited with code {proc.exitcode}\n")
            if failed_at is None and any(p.exitcode not in (None, 0) for p in self.procs):
                failed_at, code = time.monotonic(), 1
                self._signal(signal.SIGTERM)
            if failed_at is not None and time.monotonic() > failed_at + _FAILURE_GRACE_S:
                self._signal(signal.SIGKILL)
        self.returncode = code
        self._done.set()

    def _signal(self, sig: int) -> None:
        """``sig`` to the session of every rank still running (its descendants stay in its process group)."""
        for proc in self.procs:
            if proc.exitcode is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise TimeoutError(f"python -m {self.module} still running after {timeout} s")
        return self.returncode

    def dump_stacks(self, wait_s: float = 3.0) -> None:
        """Every running rank writes the stack of each of its threads to the job's log (``faulthandler`` on
        SIGUSR1): what a hung job was waiting on."""
        import signal

        for proc in self.procs:
            if proc.exitcode is None and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(wait_s)

    def kill(self) -> None:
        for proc in self.procs:
            kill_tree(proc.pid)
        self._done.wait(30)
        if self._own_cwd:
            import shutil

            shutil.rmtree(self.cwd, ignore_errors=True)


def launch_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-node job on loopback (checked against a real torchrun's in
    tests/test_distributed.py)."""
    return dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
        ROLE_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        ROLE_WORLD_SIZE=str(world_size), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
    )  # fmt: skip


def _module_rank_main(
    module: str,
    argv: list[str],
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    cwd: str,
    log_path: str,
    launch_env: bool,
) -> None:
    """One rank of a ``RankJob``: ``env`` and (with ``launch_env``) torchrun's variables for it, its output appended
    to the job's log, then ``python -m module argv`` (its exit code is the process's)."""
    import runpy

    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED acts at a start this process did not make
    os.chdir(cwd)
    os.environ.clear()  # the rank server's environment is the parent's when the server started
    os.environ.update(env)
    if launch_env:
        os.environ.update(launch_variables(rank, world_size, port))
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # RankJob.dump_stacks
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    if not Path(cwd).resolve().is_relative_to(ROOT):  # an installed package's view: the checkout is not on the path
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
        # and no module the rank server found there (vLLM's import of Hugging Face's `kernels` finds the top-level
        # kernels/ folder while the root is on the path), except the package itself, which the install maps there
        for name, mod in list(sys.modules.items()):
            top, origin = name.split(".")[0], getattr(mod, "__file__", None)
            if origin and top != "megatron_opd" and Path(origin).resolve().is_relative_to(ROOT):
                if Path(origin).resolve().relative_to(ROOT).parts[0] in (top, f"{top}.py"):
                    del sys.modules[name]
    sys.path[0:0] = [cwd]  # ``python -m`` puts the working folder first
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # as if never imported: runpy warns about a module run twice
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as Python would, then the exit code
        traceback.print_exc()
        code = 1
    from megatron_opd.process_exit import exit_now

    exit_now(code)


def _rank_main(
    fn: Callable[..., Any],
    args: Sequence[Any],
    rank: int,
    world_size: int,
    port: int,
    init_process_group: bool,
    env: dict[str, str],
    results: mp.Queue,
    rank_server: str,
) -> None:
    os.environ.clear()  # the rank server's environment is the parent's when the server started
    os.environ.update(env)
    os.environ.update(launch_variables(rank, world_size, port))
    _fork_from_rank_server(rank_server)
    try:
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        if init_process_group:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(*args)
        # Plain pickle copies tensor data inline; the queue's own pickler would pass shared-memory
        # handles that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                # A rank that finishes first must not close its connections while another is still making the
                # group's (gloo's connectFullMesh fails with "Connection closed by peer"). A rank left here by a
                # failed peer is killed by the parent once it has the failure.
                dist.barrier()
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    results.close()
    results.join_thread()  # this rank's result is in the pipe
    from megatron_opd.process_exit import exit_now

    exit_now(0)  # a failure went to the parent as a traceback


def _fork_from_rank_server(address: str) -> None:
    """Processes this rank starts with multiprocessing's "forkserver" (a vLLM ``EngineProcess``) fork from the rank
    server, which has imported torch and vLLM already, instead of from a fork server of the rank's own (a fresh
    Python importing both again: ~8.7 s of CPU per rank that starts an engine). The rank server handed this rank its
    "alive" pipe and the resource tracker's pipe as it forked it; only its address is missing. Its pid is not this
    rank's child, so the liveness check (``os.waitpid``) is skipped: the rank server outlives every rank."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if server._forkserver_alive_fd is None:  # not forked by a fork server: keep multiprocessing's own way
        return
    server._forkserver_address = address
    server.ensure_running = resource_tracker.ensure_running


class DistributedTestError(RuntimeError):
    """One or more ranks raised; the message holds every failing rank's traceback."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 300.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` rank processes and return the per-rank results.

    ``fn`` must be importable (defined at module level). With ``init_process_group`` the gloo
    process group is created before ``fn`` runs; otherwise only torchrun's environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) are set, as for a
    script launched by ``torchrun``. Raises ``DistributedTestError`` naming every rank that failed
    and ``TimeoutError`` when ranks are still running after ``timeout`` seconds.
    """
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                args,
                rank,
                world_size,
                port,
                init_process_group,
                child_env,
                results,
                forkserver._forkserver._forkserver_address,
            ),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while len(outcomes) < world_size:
        now = time.monotonic()
        limit = deadline if first_failure_at is None else min(deadline, first_failure_at + _FAILURE_GRACE_S)
        if now >= limit:
            break
        try:
            rank, ok, value = results.get(timeout=min(1.0, limit - now))
        except queue.Empty:
            # A rank that died without reporting (segfault, OOM kill) counts as a failure.
            for rank, proc in enumerate(procs):
                if rank not in outcomes and not proc.is_alive() and proc.exitcode not in (0, None):
                    outcomes[rank] = (False, f"process exited with code {proc.exitcode} without a result")
                    first_failure_at = first_failure_at or time.monotonic()
            continue
        outcomes[rank] = (ok, pickle.loads(value) if ok else value)
        if not ok and first_failure_at is None:
            first_failure_at = time.monotonic()

    for proc in procs:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()

    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            parts.append(f"ranks {missing} were still running and were killed")
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(parts))
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s (hung collective?)")
    return [outcomes[r][1] for r in range(world_size)]
