"""The job's host names: ``--nodes a,b,c``, else Slurm's node list (``scontrol show hostnames``, or our parser
of the same syntax where ``scontrol`` is missing, e.g. inside a container)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

_BRACKET = re.compile(r"\[([^\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"node list {text!r}: unbalanced ']'")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_range(item: str, where: str) -> list[str]:
    if "-" not in item:
        return [item]
    low, high = item.split("-", 1)
    if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
        raise ValueError(f"node list {where!r}: bad range {item!r}")
    width = len(low)  # Slurm keeps the zero padding of the lower bound: gpu[08-10] -> gpu08, gpu09, gpu10
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _expand_name(name: str) -> list[str]:
    match = _BRACKET.search(name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values = [v for item in match.group(1).split(",") for v in _expand_range(item.strip(), name)]
    return [head + value + rest for value in values for rest in _expand_name(tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's host-list syntax (``gpu[01-03,07],login1``, ``r[1-2]-n[1-2]``) -> host names, in order."""
    return [host for part in _split_top_level(nodelist) for host in _expand_name(part)]


def slurm_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` where it exists (Slurm's own answer), else :func:`expand_nodelist`."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()
    return expand_nodelist(nodelist)


def job_hosts(nodes: str | None, environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The job's hosts: ``nodes`` (comma-separated, host-list syntax allowed), else ``SLURM_JOB_NODELIST``;
    None when neither is given."""
    if nodes:
        return expand_nodelist(nodes)
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return slurm_hostnames(nodelist) if nodelist else None
