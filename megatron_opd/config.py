"""Typed configs: dataclasses filled from YAML, then from ``key.sub=value`` command-line overrides.

Every knob is a dataclass field with a default and a docstring under it. Values are parsed as YAML
(``true``, ``3``, ``1e-5``, ``[1, 2]``, ``null``) and checked against the field's type; an unknown
key is an error that lists the valid ones, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override names an unknown field or gives a value of the wrong type."""


_BOOL_WORDS = {True: ("on", "yes", "true", "y"), False: ("off", "no", "false", "n")}
"""The words YAML 1.1 turns into booleans: a choice spelled so (``loss.fused_output: off``) is read back as its word."""


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: cannot parse {value!r}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {hint.__name__}, got {value!r}")
        return _build(hint, value, where)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        item = map_value_type(hint)
        if item is None:
            return dict(value)
        return {str(k): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no/true/false as booleans
            spelled = [c for c in typing.get_args(hint) if str(c).lower() in _BOOL_WORDS[value]]
            value = spelled[0] if len(spelled) == 1 else value
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where}: must be one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def map_value_type(hint: Any) -> Any:
    """The value type of a typed map ``dict[str, X]`` (``teachers.NAME.*``), or None for an untyped dict."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is not dict or len(args) != 2 or args[1] is Any:
        return None
    return args[1]


def _build(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ConfigError(f"{where or cls.__name__}: {err}") from err


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[keys[-1]] = value


def to_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a config (for logging and saving next to checkpoints)."""
    return dataclasses.asdict(config)


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from defaults, then the YAML file at ``path``, then ``key.sub=value`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        tree = loaded
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip().lstrip("-"), yaml.safe_load(raw) if raw else "")
    # Merge over the defaults so a file may set only some fields of a section.
    merged = _merge(to_dict(cls()), tree)
    return _build(cls, merged)


def comma_list(value: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: a config field that lists several values (replicas of an address)."""
    return [item.strip() for item in value.split(",") if item.strip()]


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source; empty when unavailable)."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # a subclass's docs win
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError):
            continue
        docs.update(_class_field_docs(tree.body[0].body))  # type: ignore[attr-defined]
    return docs


def _class_field_docs(body: list) -> dict[str, str]:
    import ast

    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per leaf key of a config dataclass: ``key = default  doc`` (what ``--help`` prints)."""
    lines = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    defaults = cls() if not prefix else None  # only the root is instantiated; sections come from field defaults
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            lines += describe(hint, prefix=f"{key}.")
            continue
        item = map_value_type(hint)
        if dataclasses.is_dataclass(item):  # a typed map: its entries' keys, under a placeholder name
            lines.append(f"  {key} = {{}}\n      {docs.get(f.name, '')}")
            lines += describe(item, prefix=f"{key}.<NAME>.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = getattr(defaults, f.name, None)
        lines.append(f"  {key} = {default!r}\n      {docs.get(f.name, '')}")
    return lines


def parse_args(cls: type[T], argv: Sequence[str] | None = None, description: str | None = None) -> T:
    """``script.py [--config FILE] [key.sub=value ...]``: the command line of every entry point."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        description=description or cls.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides are dotted field names with YAML values, e.g. parallel.tensor_model_parallel_size=2\n\n"
        "Config keys (key = default, then what it does):\n" + "\n".join(describe(cls)),
    )
    parser.add_argument("--config", type=str, default=None, help="YAML file with values for the config fields")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides applied after --config")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return load_config(cls, args.config, args.overrides)
