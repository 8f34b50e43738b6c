"""Loading a run's config: a TOML recipe (a file, a shipped name, or the embedded default) plus
`--set section.key=value` overrides, checked strictly (unknown keys, types, limits).
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path, PurePath

from ..errors import UserError, unknown_name
from .settings import CommandLineValue, check_value, from_dict, set_dotted
from .tree import Config, ModelConfig


def recipe_names() -> list[str]:
    """Names of the recipes that ship with gpudl (`gpudl train --config NAME`)."""
    return sorted(p.name[:-5] for p in (resources.files("gpudl") / "configs").iterdir() if p.name.endswith(".toml"))


def _recipe_path(source: str | Path) -> Path:
    path = Path(source)
    if path.is_file():
        return path
    if str(source) in recipe_names():
        return Path(str(resources.files("gpudl") / "configs" / f"{source}.toml"))
    if path.suffix or "/" in str(source):
        raise UserError(f"config file {str(source)!r} not found: pass an existing .toml file "
                        f"or a recipe name ({', '.join(recipe_names())})")
    raise unknown_name("recipe", str(source), recipe_names())


def _read_toml(source: str | Path | None) -> dict:
    if source is None:
        return {}
    path = _recipe_path(source)
    try:
        return tomllib.loads(path.read_text(encoding="utf8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {str(path)!r} is not valid TOML ({e}): fix the file") from e


def config_from_dict(data: dict) -> Config:
    """Build a Config from a dict shaped like the TOML file; `[model]` keeps extra keys as overrides."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise UserError(f"[model] must be a table of settings, got {model!r}")
    cfg = from_dict(Config, data, "")
    name = model.pop("name", ModelConfig().name)
    if isinstance(name, CommandLineValue):  # as any string setting reads it: `"gpt-tiny"` or gpt-tiny
        name = name.parsed if isinstance(name.parsed, str) else str(name)
    if not isinstance(name, str):
        raise UserError(f"model.name must be a string, got {name!r}")
    model.pop("overrides", None)
    init_from = model.pop("init_from", None)
    if init_from is not None:  # a path: a --set value is the text as typed
        init_from = check_value("model.init_from", str, str(init_from) if isinstance(init_from, CommandLineValue)
                                else init_from)
    # The model family types its own fields (models.resolve); keep plain TOML values here.
    overrides = {k: v.parsed if isinstance(v, CommandLineValue) else v for k, v in model.items()}
    cfg.model = ModelConfig(name=name, init_from=init_from, overrides=overrides)
    _check_run_name(cfg.run.name)
    return cfg


def _check_run_name(name: str | None) -> None:
    """A run's folder is `run.dir/run.name`: the name must not lead out of `run.dir`."""
    if name is not None and (PurePath(name).name != name or name in ("", ".", "..") or "\\" in name):
        raise UserError(f"run.name must be a folder name inside run.dir, got {name!r}: choose a name without "
                        f"'/', '\\' or '..' (set run.dir to write elsewhere)")


def load_config(source: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a recipe (path or shipped name; None: the embedded default) and apply `key=value` overrides."""
    data = _read_toml(source)
    if isinstance(data.get("fit"), dict):  # written by gpudl.fit (run/fit_resume.py): no recipe rebuilds its model
        raise UserError(f"{source} is the config of a gpudl.fit run, whose model is the user's own, not a recipe: "
                        f"continue it with gpudl.fit(model, train_data, resume=<its folder>)")
    return _with_overrides(data, overrides)


def with_sets(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """`cfg` with `key=value` overrides applied and checked, as `--set` applies them."""
    return _with_overrides(tomllib.loads(cfg.to_toml()), overrides)


def _with_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> Config:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or "." not in key:
            raise UserError(f"--set expects section.key=value, got {item!r}: e.g. --set train.max_steps=100")
        set_dotted(data, key.strip(), CommandLineValue(raw.strip()))
    return config_from_dict(data)
