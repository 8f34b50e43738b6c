"""docs/settings.md is what the generator makes of the config tree now, and what it says is what the loader
enforces: every documented default loads, every listed value loads, and the documented limits are the ones
that refuse a value."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from gpudl import models
from gpudl.config import Config, load_config
from gpudl.config.reference import REGENERATE, settings_markdown
from gpudl.config.settings import field_types, toml_key
from gpudl.errors import UserError

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "settings.md"


def script():
    spec = importlib.util.spec_from_file_location("settings_reference", ROOT / "scripts" / "settings_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows() -> list[tuple[str, str, str, str, str]]:
    """(family heading or "", key, type, default, allowed) of every row of the page's tables."""
    found, family = [], ""
    for line in PAGE.read_text(encoding="utf8").splitlines():
        if line.startswith("#"):
            family = line.split(":")[0].removeprefix("### ") if line.startswith("### ") else ""
        elif line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            found.append((family, cells[0].strip("`"), cells[1], cells[2], cells[3]))
    return found


def test_the_page_is_what_the_generator_makes_now():
    assert PAGE.read_text(encoding="utf8") == script().reference(), \
        f"docs/settings.md is out of date with the config tree: run `{REGENERATE}` to write it again"


def test_every_setting_the_loader_takes_has_a_row():
    keys = {key for _, key, *_ in rows()}
    for section, cls in field_types(Config).items():
        for f in dataclasses.fields(cls):
            if f.name != "overrides":  # [model]'s preset fields: the family tables below
                assert f"{section}.{toml_key(f)}" in keys
    for cls, _ in models.FAMILIES.values():
        assert {f"model.{f.name}" for f in dataclasses.fields(cls)} <= keys
    assert "checkpoint.async" in keys and "model.n_layer" in keys and "model.depth" in keys


def test_rows_read_as_a_person_would_write_them():
    """An independent reference: a few rows spelled out by hand."""
    text = PAGE.read_text(encoding="utf8")
    for row in ['| `train.max_steps` | integer | `600` | an integer >= 1 |',
                '| `data.num_workers` | integer or string | `"auto"` | an integer >= 0, `"auto"` |',
                '| `checkpoint.async` | boolean or string | `"auto"` | `true`, `false`, `"auto"` |',
                '| `run.name` | string | unset | any string, unset (leave the key out) |',
                '| `optim.betas` | array of 2 numbers | `[0.9, 0.95]` | 2 finite numbers |',
                '| `optim.min_lr_ratio` | number | `0.1` | a number >= 0 and <= 1 |',
                '| `model.n_layer` | integer | the preset\'s | an integer >= 1 |',
                'auto \\| cpu \\| cuda']:  # a doc's pipes do not split its table cell
        assert row in text, row


def recipe_for(family: str) -> str:
    return "resnet18" if family.startswith("resnet") else "gpt-tiny"


# Settings checked against each other as well as alone: a value at a limit needs its partner to fit it.
PARTNERS = {"model.d_model": ["model.n_head=1"]}


def loads(family: str, key: str, value: str) -> None:
    cfg = load_config(recipe_for(family), [*PARTNERS.get(key, []), f"{key}={value}"])
    models.from_config(cfg)  # [model]'s own fields are checked by the family


def test_every_documented_default_and_listed_value_loads():
    checked = 0
    for family, key, _, default, allowed in rows():
        values = re.findall(r"`([^`]+)`", allowed)
        if default.startswith("`"):
            values.append(default.strip("`"))
        for value in values:
            loads(family, key, value)
            checked += 1
    assert checked > 80


def test_the_documented_limits_are_the_enforced_ones():
    """Each bound a row states: the value at it (or just past a strict one) loads, the value just outside is
    refused with an error naming the key."""
    checked = 0
    for family, key, _, _, allowed in rows():
        first = allowed.split(", ")[0]  # "an integer >= 1", "a number >= 0 and <= 1", or no numbers at all
        if not first.startswith(("an integer ", "a number ")):
            continue
        integer = first.startswith("an integer")
        for op, bound in re.findall(r"(>=|>|<=) (-?[\d.]+)", first):
            at, step = (int(bound), 1) if integer else (float(bound), 0.01)
            inside = {">=": at, ">": at + step, "<=": at}[op]
            outside = {">=": at - step, ">": at, "<=": at + step}[op]
            loads(family, key, str(inside))
            with pytest.raises(UserError, match=re.escape(key)):
                loads(family, key, str(outside))
            checked += 1
    assert checked > 40


def test_the_generator_follows_the_tree():
    """Not a copy of the page: a family passed in gets its table, with defaults shared by its presets."""
    @dataclasses.dataclass(kw_only=True)
    class Toy:
        width: int = dataclasses.field(default=8, metadata={"doc": "how wide", "ge": 2})
        depth: int = dataclasses.field(default=1, metadata={"doc": "how deep"})

    text = settings_markdown({"toy": (Toy, {"toy-a": Toy(width=4), "toy-b": Toy(width=6)})})
    assert "### toy models: `toy-a`, `toy-b`" in text
    assert "| `model.width` | integer | the preset's | an integer >= 2 | how wide |" in text
    assert "| `model.depth` | integer | `1` | any integer | how deep |" in text
