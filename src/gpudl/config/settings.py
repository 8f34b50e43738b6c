"""Strict, typed loading of dataclass configs from plain dicts (TOML) and `key=value` strings.

Every component owns a small dataclass whose fields are declared with `option(...)`: a default,
a one-line doc and optional limits. `from_dict` builds one from a dict and rejects, with a
one-line `UserError`, anything a person could get wrong: an unknown key (with the nearest valid
name), a value of the wrong type, a value out of range.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from typing import Any, Literal

from ..errors import UserError, did_you_mean


def option(default: Any, doc: str, key: str | None = None, **limits: Any) -> Any:
    """A config field: `default`, a one-line `doc`, and limits among ge, gt, le, choices.

    `key`: its name in TOML and `--set` where that name cannot be a Python name (`async`, a keyword).
    """
    return dataclasses.field(default=default, metadata={"doc": doc, **limits, **({"key": key} if key else {})})


def toml_key(f: dataclasses.Field) -> str:
    """A field's name in TOML and `--set`: its own, unless `option(key=...)` gave another."""
    return f.metadata.get("key", f.name)


def parse_literal(raw: str) -> Any:
    """Read a `--set` value as TOML would (`3`, `1e-3`, `true`, `[0.9, 0.95]`, `"x"`); else the bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


class CommandLineValue(str):
    """The text of a `--set` value. A field that takes a string gets the text as typed (so
    `run.name=nan` is the name "nan"); any other field gets its TOML reading (`.parsed`)."""

    @property
    def parsed(self) -> Any:
        return parse_literal(str(self))


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any) -> Any:
    """Return `value` as type `tp`, or raise ValueError. Accepts what TOML and `--set` produce."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(tp):
            try:
                return _coerce(member, value)
            except ValueError:
                continue
        raise ValueError
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ValueError
    if tp is type(None):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        raise ValueError
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if origin is tuple:
        items = typing.get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(items):
            return tuple(_coerce(t, v) for t, v in zip(items, value))
        raise ValueError
    raise TypeError(f"unsupported config type {tp!r}")  # an internal mistake, not the user's


def _check_limits(key: str, value: Any, meta: dict) -> None:
    if isinstance(value, tuple):
        if not all(math.isfinite(v) for v in value if isinstance(v, float)):
            raise UserError(f"{key} must hold finite numbers, got {list(value)!r}")
        return
    if value is None or isinstance(value, (bool, str)):
        return
    if not math.isfinite(value):  # inf passes every bound, and nan fails none: neither is a setting
        raise UserError(f"{key} must be a finite number, got {value!r}: set --set {key}=<a number>")
    for name, ok, words in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if name in meta and not ok(value, meta[name]):
            raise UserError(f"{key} must be {words} {meta[name]}, got {value!r}: set --set {key}=<a value {words} {meta[name]}>")


def check_value(key: str, tp: Any, value: Any, meta: dict | None = None) -> Any:
    """Coerce `value` to `tp` and check its limits, or raise a UserError that names the key."""
    typed = value.parsed if isinstance(value, CommandLineValue) else value
    try:
        out = _coerce(tp, typed)
    except ValueError:
        try:  # a command-line value that is not of the field's type may still be the string it wants
            out = _coerce(tp, str(value)) if isinstance(value, CommandLineValue) else None
        except ValueError:
            out = None
        if out is None:
            raise UserError(f"{key} must be {_type_name(tp)}, got {typed!r}") from None
    _check_limits(key, out, meta or {})
    return out


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: dict, prefix: str) -> Any:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields."""
    if not isinstance(data, dict):
        raise UserError(f"[{prefix}] must be a table of settings, got {data!r}")
    hints = field_types(cls)
    fields = {toml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise UserError(f"unknown setting {where!r}{did_you_mean(key, fields)}; [{prefix}] has: {', '.join(fields)}")
        name = fields[key].name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, where)
        else:
            kwargs[name] = check_value(where, tp, value, dict(fields[key].metadata))
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    """A dataclass tree as plain TOML-ready data (tuples become lists, None is dropped)."""
    out = {}
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), toml_key(f)
        if dataclasses.is_dataclass(value):
            out[key] = to_dict(value)
        elif isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if v is not None}
        elif value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for dotted == "a.b", creating tables on the way."""
    *tables, last = dotted.split(".")
    node = data
    for t in tables:
        node = node.setdefault(t, {})
        if not isinstance(node, dict):
            raise UserError(f"cannot set {dotted!r}: {t!r} is a value, not a table")
    node[last] = value


def dump_toml(data: dict, table: str = "") -> str:
    """A minimal TOML writer for config trees (tables of scalars, lists and sub-tables)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = [f"[{table}]"] if table and scalars else []
    lines += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    text = "\n".join(lines) + ("\n" if lines else "")
    for k, v in tables.items():
        sub = dump_toml(v, f"{table}.{k}" if table else k)
        text += ("\n" if text else "") + sub
    return text


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
