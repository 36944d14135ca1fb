"""The model-shape matrix is a covering design, its cells name tests that exist, and docs/models.md shows it.

The cells themselves run in the tests they name (``megatron_opd.testing.shapes.MATRIX``); this file checks the
matrix: every (property, path) pair at least once, every property at every layout at least once (a single KV head
only without tensor parallelism; a ``SCOPED`` shape's family only in the logits at TP=1 and TP=2 and the paths it
is scoped to), and the table in the docs equal to the one the matrix renders."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_opd.testing.shapes import (
    ALL_PROPERTIES,
    EXPERT_LAYOUTS,
    MATRIX,
    MOE,
    MOE_ONLY,
    OUTSIDE_MATRIX,
    SCOPED,
    SHAPES,
    TP1_ONLY,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[1]


def _properties(names) -> frozenset[str]:
    return frozenset().union(*(SHAPES[n].properties for n in names))


LOGITS = "Megatron model vs transformers logits"
SCOPED_ONLY = ALL_PROPERTIES - _properties(n for n in SHAPES if n not in SCOPED and n not in OUTSIDE_MATRIX)
"""Properties only the scoped shapes have (their families; a shape outside the matrix, as Gemma 4's MoE one, does
not make its family's properties demanded everywhere)."""


def _expected(names, path: str | None = None, layout: str | None = None) -> frozenset[str]:
    """Every property, the MoE-only ones where the cells run an MoE shape (the paths MoE has reached), the scoped
    shapes' families in the logits path, in the paths they are scoped to and at TP=1 and TP=2."""
    expected = ALL_PROPERTIES if set(names) & set(MOE) else ALL_PROPERTIES - MOE_ONLY
    if path is not None and path != LOGITS:
        expected -= SCOPED_ONLY - _properties(n for n, paths in SCOPED.items() if path in paths)
    if layout is not None and layout not in ("tp1", "tp2"):
        expected -= SCOPED_ONLY
    return expected


@pytest.mark.parametrize("path", list(MATRIX))
def test_every_property_runs_through_every_path(path):
    names = [n for names, _ in MATRIX[path].values() for n in names]
    missing = _expected(names, path=path) - _properties(names)
    assert not missing, f"{path}: no shape with {sorted(missing)}"


def test_every_property_runs_at_every_layout():
    layouts = {layout for cells in MATRIX.values() for layout in cells}
    for layout in layouts:
        names = [n for cells in MATRIX.values() if layout in cells for n in cells[layout][0]]
        split = layout.startswith("tp2")  # tensor-parallel size 2
        expected = _expected(names, layout=layout) - TP1_ONLY if split else _expected(names, layout=layout)
        if layout in EXPERT_LAYOUTS:
            expected = MOE_ONLY
        missing = expected - _properties(names)
        assert not missing, f"{layout}: no shape with {sorted(missing)}"
        if split:
            assert not TP1_ONLY & _properties(names), f"{layout}: a single KV head cannot be split over TP=2"


def test_scoped_shapes_run_the_logits_at_tp1_and_tp2_and_their_paths():
    for name, paths in SCOPED.items():
        for layout in ("tp1", "tp2"):
            assert name in MATRIX[LOGITS][layout][0], f"{name}: no logits at {layout}"
        for path in paths:
            assert any(name in names for names, _ in MATRIX[path].values()), f"{name}: scoped to {path}, not in it"


def test_every_cell_names_a_test_that_exists():
    for path, cells in MATRIX.items():
        for layout, (names, test) in cells.items():
            assert set(names) <= set(SHAPES), (path, layout, names)
            file, func = test.split("::")
            tree = ast.parse((ROOT / "tests" / file).read_text())
            defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
            assert func in defined, f"{path} at {layout}: {test} does not exist"


def test_docs_show_the_matrix():
    text = (ROOT / "docs" / "models.md").read_text()
    assert markdown_table() in text, "docs/models.md is out of date: paste megatron_opd.testing.shapes.markdown_table()"
