"""ResNet-18/34/50/101/152 (He et al. 2015), with a small-image stem for 32x32 inputs.

The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks a 32x32 image to 8x8 before the
first stage; `small_stem` uses one 3x3 stride-1 conv instead, as CIFAR-sized work needs. At
224 px that small stem costs about 16x the FLOPs and activations of the standard network, so
`small_stem = "auto"` (the default) follows the image size: small up to 64 px, ImageNet above.
`models.resolve` decides it; a ResNet is built with true or false, never "auto".

>>> import torch
>>> m = ResNet(ResNetConfig(depth=18, num_classes=10, small_stem=True)); m.init_weights()
>>> m(torch.zeros(2, 3, 32, 32)).shape
torch.Size([2, 10])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..errors import UserError
from ..config.settings import option

# depth -> (block type, blocks per stage)
LAYOUTS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3)),
           101: ("bottleneck", (3, 4, 23, 3)), 152: ("bottleneck", (3, 8, 36, 3))}
SMALL_STEM_MAX = 64  # px: images up to this side get the small stem when small_stem is "auto"
STEM_RULE = f"stem by data.image_size: small up to {SMALL_STEM_MAX} px, ImageNet above, unless model.small_stem is set"


def small_stem_for(image_size: int) -> bool:
    """What `small_stem = "auto"` becomes for square images of side `image_size`."""
    return image_size <= SMALL_STEM_MAX


@dataclass(kw_only=True)
class ResNetConfig:
    depth: int = option(18, "18 | 34 | 50 | 101 | 152")
    num_classes: int = option(10, "output classes", ge=2)
    in_channels: int = option(3, "image channels", ge=1)
    small_stem: bool | Literal["auto"] = option(
        "auto", "true: 3x3 stride-1 stem for small images (32x32); false: the ImageNet stem (7x7 stride 2 + "
                f"max-pool); auto: small up to {SMALL_STEM_MAX} px images (data.image_size), ImageNet above")
    width: int = option(64, "channels of the first stage", ge=8)
    channels_last: bool = option(True, "keep convolution weights, and so activations, in channels-last (NHWC) "
                                       "layout: the layout oneDNN and tensor-core convolutions run fastest in")

    def __post_init__(self):
        if self.depth not in LAYOUTS:
            raise UserError(f"model.depth={self.depth} is not a ResNet depth; choose one of "
                            f"{', '.join(map(str, LAYOUTS))}")


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(*_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, cout, 3))
        self.shortcut = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(BasicBlock):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        nn.Module.__init__(self)
        cout = width * self.expansion
        self.body = nn.Sequential(*_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                                  *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                                  *_conv_bn(width, cout, 1))
        self.shortcut = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()


class ResNet(nn.Module):
    """Images (B, C, H, W) -> class logits (B, num_classes)."""

    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.cfg = cfg
        kind, counts = LAYOUTS[cfg.depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        w = cfg.width
        if not isinstance(cfg.small_stem, bool):
            raise UserError(f"ResNet needs small_stem true or false, got {cfg.small_stem!r}: build it through "
                            f"gpudl.models.resolve(..., image_size=...), which decides \"auto\", or set it")
        if cfg.small_stem:
            self.stem = nn.Sequential(*_conv_bn(cfg.in_channels, w, 3), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(*_conv_bn(cfg.in_channels, w, 7, 2), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], w
        for stage, n in enumerate(counts):
            width = w * 2**stage
            for i in range(n):
                blocks.append(block(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = width * block.expansion
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, cfg.num_classes)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Kaiming-normal convs; the last norm of every residual branch starts at zero (Goyal et al.)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                m.reset_parameters()
                m.reset_running_stats()
            elif isinstance(m, nn.Linear):
                m.reset_parameters()
        for b in self.blocks:
            nn.init.zeros_(b.body[-1].weight)
        if self.cfg.channels_last:
            # Weights in NHWC make every convolution produce NHWC; the input is converted by the first.
            self.to(memory_format=torch.channels_last)

    def activation_checkpoint_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
