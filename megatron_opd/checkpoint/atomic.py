"""Write a checkpoint folder so that readers only ever see a complete one.

A conversion writes into a hidden staging folder next to the destination and renames it into place
when every file is written. A crash or an error leaves the destination as it was (absent, or the
previous checkpoint when ``--force`` was given) and the staging folder is removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The destination already holds something and ``force`` was not given."""


def check_destination(out_dir: str | os.PathLike, force: bool, *, sources: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Refuse to overwrite without ``force``, and never let the output replace one of its own inputs."""
    out = Path(out_dir).resolve()
    for src in sources:
        src_path = Path(src).resolve()
        if out == src_path or out in src_path.parents:
            raise ValueError(f"output {out} would replace the input {src_path}; choose another --out")
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputExistsError(f"{out} already exists; pass --force to replace it")
        if not out.is_dir():
            raise OutputExistsError(f"{out} exists and is not a folder; remove it yourself")
    return out


def make_staging_dir(out_dir: str | os.PathLike) -> Path:
    """A fresh hidden folder beside ``out_dir`` (same file system, so the final rename is atomic)."""
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def fsync_paths(paths: Iterable[Path]) -> None:
    """Flush files (or folders) to stable storage, so a rename never publishes data still in the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit_staging_dir(staging: Path, out_dir: str | os.PathLike, force: bool) -> Path:
    """Move a complete staging folder to ``out_dir``, replacing an existing one only with ``force``.

    Everything under ``staging`` is flushed first (files that other ranks already flushed cost
    nothing); the parent folder is flushed after the rename.
    """
    out = Path(out_dir).resolve()
    fsync_paths(p for p in sorted(staging.rglob("*"), reverse=True) if p.is_file() or p.is_dir())
    fsync_paths([staging])
    if not out.exists():
        os.replace(staging, out)
        fsync_paths([out.parent])
        return out
    if not force:
        raise OutputExistsError(f"{out} appeared while converting; pass --force to replace it")
    # A folder cannot be renamed over a non-empty one: move the old one aside first.
    old = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(old, out)
        raise
    fsync_paths([out.parent])
    shutil.rmtree(old, ignore_errors=True)
    return out


def discard_staging_dir(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
