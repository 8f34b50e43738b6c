import dataclasses

import pytest

from gpudl import models
from gpudl.config import Config, config_from_dict, load_config, recipe_names
from gpudl.errors import UserError
from gpudl.config.settings import parse_literal


def test_defaults_are_the_embedded_recipe_but_for_its_time_budget():
    """`gpudl train` without --config runs the gpt-tiny recipe; the Python defaults are that recipe without
    its time budget, so a script (and a test) gets the same run on any machine."""
    cfg = load_config()
    assert cfg.model.name == "gpt-tiny" and cfg.train.max_steps == 600 and cfg.train.precision == "auto"
    shipped = load_config("gpt-tiny")
    assert shipped.train.time_budget_s == 90 and cfg.train.time_budget_s == 0
    assert shipped.train == dataclasses.replace(cfg.train, time_budget_s=90)
    assert shipped.optim == cfg.optim and shipped.model == cfg.model


@pytest.mark.parametrize("raw, value", [("3", 3), ("1e-3", 1e-3), ("true", True), ("[0.9, 0.95]", [0.9, 0.95]),
                                        ('"x y"', "x y"), ("gpt2-124m", "gpt2-124m"), ("bf16-mixed", "bf16-mixed")])
def test_set_values_parse_like_toml(raw, value):
    assert parse_literal(raw) == value


def test_overrides_reach_their_section_with_types():
    cfg = load_config(None, ["train.max_steps=10", "optim.lr=1e-4", "optim.betas=[0.8, 0.9]", "train.compile=true",
                             "model.n_layer=2", "run.name=abc"])
    assert cfg.train.max_steps == 10 and cfg.optim.lr == 1e-4 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.train.compile is True and cfg.run.name == "abc"
    assert cfg.model.overrides == {"n_layer": 2}


def test_int_is_accepted_where_float_is_expected():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0


def test_unknown_key_names_the_nearest_valid_one():
    with pytest.raises(UserError, match=r"unknown setting 'train.max_step'.*did you mean \"max_steps\""):
        load_config(None, ["train.max_step=10"])
    with pytest.raises(UserError, match=r"unknown setting 'trian'.*did you mean \"train\""):
        load_config(None, ["trian.max_steps=10"])


def test_unknown_model_field_is_checked_by_the_model_family():
    cfg = load_config(None, ["model.n_layers=3"])
    with pytest.raises(UserError, match=r"model.n_layers.*did you mean \"n_layer\""):
        models.resolve(cfg.model.name, cfg.model.overrides)
    with pytest.raises(UserError, match="model.depth"):
        models.resolve("gpt-tiny", {"depth": 50})


@pytest.mark.parametrize("item, words", [
    ("train.batch_size=-4", r"train.batch_size must be >= 1, got -4"),
    ("train.batch_size=abc", r"train.batch_size must be int, got 'abc'"),
    ("train.max_steps=2.5", r"train.max_steps must be int"),
    ("train.precision=fp64", r"train.precision must be 'auto' \| 'fp32'"),
    ("data.val_fraction=0.9", r"data.val_fraction must be <= 0.5"),
    ("optim.lr=0", r"optim.lr must be > 0.0"),
    ("train.compile=maybe", r"train.compile must be bool \| 'auto'"),
])
def test_bad_values_name_key_value_and_what_is_allowed(item, words):
    with pytest.raises(UserError, match=words):
        load_config(None, [item])


def test_model_values_are_type_checked_too():
    with pytest.raises(UserError, match="model.n_layer must be >= 1, got 0"):
        models.resolve("gpt-tiny", {"n_layer": 0})
    with pytest.raises(UserError, match="d_model=100 must be divisible by model.n_head=3"):
        models.resolve("gpt-tiny", {"d_model": 100, "n_head": 3})


def test_set_syntax_errors_say_the_form():
    with pytest.raises(UserError, match="section.key=value"):
        load_config(None, ["max_steps=3"])
    with pytest.raises(UserError, match="section.key=value"):
        load_config(None, ["train.max_steps"])


def test_config_files(tmp_path):
    good = tmp_path / "a.toml"
    good.write_text('[train]\nmax_steps = 7\n[model]\nname = "resnet18"\ndepth = 34\n')
    cfg = load_config(good, ["train.batch_size=3"])
    assert cfg.train.max_steps == 7 and cfg.train.batch_size == 3 and cfg.model.overrides == {"depth": 34}
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 7\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(UserError, match=r"unknown recipe 'gpt2-12m'.*did you mean"):
        load_config("gpt2-12m")


def test_toml_round_trip_keeps_every_setting():
    cfg = load_config(None, ["train.max_steps=10", "model.n_layer=3", "optim.betas=[0.8, 0.9]", "run.name=x"])
    import tomllib

    again = config_from_dict(tomllib.loads(cfg.to_toml()))
    assert again == cfg


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_loads_and_resolves(name):
    cfg = load_config(name)
    spec = models.resolve(cfg.model.name, cfg.model.overrides)
    assert spec.name == cfg.model.name
    assert isinstance(cfg, Config)


def test_a_command_line_string_stays_the_text_typed():
    cfg = load_config(None, ["run.name=nan", "run.dir=2024", "data.path=inf"])
    assert (cfg.run.name, cfg.run.dir, cfg.data.path) == ("nan", "2024", "inf")
    with pytest.raises(UserError, match="train.max_steps must be int, got nan"):
        load_config(None, ["train.max_steps=nan"])
