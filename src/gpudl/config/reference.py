"""The settings reference, in Markdown, generated from the config tree: for each section every key with its
type, default, allowed values and doc, read from the dataclasses' `option(...)` fields (tree.py).

docs/settings.md is this function's output (`python scripts/settings_reference.py` writes it; a test fails
when the two differ). The model families' own fields ([model] beside `name`) are passed in, since the
models sit above config: `settings_markdown({"gpt": (GPTConfig, ["gpt-tiny", ...]), ...})`.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .settings import _toml_value, field_types, toml_key
from .tree import Config

REGENERATE = "python scripts/settings_reference.py"

_INTRO = f"""\
# Settings: every key, its type, default and limits

Generated from the config tree (`src/gpudl/config/tree.py`) by `{REGENERATE}`:
edit the tree, not this page (`tests/unit/test_settings_reference.py` fails when the two differ).

A setting is a key of a section: in a recipe's TOML (`[train]` then `max_steps = 2000`) or on the
command line (`--set train.max_steps=2000`, read as TOML reads a value: `--set optim.betas=[0.9,0.99]`).
`gpudl train --print-config` prints the settings a run would use, as TOML, and exits without training.
An unknown key names the nearest valid one, and a value of the wrong type or outside its limits names
the key, the value and what is allowed: the run stops with one line and exit status 2. A setting
left `"auto"` is decided when the run starts; for precision, compile, the loader's workers and
checkpoint saves the start block says what was chosen and why ([console.md](console.md)).
"""

_TYPE_WORDS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _members(tp: Any) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _type_words(tp: Any) -> str:
    """The TOML types a field takes: "integer or string"."""
    words: list[str] = []
    for member in _members(tp):
        if member is type(None):
            continue
        if typing.get_origin(member) is Literal:
            word = " or ".join(dict.fromkeys(_TYPE_WORDS[type(a)] for a in typing.get_args(member)))
        elif typing.get_origin(member) is tuple:
            word = f"array of {len(typing.get_args(member))} numbers"
        else:
            word = _TYPE_WORDS[member]
        if word not in words:
            words.append(word)
    return " or ".join(words)


def _limits(meta: Mapping) -> str:
    return " and ".join(f"{words} {meta[name]:g}" for name, words in (("ge", ">="), ("gt", ">"), ("le", "<="))
                        if name in meta)


def _allowed(tp: Any, meta: Mapping) -> str:
    """What a field accepts, TOML-spelled: `"auto"`, `true`, `false`; integers >= 1; unset."""
    parts: list[str] = []
    for member in _members(tp):
        if member is type(None):
            parts.append("unset (leave the key out)")
        elif typing.get_origin(member) is Literal:
            parts += [f"`{_toml_value(a)}`" for a in typing.get_args(member)]
        elif member is bool:
            parts += ["`true`", "`false`"]
        elif member in (int, float):
            noun = "an integer" if member is int else "a number"
            parts.append(f"{noun} {_limits(meta)}" if _limits(meta) else f"any {_TYPE_WORDS[member]}")
        elif member is str:
            parts.append("any string")
        elif typing.get_origin(member) is tuple:
            parts.append(f"{len(typing.get_args(member))} finite numbers")
    return ", ".join(parts)


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return "—"
    return "unset" if f.default is None else f"`{_toml_value(f.default)}`"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped, angle brackets not read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _doc(cls: type) -> str:
    """The section's docstring, not the one dataclass writes for a class without one."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc)


def _table(cls: type, prefix: str, defaults: Mapping[str, str] | None = None, skip: Sequence[str] = ()) -> list[str]:
    hints = field_types(cls)
    rows = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, meta = hints[f.name], f.metadata
        default = (defaults or {}).get(f.name, _default(f))
        allowed = _allowed(tp, meta).replace("|", "\\|")
        rows.append(f"| `{prefix}.{toml_key(f)}` | {_type_words(tp)} | {default} | {allowed} | "
                    f"{_cell(meta.get('doc', ''))} |")
    return rows


def _preset_defaults(cls: type, presets: Mapping[str, Any]) -> dict[str, str]:
    """Each field's default where every preset of the family agrees on it, else "the preset's"."""
    out = {}
    for f in dataclasses.fields(cls):
        values = {_toml_value(getattr(p, f.name)) for p in presets.values()}
        out[f.name] = f"`{values.pop()}`" if len(values) == 1 else "the preset's"
    return out


def _model_section(families: Mapping[str, tuple[type, Mapping[str, Any]]]) -> list[str]:
    lines = _table(field_types(Config)["model"], "model", skip=("overrides",))
    lines += ["", "Beside `name`, `[model]` takes the fields of the preset's family, each checked as the "
              "settings above are (`gpudl info --models` shows each preset's values)."]
    for family, (cls, presets) in families.items():
        lines += ["", f"### {family} models: {', '.join(f'`{n}`' for n in presets)}", ""]
        lines += _table(cls, "model", _preset_defaults(cls, presets))
    return lines


def settings_markdown(families: Mapping[str, tuple[type, Mapping[str, Any]]] | None = None) -> str:
    """docs/settings.md: each section of `Config` as a table, and under [model] each family's fields.

    `families`: {family: (its config dataclass, {preset name: preset config})}, as models.FAMILIES and
    models.PRESETS hold them."""
    lines = [_INTRO.rstrip("\n")]
    for section, cls in field_types(Config).items():
        lines += ["", f"## [{section}]", ""]
        if _doc(cls):
            lines += [_doc(cls), ""]
        lines += _model_section(families or {}) if section == "model" else _table(cls, section)
    return "\n".join(lines) + "\n"
