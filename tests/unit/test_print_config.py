"""`gpudl train --print-config`: the effective settings as TOML, which load back to the very config the run
would have used, and nothing trained or written."""

from __future__ import annotations

import tomllib

import pytest

from gpudl.cli import main
from gpudl.config import load_config

SETS = ["--set", "train.max_steps=77", "--set", "model.width=32", "--set", "optim.betas=[0.8,0.9]",
        "--set", "checkpoint.async=false", "--set", "run.name=mine", "--set", "data.image_size=64"]


def printed(capsys, monkeypatch, tmp_path, *argv: str) -> str:
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--print-config", *argv])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    assert list(tmp_path.iterdir()) == [], "--print-config must not train or write anything"
    return out


def test_the_printed_toml_loads_back_to_the_same_config(capsys, monkeypatch, tmp_path):
    out = printed(capsys, monkeypatch, tmp_path, "--config", "resnet50", *SETS, "--precision", "fp32")
    (tmp_path / "printed.toml").write_text(out)
    expected = load_config("resnet50", [s for s in SETS if s != "--set"] + ["train.precision=fp32"])
    assert load_config(tmp_path / "printed.toml") == expected
    assert expected != load_config("resnet50")  # not vacuous: the sets changed something


def test_each_set_shows_in_its_section(capsys, monkeypatch, tmp_path):
    data = tomllib.loads(printed(capsys, monkeypatch, tmp_path, "--config", "resnet50", *SETS))
    assert data["train"]["max_steps"] == 77 and data["optim"]["betas"] == [0.8, 0.9]
    assert data["checkpoint"]["async"] is False and data["run"]["name"] == "mine"
    assert data["model"] == {"name": "resnet50", "width": 32}  # a model field beside the preset's name
    assert data["train"]["batch_size"] == load_config("resnet50").train.batch_size  # the recipe's own, kept


def test_the_default_recipe_and_a_resumed_run(capsys, monkeypatch, tmp_path):
    default = printed(capsys, monkeypatch, tmp_path)
    assert default == load_config("gpt-tiny").to_toml()
    run = tmp_path.parent / f"{tmp_path.name}-run"  # a run folder: its config.toml, with the --set on top
    run.mkdir()
    (run / "config.toml").write_text(load_config("gpt-tiny", ["run.name=old", "optim.lr=0.01"]).to_toml())
    data = tomllib.loads(printed(capsys, monkeypatch, tmp_path, "--resume", str(run), "--set", "train.max_steps=900"))
    assert (data["run"]["name"], data["optim"]["lr"], data["train"]["max_steps"]) == ("old", 0.01, 900)


def test_it_launches_nothing(capsys, monkeypatch, tmp_path):
    data = tomllib.loads(printed(capsys, monkeypatch, tmp_path, "--nproc-per-node", "2", "--set", "parallel.tp=2"))
    assert data["parallel"]["tp"] == 2


@pytest.mark.parametrize("argv, words", [(["--set", "train.max_step=3"], 'did you mean "max_steps"'),
                                         (["--set", "model.n_layers=3"], 'did you mean "n_layer"')])
def test_a_bad_setting_is_refused_before_anything_is_printed(capsys, monkeypatch, tmp_path, argv, words):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--print-config", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1
