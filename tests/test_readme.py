"""The README: CI runs its test command verbatim, its loss example runs where the package is installed, and it stays a
front page (its size, every link of README, docs/ and benchmarks/, every command it shows)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) >= 2, "README must open with a set-up + quick start command and a test command"
    quick_start, tests = blocks[0].strip(), blocks[1].strip()
    assert "examples/quickstart.py" in quick_start and "pytest" in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert tests in ci_lines, ".ci/run must run the README's test command verbatim"


# The example's free names, made as a caller would have them (one rank, no process group).
_LOSS_EXAMPLE_INPUTS = """
import torch
torch.manual_seed(0)
tokens, true_vocab = 6, 50
student_logits = torch.randn(tokens, true_vocab + 14, requires_grad=True)  # a padded vocabulary
teacher_logits = torch.randn(tokens, true_vocab + 14)
topk_logprobs, topk_ids = torch.log_softmax(teacher_logits[:, :true_vocab], -1).topk(4)
response_mask = torch.ones(tokens)
"""


def loss_example_program() -> str:
    """The README's loss example as a program that prints ``ran`` once its loss is finite and its gradient flows.
    tests/test_quickstart.py runs it where the package is installed, from an empty folder: an import that resolves
    only from the checkout (a top-level ``kernels``) fails there as it does for a user."""
    readme = (ROOT / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)\n```", readme, flags=re.S) if "megatron_opd.losses" in b)
    check = "\nloss.backward()\nassert torch.isfinite(loss) and student_logits.grad.abs().sum() > 0\nprint('ran')\n"
    return _LOSS_EXAMPLE_INPUTS + example + check


# --- the front page stays a front page: its size, its links, and every command it shows ---

README_MAX_CHARS = 8_000
_FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens, and a
    ``-N`` suffix on the Nth repeat of a slug."""
    anchors: set[str] = set()
    for line in _FENCE.sub("", markdown).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_the_anchor_rule_is_githubs():
    """Pinned against anchors GitHub gives these headings (checked on github.com)."""
    text = "# Loss (bench_loss.py)\n## Issue #40's small shape (`--shape small`)\n## A B\n## A B\n```\n# not a heading\n```"
    assert _heading_anchors(text) == {"loss-bench_losspy", "issue-40s-small-shape---shape-small", "a-b", "a-b-1"}


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def test_readme_is_a_front_page():
    size = len((ROOT / "README.md").read_text())
    assert size < README_MAX_CHARS, f"README.md has {size} characters; details belong in docs/"
    first_link = _LINK.search((ROOT / "README.md").read_text())
    assert first_link and first_link.group(1) == "docs/architecture.md", "the ten-minute map comes first"


def test_every_relative_link_and_anchor_resolves():
    """Every relative link of README.md, docs/*.md and benchmarks/*.md names a file that exists, and an anchor into a
    Markdown file names one of its headings."""
    anchors: dict[Path, set[str]] = {}
    broken = []
    for source in _markdown_files():
        for target in _LINK.findall(_FENCE.sub("", source.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (source.parent / path_part).resolve() if path_part else source
            where = f"{source.relative_to(ROOT)}: {target}"
            if not path.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and path.suffix == ".md":
                if path not in anchors:
                    anchors[path] = _heading_anchors(path.read_text())
                if anchor not in anchors[path]:
                    broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


# The README's console commands: setup.py's console_scripts (``module:function``) once declared there, else what
# each runs today (``-m module`` or a file run as a script). `python -m X` and `python FILE` name theirs directly.
_COMMANDS = {
    "opd-train": "-m megatron_opd.train",
    "opd-launch": "-m megatron_opd.launch",
    "opd-check-vocab": "-m megatron_opd.check_vocab",
    "opd-convert": "tools/checkpoint/convert.py",
    "opd-quickstart": "examples/quickstart.py",
}
# What the README may show besides those: the set-up steps of its first two commands.
_SET_UP = (("python", "-m", "venv"), (".",), ("pip",), ("python", "-m", "pytest"))


def _declared_console_scripts() -> dict[str, str]:
    """``name -> module:function`` of setup.py's console_scripts."""
    import ast

    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    pairs = (entry.split("=", 1) for entry in ast.literal_eval(value))
                    return {name.strip(): target.strip() for name, target in pairs}
    return {}


def _readme_commands() -> list[list[str]]:
    """Each command line of the README's bash blocks, continuation lines joined, comments and ``&&`` split."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:end])
                words = words[end + 1 :]
    return commands


def _entry_point(words: list[str]) -> tuple[str, list[str]] | None:
    """``(what runs, its arguments)`` of a command; None for a set-up step."""
    if words[0] == "torchrun":  # torchrun's own options, then the program: -m MODULE, --no-python COMMAND, or FILE
        i = 1
        while words[i].startswith("-") and words[i] not in ("-m", "--no-python", "--no_python"):
            i += 1 if "=" in words[i] or words[i + 1].startswith("-") else 2
        words = words[i + 1 :] if words[i] in ("--no-python", "--no_python") else ["python", *words[i:]]
    if any(tuple(words[: len(step)]) == step for step in _SET_UP):
        return None
    if words[0] in _COMMANDS:
        return _declared_console_scripts().get(words[0], _COMMANDS[words[0]]), words[1:]
    if words[0] == "python" and words[1] == "-m":
        return f"-m {words[2]}", words[3:]
    if words[0] == "python" and words[1].endswith(".py"):
        return words[1], words[2:]
    raise AssertionError(f"the README shows a command this test does not know: {' '.join(words)}")


class _Parsed(Exception):
    """Raised in place of running a command once its arguments have parsed."""


def _parse_without_running(target: str, args: list[str]) -> None:
    """Run the command (``module:function``, ``-m module`` or a script file) up to its argument parser: parsing
    succeeds (or ``--help`` exits 0) or the test fails; nothing past the parser runs."""
    import argparse
    import importlib
    import runpy
    from unittest import mock

    if target.startswith("-m "):
        where = target[3:]
        run = lambda: runpy.run_module(where, run_name="__main__", alter_sys=True)  # noqa: E731
    elif target.endswith(".py"):
        where = target
        run = lambda: runpy.run_path(str(ROOT / where), run_name="__main__")  # noqa: E731
    else:
        where, function = target.split(":")
        run = getattr(importlib.import_module(where), function)
    real = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}
    depth = [0]

    def parse_then_stop(name):
        def parse(parser, *a, **kw):  # the outermost parse (parse_args calls parse_known_args) stops the command
            depth[0] += 1
            try:
                result = real[name](parser, *a, **kw)
            finally:
                depth[0] -= 1
            if depth[0]:
                return result
            raise _Parsed(result if name == "parse_args" else result[0])

        return parse

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop("parse_args")), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_then_stop("parse_known_args")), \
            mock.patch("sys.argv", [where, *args]):  # fmt: skip
        try:
            run()
        except SystemExit as stop:
            assert stop.code in (0, None), f"{target} {args}: exit {stop.code}"
            return
        except _Parsed as parsed:
            namespace = parsed.args[0]
        else:
            raise AssertionError(f"{target} ran without parsing its arguments")
    if where.startswith(
        "megatron_opd.train"
    ):  # the config keys and values of the overrides, against the config classes
        from megatron_opd.config import load_config
        from megatron_opd.trainer.config import TrainConfig

        load_config(TrainConfig, namespace.config and ROOT / namespace.config, namespace.overrides)
    for value in vars(namespace).values():  # a file the command reads from the repository (a config, a recipe)
        if isinstance(value, str) and value.startswith("examples/"):
            assert (ROOT / value).is_file(), f"{target}: {value} does not exist"


def test_every_command_the_readme_shows_parses():
    commands = [entry for words in _readme_commands() if (entry := _entry_point(words)) is not None]
    shown = {target.split(":")[0].removeprefix("-m ") for target, _ in commands}
    assert shown >= {"examples/quickstart.py", "megatron_opd.train"}, shown
    for target, args in commands:
        _parse_without_running(target, args)


def test_the_command_parser_fails_on_a_wrong_argument():
    """The check above can fail: an unknown option, and an unknown config key."""
    import pytest

    with pytest.raises(AssertionError):
        _parse_without_running("-m megatron_opd.check_vocab", ["teacher", "student", "--no-such-option"])
    with pytest.raises(Exception, match="no_such_key"):
        _parse_without_running("megatron_opd.train:main", ["train.no_such_key=1"])
