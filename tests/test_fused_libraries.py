"""The start-up report of which fused-kernel library (TransformerEngine, NVIDIA apex, torch) runs each part."""

from __future__ import annotations

import logging
import sys

import pytest

from megatron_opd import fused_libraries
from megatron_opd.fused_libraries import APEX, LOCAL, SDPA, TE, TORCH, Libraries, fused_parts, log_fused_libraries


@pytest.fixture(autouse=True)
def fresh_report(monkeypatch):
    monkeypatch.setattr(fused_libraries, "_logged", False)


@pytest.mark.parametrize(
    ("te", "apex", "use_te", "attention", "expected"),
    [
        (True, True, None, "sdpa", {"layers": TE, "attention": TE, "optimizer": TE, "multi_tensor": TE}),
        # TE layers turned off: our SDPA attention runs
        (True, False, False, "sdpa", {"layers": TORCH, "attention": SDPA, "optimizer": TE, "multi_tensor": TE}),
        (False, True, None, "local", {"layers": TORCH, "attention": LOCAL, "optimizer": APEX, "multi_tensor": APEX}),
        (False, False, None, "sdpa", {"layers": TORCH, "attention": SDPA, "optimizer": TORCH, "multi_tensor": TORCH}),
    ],
)
def test_parts_follow_megatron_preference(te, apex, use_te, attention, expected):
    assert fused_parts(Libraries(transformer_engine=te, apex=apex), use_te, attention) == expected


def test_logged_once_per_process(caplog):
    def gpu_probe() -> Libraries:
        return Libraries(transformer_engine=True, apex=False)

    with caplog.at_level(logging.INFO, logger="megatron_opd.fused_libraries"):
        assert log_fused_libraries(None, probe=gpu_probe)["layers"] == TE
        assert log_fused_libraries(None, probe=gpu_probe)["optimizer"] == TE
    (record,) = caplog.records
    message = record.getMessage()
    assert "layers (linear, norms): TransformerEngine" in message and "core attention: TransformerEngine" in message
    assert "optimizer (Adam): TransformerEngine" in message and "(NVIDIA apex not available)" in message


def test_this_machine_matches_what_megatron_imported(caplog):
    """The real probe must agree with the implementations Megatron-Core actually picked at import."""
    from megatron.core import optimizer
    from megatron.core.optimizer import clip_grads

    def library(obj) -> str:
        module = getattr(obj, "__module__", "") or ""
        return TE if module.startswith("transformer_engine") else APEX if module.startswith("apex") else TORCH

    with caplog.at_level(logging.INFO, logger="megatron_opd.fused_libraries"):
        parts = log_fused_libraries()
    assert parts["optimizer"] == library(optimizer.Adam)
    assert parts["multi_tensor"] == library(clip_grads.multi_tensor_applier)
    if "transformer_engine" not in sys.modules:
        assert parts["layers"] == TORCH
    assert len(caplog.records) == 1


def test_the_unrelated_pypi_apex_is_not_nvidia_apex(tmp_path, monkeypatch):
    fake = tmp_path / "apex"
    fake.mkdir()
    (fake / "__init__.py").write_text("# PyPI's 'apex' is an unrelated web package without amp_C\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "apex", raising=False)
    assert not fused_libraries.nvidia_apex_available()
