"""The gpudl command: smoke runs in real subprocesses, bad input through the same main()."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, run_cli
from gpudl.checkpoint import complete_checkpoints
from gpudl.cli import main

SETS = [a for item in TINY for a in ("--set", item)]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    out = run_cli("train", *SETS, "--set", "run.name=r1", "--set", f"run.dir={root}/runs", cwd=root)
    assert out.returncode == 0, out.stderr
    return root, root / "runs" / "r1", out.stdout


def test_train_prints_the_device_first_and_leaves_a_complete_run_folder(trained_run):
    _, run, stdout = trained_run
    assert stdout.splitlines()[0].startswith("Using device: cpu")
    for name in ("config.toml", "metrics.jsonl", "metrics.csv", "summary.json", "sample.txt", "model.safetensors"):
        assert (run / name).is_file(), name
    assert (run / "loss.png").is_file() or (run / "loss.svg").is_file()
    assert complete_checkpoints(run / "checkpoints")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert header.startswith("step,loss,lr")


def test_generate_evaluate_export(trained_run):
    root, run, _ = trained_run
    out = run_cli("generate", str(run), "--prompt", "import ", "--tokens", "20", cwd=root)
    assert out.returncode == 0 and out.stdout.startswith("import ")
    out = run_cli("evaluate", "--json", "--batches", "2", cwd=root)  # the newest run under ./runs
    result = json.loads(out.stdout)
    assert result["step"] == 6 and result["bits_per_byte"] == pytest.approx(result["loss"] / 0.6931471805599453)
    out = run_cli("export", str(run), "--out", str(root / "w.safetensors"), cwd=root)
    assert out.returncode == 0 and (root / "w.safetensors").stat().st_size > 10_000


def test_info_json_and_tree():
    out = run_cli("info", "--json", "--no-probe", "--device", "cpu")  # the CPU's tree, beside any accelerator
    data = json.loads(out.stdout)
    assert data["present"][-1] == "cpu" and data["devices"][0]["compute_units"] >= 1
    out = run_cli("info", "--no-probe", "--device", "cpu")
    assert out.stdout.startswith("Using device:") and "cores" in out.stdout


def error_of(capsys, *argv):
    """Run gpudl in-process; return (exit status, stderr) and check it is one line with no traceback."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


@pytest.mark.parametrize("argv, words", [
    (["--config", "missing.toml"], "not found"),
    (["--set", "train.max_step=3"], 'did you mean "max_steps"'),
    (["--set", "train.batch_size=abc"], "train.batch_size must be int, got 'abc'"),
    (["--set", "train.batch_size=-4"], "train.batch_size must be >= 1, got -4"),
    (["--set", "data.path=/no/such/place"], "does not exist"),
    (["--device", "cuda"], "not present on this machine; present: cpu"),
    (["--precision", "fp64"], "train.precision must be"),
    (["--set", "model.name=gpt5"], "unknown model 'gpt5'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, no_accelerator, argv, words):
    monkeypatch.chdir(tmp_path)  # no_accelerator: "--device cuda" is absent on a GPU machine too
    code, err = error_of(capsys, "train", *argv)
    assert code == 2 and words in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_malformed_config_file_and_empty_data_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text("[train\n")
    assert error_of(capsys, "train", "--config", "bad.toml")[0] == 2
    (tmp_path / "empty").mkdir()
    code, err = error_of(capsys, "train", "--set", "data.path=empty")
    assert code == 2 and "holds no files" in err


def test_resume_refusals_leave_the_run_untouched(capsys, trained_run, tmp_path):
    _, run, _ = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    code, err = error_of(capsys, "train", "--resume", str(copy), "--set", "model.n_layer=3",
                         "--set", "train.max_steps=8")
    assert code == 2 and "holds another model" in err
    shard = next(complete_checkpoints(copy / "checkpoints")[-1].glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    before[shard] = shard.read_bytes()
    code, err = error_of(capsys, "train", "--resume", str(copy), "--set", "train.max_steps=8")
    assert code == 2 and "is damaged" in err
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    code, err = error_of(capsys, "train", "--resume", str(copy), "--config", "gpt-tiny")
    assert code == 2 and "drop --config" in err


def test_generate_needs_a_gpt_run(capsys, tmp_path):
    code, err = error_of(capsys, "generate", str(tmp_path))
    assert code == 2 and "not a gpudl run folder" in err


def help_of(capsys, monkeypatch, *argv: str) -> str:
    """`gpudl ARGV --help` as printed, its whitespace collapsed; wide enough that argparse wraps no name."""
    monkeypatch.setenv("COLUMNS", "500")
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def option_help(text: str, option: str) -> str:
    """The help of one option in a collapsed help text: from the option to the next one."""
    return text.split(f" {option} ", 1)[1].split(" --", 1)[0]


def test_generate_help_says_tokens_and_that_zero_temperature_is_greedy(capsys, monkeypatch):
    text = help_of(capsys, monkeypatch, "generate")
    assert option_help(text, "--tokens").startswith("TOKENS tokens to generate") and "bytes to generate" not in text
    assert "0: greedy" in option_help(text, "--temperature")


def test_serve_help_says_a_safetensors_file_is_served_too(capsys, monkeypatch):
    assert ".safetensors file" in option_help(help_of(capsys, monkeypatch, "serve"), "model")


def test_plan_help_lists_every_target_gpu_the_planner_knows(capsys, monkeypatch):
    from gpudl.device.specs import TARGETS

    listed = option_help(help_of(capsys, monkeypatch, "plan"), "--target").split(": ", 1)[1].split(", ")
    assert len(TARGETS) >= 10 and listed == list(TARGETS)


def test_generate_at_temperature_zero_is_the_argmax_of_each_step(capsys, trained_run):
    from gpudl.run.trained import load_trained

    _, run, _ = trained_run
    model = load_trained(run, "cpu").model
    ids = list(b"import ")
    with torch.no_grad():  # greedy by hand: the likeliest of the 256 byte ids, one step at a time
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-model.cfg.block_size:]]))[0, -1, :256].argmax()))
    for seed in ("0", "7"):  # greedy draws nothing: the seed changes nothing
        assert main(["generate", str(run), "--device", "cpu", "--prompt", "import ", "--tokens", "12",
                     "--temperature", "0", "--seed", seed]) == 0
        assert capsys.readouterr().out == bytes(ids).decode("utf8", errors="replace") + "\n"
    code, err = error_of(capsys, "generate", str(run), "--temperature", "-1")
    assert code == 2 and "--temperature >= 0 (0: greedy)" in err


def test_sklearn_digits_without_scikit_learn_is_one_line_with_the_pip_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as where it is not installed: importing it fails
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    code, err = error_of(capsys, "train", "--config", "resnet18", "--device", "cpu", "--set", "data.path=sklearn:digits")
    assert code == 2 and "scikit-learn is not installed: pip install scikit-learn" in err


def fit_run(folder: Path) -> Path:
    """A real run folder of gpudl.fit: a user's own module, which no recipe rebuilds."""
    import gpudl

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    gpudl.fit(torch.nn.Linear(4, 2), (x, (x[:, 0] > 0).long()), torch.nn.functional.cross_entropy, max_steps=2,
              batch_size=16, run_dir=str(folder),
              device="cpu", precision="fp32", progress=False, quiet=True)
    return folder


def test_the_newest_run_is_the_newest_a_command_can_use(capsys, tmp_path, monkeypatch, trained_run):
    """A recipe's run, then a newer gpudl.fit run: generate, evaluate and export take the recipe's;
    report, which reads only what a run wrote, takes the newest."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(trained_run[1], tmp_path / "runs" / "r1")
    os.utime(tmp_path / "runs" / "r1", (1, 1))  # the older of the two
    fit_run(tmp_path / "runs" / "mlp")
    assert (tmp_path / "runs" / "mlp" / "config.toml").read_text().count("[fit]") == 1
    assert main(["evaluate", "--json", "--batches", "1", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == str(Path("runs") / "r1")
    assert main(["report"]) == 0
    assert str(Path("runs") / "mlp" / "report.md") in capsys.readouterr().out
    shutil.rmtree(tmp_path / "runs" / "r1")
    code, err = error_of(capsys, "generate")
    assert code == 2 and "runs/mlp ran gpudl.fit" in err and "pass RUN_DIR" in err


def test_debug_shows_the_traceback(tmp_path):
    out = run_cli("--debug", "train", "--set", "train.batch_size=-4", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr and "UserError" in out.stderr


def test_tensorboard_events_when_installed(tiny):
    pytest.importorskip("tensorboard")
    from rich.console import Console
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gpudl.run.recipe import train

    run = train(tiny("run.name=tb", "log.tensorboard=true"), console=Console(quiet=True)).run_dir
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert {"train/loss", "train/mfu", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
