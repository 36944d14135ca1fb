"""Imports go one way: no circle between the package's modules (imports inside functions and under
``TYPE_CHECKING`` included, found with ``ast``), none between its subpackages, and nothing imports the test helpers."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_opd"


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package is its ``__init__``)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file: at the top, inside functions, under
    ``if TYPE_CHECKING``. ``from pkg import x`` is an import of ``pkg.x`` where that is a module, else of ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    targets = set()
    for module in found:
        while module and module not in modules:  # import a.b.c where only a.b is ours: a.b
            module = module.rpartition(".")[0]
        if module and module != name:
            targets.add(module)
    return targets


def module_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_names(package_dir)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def subpackage(module: str) -> str:
    """The subpackage of the top package that ``module`` is in (``a.b.c`` -> ``a.b``); a top-level module
    ``a.m`` stands for itself."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each module replaced by its subpackage; imports within one subpackage are left out."""
    packages: dict[str, set[str]] = defaultdict(set)
    for module, imports in graph.items():
        packages[subpackage(module)].update(subpackage(m) for m in imports if subpackage(m) != subpackage(module))
    return dict(packages)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, without recursion): each is a
    set of nodes every one of which imports, through the others, every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _edges_within(graph: dict[str, set[str]], component: list[str], unit=lambda module: module) -> list[str]:
    """The imports that close a circle: from a member of ``component`` to another (``unit`` maps a module to one)."""
    return sorted(
        f"{a} -> {b}"
        for a in graph
        for b in graph[a]
        if unit(a) in component and unit(b) in component and unit(a) != unit(b)
    )


def test_circle_finder_finds_planted_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert circles({f"m{i}": {f"m{i + 1}"} for i in range(5000)} | {"m5000": {"m0"}}) != []  # deep: no recursion


def test_import_reader_sees_lazy_relative_and_type_checking_imports(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from pkg.low.base import Base\n",
        "pkg/low/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.user import User\n",
        "pkg/low/other.py": "def f():\n    from . import base\n    from ..high import user\n",
        "pkg/high/__init__.py": "",
        "pkg/high/user.py": "import os\nimport pkg.low.base\nfrom pkg.low import other\n",
        "pkg/leaf.py": "from pkg.low import Base\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_graph(tmp_path / "pkg")
    assert graph["pkg.low.other"] == {"pkg.low.base", "pkg.high.user"}
    assert graph["pkg.high.user"] == {"pkg.low.base", "pkg.low.other"}
    assert graph["pkg.leaf"] == {"pkg.low"}
    assert circles(graph) == [["pkg.high.user", "pkg.low.base", "pkg.low.other"]]
    assert circles(package_graph(graph)) == [["pkg.high", "pkg.low"]]


@functools.cache
def _package_modules() -> dict[str, set[str]]:
    return module_graph(ROOT / PACKAGE)


def test_no_circle_between_modules():
    graph = _package_modules()
    found = {", ".join(c): _edges_within(graph, c) for c in circles(graph)}
    assert not found, f"modules that import each other (through each other): {found}"


def test_no_circle_between_packages():
    graph = _package_modules()
    found = {", ".join(c): _edges_within(graph, c, subpackage) for c in circles(package_graph(graph))}
    assert not found, f"subpackages that import each other: {found}"


def test_nothing_in_the_package_imports_the_test_helpers():
    graph = _package_modules()
    testing = f"{PACKAGE}.testing"
    users = {
        module: sorted(m for m in imports if m == testing or m.startswith(testing + "."))
        for module, imports in graph.items()
        if not (module == testing or module.startswith(testing + "."))
    }
    assert not {m: t for m, t in users.items() if t}, "megatron_opd.testing is for tests only"
