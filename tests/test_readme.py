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
