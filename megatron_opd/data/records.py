"""Read prompt records from JSON-lines and Parquet files.

Records are plain dicts; which fields matter is the prompt encoder's business. Errors name the file (and
line), and the config key that listed it, so a bad path is fixed in one edit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class DataError(ValueError):
    """A data file is missing, empty or malformed, or a record lacks the fields the run needs."""


def _check_path(path: str | os.PathLike, key: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{key}: file {str(path)!r} does not exist; fix the path in {key}")
    if not p.is_file():
        raise DataError(f"{key}: {str(path)!r} is not a file; list .jsonl or .parquet files in {key}")
    if p.suffix.lower() not in JSON_SUFFIXES + PARQUET_SUFFIXES:
        raise DataError(
            f"{key}: {str(path)!r} has an unknown extension {p.suffix!r}; "
            f"use one of {', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)} (JSON lines or Parquet)"
        )
    return p


def _read_json_lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8-sig")  # drops the byte-order mark many Windows tools write
    # A .json file holding one array of objects is common enough to accept beside JSON lines.
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from err
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{path}: item {i} of the JSON array is a {type(row).__name__}, expected an object")
        return rows
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        records.append(_read_json_line(line, path, lineno))
    return records


def _read_json_line(line: str, path: Path, lineno: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{lineno}: malformed JSON line ({err.msg} at column {err.colno})") from err
    if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: a record must be a JSON object, got a {type(row).__name__}")
    return row


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from err
    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({err})") from err


def _as_list(paths: list[str] | str) -> list[str]:
    return [str(paths)] if isinstance(paths, (str, os.PathLike)) else list(paths)


def check_paths(paths: list[str] | str, key: str = "data.train_files") -> list[Path]:
    """``paths`` as files that exist with a known extension; a DataError naming ``key`` otherwise (nothing read)."""
    if not _as_list(paths):
        raise DataError(f"{key} is empty: give at least one .jsonl or .parquet file")
    return [_check_path(path, key) for path in _as_list(paths)]


def read_record_files(paths: list[str] | str, key: str = "data.train_files") -> list[tuple[str, list[dict[str, Any]]]]:
    """Each file's records, in file order, so callers can say which file a bad record came from.

    ``key`` is the config key that listed ``paths`` (``data.train_files`` / ``data.eval_files``); it appears in
    every error so the user knows what to edit.
    """
    out = []
    for path, p in zip(_as_list(paths), check_paths(paths, key)):
        records = _read_parquet(p) if p.suffix.lower() in PARQUET_SUFFIXES else _read_json_lines(p)
        if not records:
            raise DataError(f"{key}: {str(path)!r} holds no records; remove it from {key} or fill it")
        out.append((str(path), records))
    return out


def first_records(paths: list[str] | str, key: str = "data.train_files") -> list[tuple[str, dict[str, Any]]]:
    """Each file's first record (a start-up check's sample): JSON lines and Parquet are read no further."""
    out = []
    for path, p in zip(_as_list(paths), check_paths(paths, key)):
        if p.suffix.lower() in PARQUET_SUFFIXES:
            import pyarrow.parquet as pq

            try:
                batch = next(pq.ParquetFile(p).iter_batches(batch_size=1), None)
            except Exception as err:  # pyarrow raises several unrelated types for a bad file
                raise DataError(f"{path}: not a readable Parquet file ({err})") from err
            record = batch.to_pylist()[0] if batch is not None and batch.num_rows else None
        elif p.suffix.lower() == ".json":  # may be one array of objects: read whole
            record = next(iter(_read_json_lines(p)), None)
        else:
            with open(p, encoding="utf-8-sig") as f:
                line = next((line for line in f if line.strip()), None)
            record = None if line is None else _read_json_line(line, p, 1)
        if record is not None:
            out.append((str(path), record))
    return out


def read_records(paths: list[str] | str, key: str = "data.train_files") -> list[dict[str, Any]]:
    """All records of ``paths`` (``.jsonl``/``.json`` JSON lines, ``.parquet``), concatenated in order."""
    return [record for _, records in read_record_files(paths, key) for record in records]
