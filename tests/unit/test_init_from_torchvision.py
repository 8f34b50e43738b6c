"""`model.init_from` with a ResNet state dict in torchvision's naming (docs/interop.md).

torchvision is not installed here, so the state dicts are made by the test: their names and shapes
written from torchvision's published ResNet (torchvision/models/resnet.py: conv1/bn1, four `layerS`
stages of BasicBlock or Bottleneck, stride on the 3x3 conv, a 1x1 `downsample` where the shape
changes, `fc`), independently of gpudl's mapping, with random values. Where torchvision is
installed, the last test loads a real `torchvision.models.resnet50()` and compares the outputs.
"""

from __future__ import annotations

import datetime
import hashlib
import io
from collections import Counter

import pytest
import torch
from rich.console import Console

from conftest import TINY
from gpudl import models
from gpudl.cli import main
from gpudl.config import load_config
from gpudl.interop.init_from import read_source
from gpudl.interop.pretrained import load_into, weights_for
from gpudl.run.recipe import train

LAYERS = {18: (2, 2, 2, 2), 50: (3, 4, 6, 3)}
FAST = [s for s in TINY if not s.startswith("model.")] + ["sample.tokens=0", "train.eval_every=0",
                                                          "data.image_size=32"]


def _bn(prefix: str, c: int) -> dict[str, tuple]:
    return {f"{prefix}.weight": (c,), f"{prefix}.bias": (c,), f"{prefix}.running_mean": (c,),
            f"{prefix}.running_var": (c,), f"{prefix}.num_batches_tracked": ()}


def torchvision_shapes(depth: int, num_classes: int = 1000) -> dict[str, tuple]:
    """torchvision's resnet18/resnet50 state_dict() names and shapes, from the architecture's rules."""
    bottleneck = depth >= 50
    expansion = 4 if bottleneck else 1
    shapes = {"conv1.weight": (64, 3, 7, 7), **_bn("bn1", 64)}
    inplanes = 64
    for s, n in enumerate(LAYERS[depth]):
        planes = 64 * 2**s
        for j in range(n):
            stride = 2 if s > 0 and j == 0 else 1
            block = f"layer{s + 1}.{j}"
            convs = ([(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * 4, planes, 1, 1)] if bottleneck
                     else [(planes, inplanes, 3, 3), (planes, planes, 3, 3)])
            for i, shape in enumerate(convs, 1):
                shapes[f"{block}.conv{i}.weight"] = shape
                shapes.update(_bn(f"{block}.bn{i}", shape[0]))
            if stride != 1 or inplanes != planes * expansion:
                shapes[f"{block}.downsample.0.weight"] = (planes * expansion, inplanes, 1, 1)
                shapes.update(_bn(f"{block}.downsample.1", planes * expansion))
            inplanes = planes * expansion
    shapes.update({"fc.weight": (num_classes, 512 * expansion), "fc.bias": (num_classes,)})
    return shapes


def torchvision_state(depth: int, num_classes: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (name, shape) in enumerate(torchvision_shapes(depth, num_classes).items()):
        if name.endswith("num_batches_tracked"):
            state[name] = torch.tensor(1000 + i)
        elif name.endswith("running_var"):
            state[name] = torch.rand(shape, generator=g) + 0.5
        else:
            state[name] = torch.randn(shape, generator=g) * 0.1
    return state


def _digest(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return tuple(t.shape), t.dtype, hashlib.sha256(t.numpy().tobytes()).hexdigest()


# Hand-named pairs (gpudl, torchvision), read off the two architectures: the stem, a block's body
# (ReLUs at body.2 and body.5 take no index of their own in torchvision), a projection, the head.
PAIRS = {
    18: [("stem.0.weight", "conv1.weight"), ("stem.1.running_var", "bn1.running_var"),
         ("blocks.0.body.0.weight", "layer1.0.conv1.weight"), ("blocks.1.body.4.bias", "layer1.1.bn2.bias"),
         ("blocks.2.shortcut.0.weight", "layer2.0.downsample.0.weight"),
         ("blocks.2.shortcut.1.running_mean", "layer2.0.downsample.1.running_mean"),
         ("blocks.7.body.3.weight", "layer4.1.conv2.weight"), ("head.weight", "fc.weight"), ("head.bias", "fc.bias")],
    50: [("stem.1.num_batches_tracked", "bn1.num_batches_tracked"),
         ("blocks.3.body.6.weight", "layer2.0.conv3.weight"), ("blocks.3.body.4.weight", "layer2.0.bn2.weight"),
         ("blocks.7.body.3.weight", "layer3.0.conv2.weight"), ("blocks.12.body.7.bias", "layer3.5.bn3.bias"),
         ("blocks.13.shortcut.0.weight", "layer4.0.downsample.0.weight"),
         ("blocks.15.body.7.running_var", "layer4.2.bn3.running_var"), ("head.weight", "fc.weight")],
}


@pytest.mark.parametrize("depth,suffix", [(18, ".pth"), (50, ".safetensors")])
def test_every_tensor_comes_from_its_torchvision_source(depth, suffix, tmp_path):
    """After init_from each gpudl tensor (parameters and BatchNorm statistics) is its torchvision
    source: by hand-named pairs, and all of them one to one by value (122 and 320 tensors)."""
    tv = torchvision_state(depth, num_classes=10)
    assert len(tv) == {18: 122, 50: 320}[depth]  # len(torchvision.models.resnetN().state_dict())
    path = tmp_path / f"resnet{depth}{suffix}"
    if suffix == ".pth":
        torch.save(tv, path)
    else:
        from safetensors.torch import save_file
        save_file(tv, str(path))
    pre = read_source(path)
    assert pre.kind == f"torchvision ResNet-{depth}"
    spec = models.resolve(f"resnet{depth}", {"num_classes": 10, "small_stem": False})
    state, notes = weights_for(pre, spec)
    assert notes == []
    ours = load_into(models.build(spec, torch.device("cpu"), seed=7), state).state_dict()
    for mine, theirs in PAIRS[depth]:
        assert torch.equal(ours[mine], tv[theirs]), (mine, theirs)
    assert len(ours) == len(tv)
    assert Counter(map(_digest, ours.values())) == Counter(map(_digest, tv.values()))


def _run(tmp_path, *sets, console=None):
    cfg = load_config(None, [*FAST, f"run.dir={tmp_path / 'runs'}", "model.name=resnet18", *sets])
    return train(cfg, console=console or Console(quiet=True))


def test_a_fine_tune_with_other_classes_reinitialises_the_head(tmp_path):
    """A 1000-class state dict into a run on the generated shapes: the start block says the head is
    re-initialised; before the first step (lr 1e-30 moves no fp32 weight) every other weight is the
    source's, and the run trains from step 0."""
    tv = torchvision_state(18)
    torch.save(tv, tmp_path / "r18.pth")
    out = io.StringIO()
    result = _run(tmp_path, f"model.init_from={tmp_path / 'r18.pth'}", "model.small_stem=false", "train.max_steps=1",
                  "optim.lr=1e-30", console=Console(file=out, width=300))
    said = out.getvalue()
    assert "Weights: torchvision ResNet-18 from" in said and "fc has 1000 classes" in said and "re-initialised" in said
    ours = result.model.state_dict()
    classes = result.model.head.weight.shape[0]
    assert classes != 1000 and not torch.equal(ours["head.weight"][:classes], tv["fc.weight"][:classes])
    for mine, theirs in PAIRS[18][:-2]:
        if "running" not in mine and "tracked" not in mine:  # a training step moves BatchNorm's statistics
            assert torch.equal(ours[mine], tv[theirs]), (mine, theirs)
    assert result.summary["steps"] == 1


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tv")
    torch.save(torchvision_state(18, num_classes=10), folder / "r18.pth")
    torch.save(torchvision_state(50, num_classes=10), folder / "r50.pt")
    torch.save({"made": datetime.datetime(2026, 1, 1)}, folder / "pickle.pth")
    torch.save({"encoder.weight": torch.zeros(2, 2)}, folder / "other.pth")
    (folder / "notes.txt").write_text("not weights")
    return folder


BAD = {
    "depth": ("r50.pt", ["model.small_stem=false"], ["ResNet-50", "ResNet-18", "--set model.name=resnet50"]),
    "stem": ("r18.pth", [], ["ImageNet stem", "--set model.small_stem=false"]),
    "shape": ("r18.pth", ["model.small_stem=false", "model.width=32"],
              ["conv1.weight", "(64, 3, 7, 7)", "(32, 3, 7, 7)"]),
    "pickle": ("pickle.pth", ["model.small_stem=false"], ["torch.load(weights_only=True) refuses"]),
    "not a resnet": ("other.pth", ["model.small_stem=false"], ["not a ResNet state dict in torchvision's naming"]),
    "neither": ("notes.txt", [], ["is neither a .safetensors"]),
    "missing": ("gone.pth", [], ["the file does not exist"]),
    "family": ("r18.pth", ["model.name=gpt-tiny"], ["holds a resnet", "--set model.name=resnet18"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line(case, files, tmp_path, capsys):
    """Each stops `gpudl train` before a step: exit 2 and one line naming what is wrong."""
    file, sets, said = BAD[case]
    name = [] if any(s.startswith("model.name=") for s in sets) else ["--set=model.name=resnet18"]
    assert main(["train", *[f"--set={s}" for s in FAST + sets], *name, f"--set=run.dir={tmp_path}",
                 f"--set=model.init_from={files / file}"]) == 2
    err = capsys.readouterr().err.strip()
    assert all(s in err for s in said) and len(err.splitlines()) == 1, err


def test_real_torchvision_resnet50_gives_the_same_outputs(tmp_path):
    """Optional (docs/interop.md): where torchvision is installed, its resnet50's state dict, loaded by
    init_from's path into gpudl's resnet50, gives torchvision's logits in eval mode."""
    tvm = pytest.importorskip("torchvision.models", reason="torchvision is not installed here: the real "
                                                            "resnet50 comparison runs where it is")
    torch.manual_seed(0)
    theirs = tvm.resnet50().eval()
    with torch.no_grad():  # non-trivial statistics, so that a BatchNorm mapped wrong shows
        for m in theirs.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_(1, 0.1)
                m.bias.normal_(0, 0.1)
    path = tmp_path / "resnet50.pth"
    torch.save(theirs.state_dict(), path)
    spec = models.resolve("resnet50", {"num_classes": 1000, "small_stem": False})
    state, _ = weights_for(read_source(path), spec)
    ours = load_into(models.build(spec, torch.device("cpu")), state).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():  # logits near 100 here: fp32's rounding, summed in another order, is relative
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-4)
