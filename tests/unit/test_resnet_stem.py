"""A ResNet's stem follows the image size: `model.small_stem = "auto"` (the default) is the 3x3 stride-1
stem up to 64 px and the ImageNet stem (7x7 stride 2 + max-pool) above; a true or false set by the user
wins. Checked on the network built (its first convolution), in what plan, info and the start block say,
in the memory a plan predicts, and in what an export or a checkpoint records for serving."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from rich.console import Console

from gpudl import models
from gpudl.checkpoint import export_safetensors
from gpudl.cli import main
from gpudl.config import load_config
from gpudl.errors import UserError
from gpudl.memory.plan import local_machine, plan
from gpudl.memory.step_time import flops_per_sample
from gpudl.serve.load import load_model
from gpudl.training.job import model_and_data

SMALL, IMAGENET = ((3, 3), (1, 1), False), ((7, 7), (2, 2), True)
# resnet50 at 224 px on generated batches (no image set drawn), two images a step: quick to trace
PLAN_224 = ["data.image_size=224", "data.kind=synthetic", "train.batch_size=2", "train.precision=fp32",
            "run.device=cpu"]


def stem_of(model: torch.nn.Module) -> tuple:
    """(kernel size, stride, has a max-pool) of the network's first convolution: the stem as built."""
    conv = model.stem[0]
    return conv.kernel_size, conv.stride, any(isinstance(m, torch.nn.MaxPool2d) for m in model.stem)


def run_spec(*sets: str, recipe: str = "resnet18") -> models.ModelSpec:
    return models.from_config(load_config(recipe, list(sets)))


@pytest.mark.parametrize("size, stem", [(32, SMALL), (64, SMALL), (65, IMAGENET), (224, IMAGENET)])
def test_auto_takes_the_small_stem_up_to_64_px_and_the_imagenet_stem_above(size, stem):
    spec = run_spec(f"data.image_size={size}")
    assert stem_of(models.build_meta(spec)) == stem
    assert spec.config.small_stem is (stem == SMALL) and spec.auto == {"small_stem": size}


@pytest.mark.parametrize("size", [32, 224])
@pytest.mark.parametrize("setting, stem", [("true", SMALL), ("false", IMAGENET)])
def test_an_explicit_setting_wins_at_any_size(size, setting, stem):
    spec = run_spec(f"data.image_size={size}", f"model.small_stem={setting}")
    assert stem_of(models.build_meta(spec)) == stem and spec.auto == {}
    assert "auto" not in models.describe(spec)


def test_auto_written_out_is_auto_and_a_bad_value_is_one_line():
    assert stem_of(models.build_meta(run_spec("data.image_size=224", "model.small_stem=auto"))) == IMAGENET
    with pytest.raises(UserError, match=r"model\.small_stem must be bool \| 'auto', got 'maybe'"):
        run_spec("model.small_stem=maybe")


def test_the_network_never_sees_auto():
    with pytest.raises(UserError, match="small_stem true or false"):
        models.ResNet(models.ResNetConfig(depth=18))
    assert models.resolve("resnet18").config.small_stem is True  # without a run's config: its 32 px default


def test_the_training_path_builds_the_stem_of_its_image_size():
    cfg = load_config("resnet18", ["data.image_size=96", "data.kind=synthetic", "model.width=8",
                                   "train.batch_size=2"])
    spec, data = model_and_data(cfg)
    assert stem_of(models.build_meta(spec)) == IMAGENET
    assert models.describe(spec) == "ResNet-18, 10 classes, ImageNet stem (auto: 96 px images)"
    assert data.train.batch(0)[0].shape[-2:] == (96, 96)


def test_describe_names_the_stem_and_info_says_the_rule(capsys, monkeypatch):
    assert models.describe(run_spec("data.image_size=224")).endswith("ImageNet stem (auto: 224 px images)")
    assert models.describe(run_spec()).endswith("small stem (auto: 32 px images)")
    assert models.describe(run_spec("model.small_stem=false")).endswith("ImageNet stem")
    monkeypatch.setenv("COLUMNS", "250")  # one table row a line
    assert main(["info", "--models"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "ResNet-" in line]
    assert len(rows) == 5 and all("stem by data.image_size: small up to 64 px, ImageNet above, unless "
                                  "model.small_stem is set" in row for row in rows)


def test_plan_names_the_stem_and_its_memory_and_flops_follow_it(capsys):
    auto = load_config("resnet50", PLAN_224)
    small = load_config("resnet50", [*PLAN_224, "model.small_stem=true"])
    assert main(["plan", "--config", "resnet50", *[w for s in PLAN_224 for w in ("--set", s)], "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["model"] == "ResNet-50, 10 classes, ImageNet stem (auto: 224 px images)"
    assert "ImageNet stem (auto: 224 px images)" in out.err
    machine = local_machine("cpu", 1)
    imagenet, cifar = plan(auto, machine).winner.estimate, plan(small, machine).winner.estimate
    # the small stem keeps 224x224 maps through the first stage: about 16x the activations and FLOPs
    assert imagenet.parts["activations"] * 5 < cifar.parts["activations"]
    assert imagenet.peak < cifar.peak
    assert flops_per_sample(auto).train * 8 < flops_per_sample(small).train


def test_an_export_records_the_stem_it_built_and_serving_builds_the_same(tmp_path):
    spec = run_spec("data.image_size=96", "model.width=8")
    model = models.build(spec, torch.device("cpu"), seed=3).eval()
    record = dataclasses.asdict(spec.config)
    assert record["small_stem"] is False  # the decision, not "auto"
    folder = tmp_path / "export"
    folder.mkdir()
    export_safetensors(model, folder / "model.safetensors", {"gpudl_model": spec.name, "config": json.dumps(record)})
    served = load_model(folder, device="cpu", precision="fp32")  # no config.toml: the default 32 px beside it
    assert stem_of(served.model) == IMAGENET
    x = torch.randn(1, 3, 96, 96)
    with torch.inference_mode():
        assert torch.equal(served.model(x), model(x))


@pytest.mark.parametrize("recorded, stem", [(True, SMALL), (False, IMAGENET)])
def test_an_older_export_with_its_stem_recorded_loads_whatever_the_config_beside_it_says(tmp_path, recorded, stem):
    """Exports and checkpoints have always recorded small_stem true or false; that record wins over auto."""
    spec = models.resolve("resnet18", {"width": 8, "small_stem": recorded})
    model = models.build(spec, torch.device("cpu"), seed=3)
    export_safetensors(model, tmp_path / "model.safetensors",
                       {"gpudl_model": spec.name, "config": json.dumps(dataclasses.asdict(spec.config))})
    size = 224 if recorded else 32  # the config beside it would have "auto" decide the other stem
    (tmp_path / "config.toml").write_text(load_config("resnet18", [f"data.image_size={size}"]).to_toml())
    served = load_model(tmp_path, device="cpu", precision="fp32")
    assert stem_of(served.model) == stem and served.input_shape == (3, size, size)


def test_a_run_announces_the_stem_and_its_export_and_checkpoint_rebuild_it(tmp_path):
    """A two-step run at 72 px (just above the small stem's limit), served from its export, then from its
    checkpoint: the run's start block says which stem, and both records build that network."""
    cfg = load_config("resnet18", [
        "data.image_size=72", "data.kind=synthetic", "model.width=8", "train.batch_size=2", "train.max_steps=2",
        "train.eval_every=0", "train.eval_batches=1", "train.precision=fp32", "train.compile=false",
        "train.plan=off", "log.progress=false", "run.device=cpu", f"run.dir={tmp_path}", "run.name=stem"])
    from gpudl.run.recipe import train

    console = Console(record=True, width=200)
    run = train(cfg, console=console).run_dir
    assert "Model: resnet18: ResNet-18, 10 classes, ImageNet stem (auto: 72 px images);" in console.export_text()
    exported = load_model(run, device="cpu", precision="fp32")
    (run / "model.safetensors").unlink()
    from_checkpoint = load_model(run, device="cpu", precision="fp32")
    assert stem_of(exported.model) == stem_of(from_checkpoint.model) == IMAGENET
    x = torch.randn(1, 3, 72, 72)
    with torch.inference_mode():
        assert torch.equal(exported.model(x), from_checkpoint.model(x))
