"""CI runs exactly the test command the README gives newcomers."""

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
