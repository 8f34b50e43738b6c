"""A ResNet state dict in torchvision's naming (`conv1.weight`, `bn1.*`, `layer1.0.conv1.weight`,
`layer1.0.downsample.0.weight`, ..., `fc.weight`) as a run's starting point: `model.init_from`.

The two architectures are the same network (He et al., torchvision's "v1.5": a Bottleneck's stride on
its 3x3 conv), so the mapping is renames only. gpudl keeps the ImageNet stem as `stem` (conv 7x7
stride 2, BatchNorm, ReLU, max-pool: torchvision's conv1, bn1, relu, maxpool), the blocks of all four
stages in one list `blocks.N` (torchvision's layerS.J, numbered through), a block's convs and norms in
its `body` (ReLUs between them) and its projection as `shortcut` (torchvision's downsample), the
classifier as `head` (fc). Nothing is computed, so the weights come in bit for bit. docs/interop.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .. import models
from ..errors import UserError
from ..models.resnet import LAYOUTS
from .pretrained import Pretrained, read_pickle, read_safetensors

ADVICE = "save the model's state_dict() again (torch.save, or safetensors' save_file)"
BLOCK_KIND = {"basic": "BasicBlock", "bottleneck": "Bottleneck"}
# A block's body, in gpudl's Sequential order, as torchvision names its modules (None: a ReLU).
BODY = {"basic": ("conv1", "bn1", None, "conv2", "bn2"),
        "bottleneck": ("conv1", "bn1", None, "conv2", "bn2", None, "conv3", "bn3")}
STEM = {"0": "conv1", "1": "bn1"}  # stem.2 is the ReLU, stem.3 the max-pool: no tensors


def torchvision_name(name: str, depth: int) -> str:
    """gpudl's name of a ResNet tensor -> torchvision's, for a ResNet of `depth` with the ImageNet stem."""
    kind, counts = LAYOUTS[depth]
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    if parts[0] == "stem":
        return f"{STEM[parts[1]]}.{leaf}"
    if parts[0] == "head":
        return f"fc.{leaf}"
    index, where, position = int(parts[1]), parts[2], parts[3]
    stage = 0
    while index >= counts[stage]:
        index, stage = index - counts[stage], stage + 1
    own = BODY[kind][int(position)] if where == "body" else f"downsample.{position}"
    return f"layer{stage + 1}.{index}.{own}.{leaf}"


def depth_of(state: dict[str, torch.Tensor], path: Path) -> int:
    """The depth a torchvision ResNet state dict is of: its block type (a third conv: Bottleneck) and
    its blocks per stage, as the tensors' names say."""
    if "conv1.weight" not in state or "fc.weight" not in state:
        raise UserError(f"model.init_from: {path} is not a ResNet state dict in torchvision's naming (no "
                        f"conv1.weight and fc.weight): give a Hugging Face GPT-2 folder, a torchvision ResNet's "
                        f"state dict, a gpudl run folder or a gpudl export")
    kind = "bottleneck" if "layer1.0.conv3.weight" in state else "basic"
    counts = []
    for stage in range(1, 5):
        blocks = {int(m.group(1)) for k in state if (m := re.match(rf"layer{stage}\.(\d+)\.", k))}
        counts.append(max(blocks) + 1 if blocks else 0)
    found = next((d for d, layout in LAYOUTS.items() if layout == (kind, tuple(counts))), None)
    if found is None:
        raise UserError(f"model.init_from: {path} is a ResNet of {BLOCK_KIND[kind]}s {tuple(counts)} per stage, "
                        f"which is not ResNet-{'/'.join(map(str, LAYOUTS))}: gpudl has no such depth")
    return found


def read_torchvision(path: Path) -> Pretrained:
    """A torchvision ResNet state dict (.safetensors, or .pth/.pt read with weights_only) in gpudl's names:
    every tensor of that depth's ResNet present, nothing else (its shapes are checked against the run's
    model by `weights_for`, which names them in torchvision's words)."""
    raw = read_safetensors(path, ADVICE) if path.suffix == ".safetensors" else read_pickle(path, ADVICE)
    depth = depth_of(raw, path)
    fc = raw["fc.weight"]
    spec = models.resolve(f"resnet{depth}", {"num_classes": max(2, fc.shape[0]), "small_stem": False,
                                             "in_channels": raw["conv1.weight"].shape[1]})
    names = {ours: torchvision_name(ours, depth) for ours in models.build_meta(spec).state_dict()}
    missing = [theirs for theirs in names.values() if theirs not in raw]
    if missing:
        raise UserError(f"model.init_from: {path} has no tensor {missing[0]} (and {len(missing) - 1} more), which "
                        f"torchvision's ResNet-{depth} has: the state dict is incomplete; {ADVICE}")
    extra = sorted(set(raw) - set(names.values()))
    if extra:
        raise UserError(f"model.init_from: {path} holds {extra[0]} (and {len(extra) - 1} more), which torchvision's "
                        f"ResNet-{depth} does not have: the weights are of another model")
    state = {ours: raw[theirs] for ours, theirs in names.items()}
    return Pretrained(path, f"torchvision ResNet-{depth}", "resnet", {}, state, path.name, names=names,
                      requires={"depth": depth, "small_stem": False})


def check_model(pre: Pretrained, spec: models.ModelSpec, image_size: int) -> None:
    """The run's ResNet can take torchvision's weights: the same depth, and the ImageNet stem."""
    depth = pre.requires["depth"]
    if spec.config.depth != depth:
        raise UserError(f"model.init_from: {pre.source} is a ResNet-{depth} ({BLOCK_KIND[LAYOUTS[depth][0]]}s "
                        f"{LAYOUTS[depth][1]}), this run's model a ResNet-{spec.config.depth}: set "
                        f"--set model.name=resnet{depth}")
    if spec.config.small_stem:
        why = f" (model.small_stem=auto at data.image_size={image_size})" if "small_stem" in spec.auto else ""
        raise UserError(f"model.init_from: torchvision's ResNet weights need the ImageNet stem (7x7 stride 2 + "
                        f"max-pool); this run's model has the small 3x3 stem{why}: set --set model.small_stem=false")
