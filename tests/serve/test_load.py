"""Loading for serving: a real run folder (its export, or its newest checkpoint), an export folder, a
lone `.safetensors` file; each gives the model's own outputs. Anything else is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console

from gpudl import models
from gpudl.checkpoint import export_safetensors
from gpudl.config import load_config
from gpudl.errors import UserError
from gpudl.serve.load import load_model
from gpudl.run.recipe import train

CPU = torch.device("cpu")
GPT_SETTINGS = {"n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 32}


def export(model, spec, path: Path, **extra) -> Path:
    """What `gpudl export` writes: the weights, and the model's name and settings as metadata."""
    meta = {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config)), **extra}
    return export_safetensors(model, path, meta)


@pytest.fixture(scope="module")
def gpt():
    spec = models.resolve("gpt-tiny", GPT_SETTINGS)
    return spec, models.build(spec, CPU, seed=5).eval()


@pytest.fixture(scope="module")
def resnet():
    spec = models.resolve("resnet18", {"width": 8, "num_classes": 7})
    model = models.build(spec, CPU, seed=5).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
    return spec, model


def same_outputs(a, b, x) -> bool:
    with torch.inference_mode():
        return torch.equal(a(x), b(x))


def test_a_trained_run_serves_its_export_and_its_checkpoint_alike(tiny):
    run = train(tiny(), console=Console(quiet=True)).run_dir
    exported = load_model(str(run), device="cpu")
    assert exported.kind == "gpt" and exported.source.endswith("model.safetensors")
    assert (exported.context_length, exported.vocab_size, exported.dtype) == (32, 256, torch.float32)
    assert not exported.model.training and exported.model.lm_head.weight is exported.model.wte.weight
    (run / "model.safetensors").unlink()  # a run without an export: its newest checkpoint
    from_ckpt = load_model(str(run), device="cpu")
    assert "step_" in from_ckpt.source
    x = torch.randint(0, 256, (2, 16))
    assert same_outputs(exported.model, from_ckpt.model, x)
    assert not same_outputs(exported.model, models.build(from_ckpt.spec, CPU), x)  # trained, not initial


def test_an_export_folder_gives_the_models_own_outputs(tmp_path, gpt, resnet):
    for (spec, model), folder in zip((gpt, resnet), ("gpt", "cnn")):
        (tmp_path / folder).mkdir()
        export(model, spec, tmp_path / folder / "model.safetensors")
    cfg = load_config(None, ["model.name=resnet18", "data.image_size=24", "data.kind=images",
                             "data.path=/nonexistent/images"])  # never read: serving reads no data
    (tmp_path / "cnn" / "config.toml").write_text(cfg.to_toml())
    g = load_model(tmp_path / "gpt", device="cpu")
    assert g.name == "gpt-tiny" and g.context_length == 32  # clients call it by its preset's name
    assert same_outputs(g.model, gpt[1], torch.randint(0, 256, (1, 32)))
    c = load_model(tmp_path / "cnn", device="cpu")
    assert c.kind == "classifier" and c.input_shape == (3, 24, 24) and c.spec.config.num_classes == 7
    assert c.inputs[0].shape == [-1, 3, 24, 24] and c.outputs[0].shape == [-1, 7]
    assert same_outputs(c.model, resnet[1], torch.randn(2, 3, 24, 24))


def test_a_lone_safetensors_file_carries_what_it_needs(tmp_path, resnet):
    file = export(*reversed(resnet), tmp_path / "my cnn.safetensors", image_size="40")
    loaded = load_model(file, device="cpu", precision="fp32")
    assert loaded.name == "resnet18" and loaded.input_shape == (3, 40, 40)
    assert same_outputs(loaded.model, resnet[1], torch.randn(1, 3, 40, 40))


def test_bf16_when_asked_where_the_device_has_it(tmp_path, gpt):
    from gpudl.device import detect

    export(*reversed(gpt), tmp_path / "model.safetensors")
    if not detect("cpu").bf16:
        with pytest.raises(UserError, match="lacks"):
            load_model(tmp_path, device="cpu", precision="bf16")
        return
    loaded = load_model(tmp_path, device="cpu", precision="bf16")
    assert loaded.dtype == torch.bfloat16 and loaded.model.wte.weight.dtype == torch.bfloat16


def refused(path, **kw) -> str:
    with pytest.raises(UserError) as e:
        load_model(path, device="cpu", **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_weights_that_leave_the_folder_are_refused(tmp_path, gpt):
    outside = export(*reversed(gpt), tmp_path / "elsewhere.safetensors")
    (tmp_path / "model").mkdir()
    os.symlink(outside, tmp_path / "model" / "model.safetensors")
    assert "outside the model folder" in refused(tmp_path / "model")


def test_a_checkpoints_link_out_of_the_run_is_refused(tmp_path, tiny):
    run = train(tiny("run.name=linked"), console=Console(quiet=True)).run_dir
    (run / "model.safetensors").unlink()
    (run / "checkpoints").rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", run / "checkpoints")
    assert "outside the model folder" in refused(run)


def test_a_pickle_is_never_loaded(tmp_path, gpt):
    torch.save(gpt[1].state_dict(), tmp_path / "weights.pt")
    assert ".safetensors" in refused(tmp_path / "weights.pt")
    (tmp_path / "m").mkdir()
    torch.save(gpt[1].state_dict(), tmp_path / "m" / "model.safetensors")  # a pickle by another name
    assert "not a readable safetensors file" in refused(tmp_path / "m")


def test_weights_that_do_not_fit_the_model_are_refused(tmp_path, gpt):
    from safetensors.torch import save_file

    spec, model = gpt
    meta = {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config))}
    good = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    cases = {
        "lacks": {k: v for k, v in good.items() if k != "norm.weight"},
        "does not have": {**good, "extra.weight": torch.zeros(1)},
        "has shape": {**good, "wpe.weight": torch.zeros(16, 32)},
        "not finite": {**good, "wte.weight": torch.full_like(good["wte.weight"], float("nan"))},
    }
    for says, tensors in cases.items():
        folder = tmp_path / says.replace(" ", "-")
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata=meta)
        assert says in refused(folder)
    bad_meta = tmp_path / "bad-meta"
    bad_meta.mkdir()
    save_file(good, str(bad_meta / "model.safetensors"),
              metadata={**meta, "config": json.dumps({**dataclasses.asdict(spec.config), "n_layer": -1})})
    assert "model.n_layer" in refused(bad_meta)


def test_what_is_not_a_model_is_refused_with_the_fix(tmp_path, gpt):
    assert "does not exist" in refused(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "config.toml" in refused(tmp_path / "empty")
    export(*reversed(gpt), tmp_path / "model.safetensors")
    assert "unknown precision 'fp8'" in refused(tmp_path, precision="fp8")


def test_gpudl_export_records_a_classifiers_image_size_in_the_file(tmp_path):
    from conftest import run_here  # the commands' own code, in this process (their processes: test_cli.py)

    runs = tmp_path / "runs"
    done = run_here("train", "--device=cpu", f"--set=run.dir={runs}", "--set=model.name=resnet18",
                   "--set=model.width=8", "--set=data.kind=images", "--set=data.image_size=24",
                   "--set=train.batch_size=4", "--set=train.max_steps=1", "--set=train.eval_every=0",
                   "--set=train.time_budget_s=0", "--set=log.progress=false")
    assert done.returncode == 0, done.stderr
    moved = tmp_path / "elsewhere" / "cnn.safetensors"  # no config.toml beside it
    exported = run_here("export", str(next(runs.iterdir())), "--out", str(moved))
    assert exported.returncode == 0, exported.stderr
    assert load_model(moved, device="cpu").input_shape == (3, 24, 24)  # not the default 32
