"""Labelled images held in memory for CNNs: a data set an installed package ships (`sklearn:digits`),
or generated shapes that need nothing at all (a folder of files is streamed instead: `folder.py`).

Batch k takes positions [k*B*world, (k+1)*B*world) of a per-epoch permutation seeded by
(seed, epoch), and each data-parallel rank takes its own slice; like text, a pure function of k.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import UserError

SHAPES = ("disc", "square", "triangle", "ring", "cross", "bar")


@dataclass
class ImageSet:
    """Images as uint8 (N, C, H, W) plus int64 labels (N,), and the class names."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]

    def split(self, val_fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
        perm = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(seed))
        n_val = max(1, int(len(perm) * val_fraction)) if val_fraction > 0 else 0
        val, train = perm[:n_val], perm[n_val:]
        return (ImageSet(self.images[train], self.labels[train], self.classes),
                ImageSet(self.images[val], self.labels[val], self.classes))


def load_images(path: str | None, size: int, seed: int) -> ImageSet:
    """The image sets held in memory: None (generated shapes) or 'sklearn:digits'. A folder is
    streamed instead (`folder.py`)."""
    if path is None:
        return generated_shapes(4096, size, seed)
    if path == "sklearn:digits":
        return sklearn_digits(size)
    raise ValueError(f"not an in-memory image set: {path!r}")


def generated_shapes(n: int, size: int, seed: int) -> ImageSet:
    """`n` RGB images of one of six shapes at a random place, size and colour, with noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPES), (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    yy, xx = yy.float()[None], xx.float()[None]  # (1, S, S)
    r = (torch.rand(n, 1, 1, generator=g) * 0.25 + 0.15) * size
    cy, cx = (torch.rand(2, n, 1, 1, generator=g) * 0.4 + 0.3) * size
    dy, dx = yy - cy, xx - cx
    dist = (dy**2 + dx**2).sqrt()
    masks = torch.stack([
        dist <= r,                                                  # disc
        (dy.abs() <= r * 0.8) & (dx.abs() <= r * 0.8),              # square
        (dy <= r * 0.7) & (dx.abs() <= (dy + r * 0.7) * 0.6),       # triangle
        (dist <= r) & (dist >= r * 0.6),                            # ring
        ((dy.abs() <= r * 0.2) | (dx.abs() <= r * 0.2)) & (dist <= r),  # cross
        (dy.abs() <= r * 0.25) & (dx.abs() <= r),                   # bar
    ], dim=1)[torch.arange(n), labels]  # (N, S, S)
    colour = torch.rand(n, 3, 1, 1, generator=g) * 0.7 + 0.3
    background = torch.rand(n, 3, 1, 1, generator=g) * 0.3
    img = torch.where(masks[:, None], colour, background) + torch.randn(n, 3, size, size, generator=g) * 0.05
    return ImageSet((img.clamp(0, 1) * 255).to(torch.uint8), labels, list(SHAPES))


def sklearn_digits(size: int) -> ImageSet:
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # an optional extra: the core never needs it, only this one data set does
        raise UserError("data.path='sklearn:digits' reads scikit-learn's digits, and scikit-learn is not installed: "
                        "pip install scikit-learn (the extra 'sklearn' installs it too)") from None
    d = load_digits()  # 1797 grey 8x8 images, values 0..16, shipped inside the package
    img = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    img = F.interpolate(img, size=(size, size), mode="bilinear", align_corners=False)
    return ImageSet((img * 255).round().to(torch.uint8), torch.tensor(d.target, dtype=torch.int64),
                    [str(c) for c in range(10)])


def normalized(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (N, C, H, W) as floats (p / 255 - mean) / std, in the pixels' own layout.

    On an accelerator one multiply-add straight from uint8 (one read of the bytes, one write). On the
    CPU that mixed-dtype multiply-add runs a slow scalar loop, so there it is two passes that both
    vectorise: the uint8 -> float conversion, then a multiply-add in place; and since on channels-last
    pixels the per-channel constants repeat every C elements, such a batch is scaled as (N*H, W*C) rows
    against the constants tiled W times (6x the one-pass form there: docs/data.md)."""
    scale, shift = 1.0 / (255.0 * std), -mean / std
    if images.device.type != "cpu":
        return torch.addcmul(shift, images, scale)
    out = torch.empty_like(images, dtype=torch.float32).copy_(images)
    if images.dim() == 4 and not out.is_contiguous() and out.is_contiguous(memory_format=torch.channels_last):
        n, c, h, w = out.shape
        rows = out.permute(0, 2, 3, 1).view(n * h, w * c)  # a view of out: each pixel's C channels side by side
        rows.mul_(scale.reshape(c).repeat(w)).add_(shift.reshape(c).repeat(w))
        return out
    return out.mul_(scale).add_(shift)


class _Normalizing:
    """An image source's two halves (`data/loader.py`): `wire_batch(k)` gathers the uint8 pixels on the
    host, `on_device(batch)` normalises them where they arrive. A GPU's loader then pins and copies a
    quarter of the bytes and the host makes no floats; `batch(k)` is both, on the host."""

    mean: torch.Tensor
    std: torch.Tensor

    def wire_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def on_device(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        if self.mean.device != images.device:  # moved once: every batch of a run goes to one device
            self.mean, self.std = self.mean.to(images.device), self.std.to(images.device)
        return normalized(images, self.mean, self.std), labels

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.on_device(self.wire_batch(k))


def _normalizer(data: ImageSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (C, 1, 1) of a set's pixels in [0, 1]."""
    pixels = data.images.float() / 255.0
    return pixels.mean(dim=(0, 2, 3), keepdim=True)[0], pixels.std(dim=(0, 2, 3), keepdim=True)[0].clamp_min(1e-3)


class EpochOrder:
    """Which samples batch k holds on this rank: positions [k*B*world, (k+1)*B*world) of a per-epoch
    permutation of all n samples seeded by (seed, epoch), this rank's B of them. Shared by every image
    source, so a folder streamed from disk and a set held in memory are cut into batches alike."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int, world: int, what: str = "the image set"):
        if n < batch_size * world:
            raise UserError(f"{what} has {n} images, fewer than one batch of {batch_size * world} "
                            f"(train.batch_size x processes): lower train.batch_size")
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.per_epoch = n // (batch_size * world)
        self._perms: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # loader threads make batches of two epochs at once at its end

    def _permutation(self, epoch: int) -> torch.Tensor:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
                self._perms = {e: p for e, p in self._perms.items() if abs(e - epoch) <= 1} | {epoch: perm}
            return perm

    def indices(self, k: int) -> torch.Tensor:
        epoch, pos = divmod(k, self.per_epoch)
        start = pos * self.batch_size * self.world + self.rank * self.batch_size
        return self._permutation(epoch)[start:start + self.batch_size]

    @property
    def rows(self) -> slice:
        """This rank's rows of a global batch."""
        return slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)


class ImageBatches(_Normalizing):
    """Batch source: (images float (B, C, H, W) normalised per channel, labels (B,))."""

    parallel = "threads"  # a gather from memory: torch releases the GIL, a thread makes the next batch

    def __init__(self, data: ImageSet, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.data, self.batch_size, self.seed, self.rank, self.world = data, batch_size, seed, rank, world
        self.order = EpochOrder(len(data.labels), batch_size, seed, rank, world)
        self.per_epoch = self.order.per_epoch
        self.mean, self.std = _normalizer(data)

    @staticmethod
    def auto_workers(cores: int, accelerator: bool) -> int:
        return 1 if accelerator else 0  # on the CPU a gather costs less than handing it to a thread

    def wire_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.order.indices(k)
        return self.data.images[idx], self.data.labels[idx]


class ImageEvalBatches(_Normalizing):
    """An evaluation set: every image once, in order, `batches_per_pass` batches of up to `batch_size` per rank.

    Unlike training batches, the last one may be smaller, so a validation part smaller than one
    batch is still evaluated; each global batch is split as evenly as possible over the ranks.
    Normalised with the training part's statistics (`mean`, `std`), as the model was trained.
    """

    def __init__(self, data: ImageSet, batch_size: int, mean: torch.Tensor, std: torch.Tensor,
                 rank: int = 0, world: int = 1):
        n = len(data.labels)
        if n < world:
            raise UserError(f"the validation part has {n} images, fewer than the {world} processes: "
                            f"raise data.val_fraction")
        self.data, self.mean, self.std, self.rank, self.world = data, mean, std, rank, world
        self.global_batch = batch_size * world
        self.batches_per_pass = -(-n // self.global_batch)

    def wire_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        k %= self.batches_per_pass
        positions = torch.arange(k * self.global_batch, min(len(self.data.labels), (k + 1) * self.global_batch))
        idx = positions.tensor_split(self.world)[self.rank]
        return self.data.images[idx], self.data.labels[idx]
