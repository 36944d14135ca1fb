"""The README's cross-tokenizer quick start (``examples/quickstart.py --cross-tokenizer``)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_quickstart


def test_quickstart_distils_across_tokenizers(tmp_path):
    """``--cross-tokenizer``: the teacher tokenizes doubled digits as one token, the student one token per digit; a
    125-step SFT warm-up, then ``distil_cross.yaml``'s loss (``aligned`` forward KL, top 16, since issue #51; the
    sampled reverse KL before, which gave 9.8% -> 59.4%, -14.35 -> -7.15 here, a pass by 0.03 on the log-ratio) must
    raise held-out accuracy by 10 points and halve the sequence log-ratio. TP=1
    here (``--nproc 1``, twice as fast on 2 cores); TP=2 is the README command's and tests/test_packing.py's (the
    group loss at TP=1, TP=2 and TP=2xPP=2)."""
    proc, _ = run_quickstart(tmp_path / "qs", "--cross-tokenizer", "--nproc", "1", timeout=1200)
    assert "across tokenizers (1 processes, TP=1" in proc.stdout
    rows = [r for r in _lines(tmp_path / "qs" / "student" / "metrics.jsonl") if "loss" in r]
    # Real multi-token groups every step ("33" <-> "3" "3"), every sample aligned.
    assert all(r["cross_tokenizer/one_to_one_share"] < 1.0 for r in rows)
    assert all(r["cross_tokenizer/unaligned_samples"] == 0 for r in rows)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
