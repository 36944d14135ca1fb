"""What a user does with the installed package, in one process started in an empty folder (tests/test_quickstart.py
runs it as ``python -c``, so nothing of the checkout is on the path; one start-up of torch for all of it).

    python -c "$(cat tests/installed_session.py)" HF_KERNELS_DIR STUDENT_DIR WORK_DIR LOSS_EXAMPLE_FILE

Another top-level ``kernels`` package (Hugging Face's) goes first on the path, as where transformers' hub kernels are
installed. Then: every console command of the installed distribution called as its script calls it with ``--help``
(an option added without a help text is recorded as it is added), the converter's round trip of STUDENT_DIR into
WORK_DIR/mcore and back into WORK_DIR/exported (``opd-convert``'s entry point), and the README's loss example.
Prints one JSON line: each part's result, or the traceback it raised.
"""

import argparse
import contextlib
import io
import json
import sys
import traceback

HF_KERNELS_DIR, STUDENT_DIR, WORK_DIR, LOSS_EXAMPLE_FILE = sys.argv[1:5]
sys.path.insert(0, HF_KERNELS_DIR)
# Only the installed package: an editable install's finder (of a checkout) would answer what the path misses.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]


def kernels_side_by_side() -> dict[str, str]:
    """Where ``kernels`` and the modules that read the project's kernels come from."""
    import kernels
    import megatron_opd.kernels.divergence_triton
    import megatron_opd.kernels.rmsnorm_triton
    import megatron_opd.losses.local_ops
    import megatron_opd.losses.vocab_parallel
    import megatron_opd.models.norms  # noqa: F401

    modules = (kernels, megatron_opd, megatron_opd.kernels, megatron_opd.kernels.rmsnorm_triton)
    return {module.__name__: module.__file__ for module in modules}


def console_scripts() -> tuple:
    """The installed distribution (the first on the path) and its console commands by name."""
    from importlib.metadata import distribution

    dist = distribution("megatron-opd")
    return dist, {ep.name: ep for ep in dist.entry_points if ep.group == "console_scripts"}


def commands_help() -> dict:
    """``COMMAND --help`` of every console command (and of the converter's subcommands): exit code and text."""
    undescribed, add_argument = [], argparse._ActionsContainer.add_argument

    def add_described_argument(self, *args, **kwargs):
        action = add_argument(self, *args, **kwargs)
        if not (action.help or "").strip():
            undescribed.append(" ".join(sys.argv[:-1]) + ": " + ("/".join(action.option_strings) or action.dest))
        return action

    dist, commands = console_scripts()
    helps = {}
    argparse._ActionsContainer.add_argument = add_described_argument
    try:
        for argv in [[name] for name in sorted(commands)] + [
            ["opd-convert", "hf-to-mcore"],
            ["opd-convert", "mcore-to-hf"],
        ]:
            sys.argv, out = [*argv, "--help"], io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    commands[argv[0]].load()()
                    code = "returned"
                except SystemExit as exit_:
                    code = exit_.code
            helps[" ".join(argv)] = [code, out.getvalue()]
    finally:
        argparse._ActionsContainer.add_argument = add_argument
    return {"distribution": str(dist.locate_file("")), "helps": helps, "undescribed": undescribed}


def converter_round_trip() -> list[int]:
    """``opd-convert hf-to-mcore`` then ``mcore-to-hf``: their exit codes (the test compares the tensors)."""
    _, commands = console_scripts()
    convert = commands["opd-convert"].load()
    ckpt, back = f"{WORK_DIR}/mcore", f"{WORK_DIR}/exported"
    return [
        convert(["hf-to-mcore", "--hf-dir", STUDENT_DIR, "--out", ckpt, "--no-progress"]),
        convert(["mcore-to-hf", "--ckpt", ckpt, "--out", back, "--no-progress"]),
    ]


def loss_example() -> str:
    """The README's loss example (with its inputs and checks), run as a user's script."""
    out = io.StringIO()
    with open(LOSS_EXAMPLE_FILE) as f, contextlib.redirect_stdout(out):
        exec(compile(f.read(), "README loss example", "exec"), {"__name__": "__main__"})
    return out.getvalue()


report = {}
for part in (kernels_side_by_side, commands_help, converter_round_trip, loss_example):
    try:
        report[part.__name__] = {"result": part()}
    except BaseException:  # noqa: B036 - a SystemExit too: it is the part's failure, reported as such
        report[part.__name__] = {"error": traceback.format_exc()}
print("\n" + json.dumps(report))
sys.stdout.flush()
from megatron_opd.process_exit import exit_now  # noqa: E402

exit_now(0)
