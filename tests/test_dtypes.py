"""Dtype names in one place (``megatron_opd.dtypes``), checked against the safetensors library's own headers."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from megatron_opd.dtypes import SAFETENSORS_DTYPES, TensorMeta, dtype_name, parse_dtype, safetensors_code


@pytest.mark.parametrize("dtype", sorted(set(SAFETENSORS_DTYPES.values()), key=str))
def test_safetensors_codes_are_the_librarys(dtype, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"t": torch.zeros(3, dtype=dtype)}, str(path))
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert safetensors_code(dtype) == header["t"]["dtype"]
    assert SAFETENSORS_DTYPES[header["t"]["dtype"]] == dtype


def test_names_and_records():
    assert parse_dtype("bf16") == parse_dtype("bfloat16") == parse_dtype(torch.bfloat16) == torch.bfloat16
    assert dtype_name(torch.bfloat16) == "bfloat16" and getattr(torch, dtype_name(torch.float16)) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of .*got 'fp8'"):
        parse_dtype("fp8")
    with pytest.raises(ValueError, match="no safetensors code"):
        safetensors_code(torch.complex64)
    assert TensorMeta("w", torch.bfloat16, (3, 5)).nbytes == 30
