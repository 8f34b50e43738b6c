"""An image folder streamed: batch k decoded from its files when it is wanted, never the whole set.

Which files batch k holds is `EpochOrder`'s (as for images in memory), where each is cropped is
`augment.py`'s, both pure functions of (seed, k) for this rank; so resuming at batch k, or sharding
over ranks, cuts exactly the crops an uninterrupted run would. The loader makes several batches at
once in threads (`parallel = "threads"`): the decoders release the GIL (`decode.py`).

A file that cannot be decoded is replaced by another drawn from (seed, k, slot), so batch shapes
hold and the run stays a function of (seed, k); `BadImages` counts it for metrics.jsonl.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ...errors import UserError
from .augment import Box, centre_crop, crop_draws, flips, random_resized_crop
from .decode import BadImage, BadImages, decode_crop, read_file
from .index import FolderIndex
from .in_memory import EpochOrder, _Normalizing
from ..staging import one_torch_thread

# ImageNet's per-channel statistics: what torchvision's and timm's pretrained models expect, and
# close enough for any photographs; a folder of millions of files is not read twice to measure its own.
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
SUBSTITUTE_TRIES = 16


def _batch_buffer(n: int, size: int) -> torch.Tensor:
    """(n, size, size, 3) uint8: what the decoders make; `_as_nchw` shows it as (n, 3, size, size)
    laid out channels-last, the layout the convolutions want."""
    return torch.empty(n, size, size, 3, dtype=torch.uint8)


def _as_nchw(images: torch.Tensor) -> torch.Tensor:
    return images.permute(0, 3, 1, 2)


class FolderBatches(_Normalizing):
    """Training batches from a folder: (images (B, 3, S, S), labels (B,)), random-resized crops and flips."""

    parallel = "threads"

    def __init__(self, index: FolderIndex, size: int, batch_size: int, seed: int, rank: int = 0, world: int = 1,
                 bad: BadImages | None = None, augment: bool = True, decode: str = "auto"):
        self.index, self.size, self.batch_size, self.seed, self.decode = index, size, batch_size, seed, decode
        self.order = EpochOrder(len(index), batch_size, seed, rank, world, what=f"the folder {str(index.root)!r}")
        self.per_epoch, self.global_rows = self.order.per_epoch, batch_size * world
        self.bad, self.augment = bad or BadImages(), augment
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
        self.labels = torch.from_numpy(index.labels.astype(np.int64))

    @staticmethod
    def auto_workers(cores: int, accelerator: bool) -> int:
        """Every core but the training loop's where an accelerator computes; on the CPU, every core
        (decoding threads sleep once the batches in flight are made, and the step needs the cores then)."""
        return max(1, cores - 1) if accelerator else max(1, cores)

    def for_device(self, device: torch.device):
        """This source as `device` wants it: JPEGs decoded there where it can (`gpu_decode.py`)."""
        from .gpu_decode import on_device_decoding
        return on_device_decoding(self, device, self.decode)

    def slots(self, k: int) -> list[tuple[int, list[float]]]:
        """(image number, its crop draws) for each sample of batch k on this rank."""
        idx = self.order.indices(k).tolist()
        return list(zip(idx, crop_draws(self.seed, k, self.order.rows, self.global_rows).tolist()))

    def crop_of(self, u: list[float]) -> tuple[Callable[[int, int], Box], bool]:
        """(the crop box as a function of the image's size, whether to flip) for draws `u`."""
        if self.augment and u:
            return functools.partial(random_resized_crop, u=u), flips(u)
        return functools.partial(centre_crop, size=self.size), False

    def wire_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots(k)
        images, labels = _batch_buffer(len(slots), self.size), torch.empty(len(slots), dtype=torch.int64)
        for slot, (i, u) in enumerate(slots):
            images[slot], labels[slot] = self.decoded(i, u, k, slot)
        return _as_nchw(images), labels

    def decoded(self, i: int, u: list[float], k: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Image i cropped by its draws `u`, or, where its file is bad, a substitute's, drawn from (seed, k, slot)."""
        box_for, flip = self.crop_of(u)
        for attempt in range(SUBSTITUTE_TRIES):
            path = self.index.path(i)
            if not self.bad.known(path):  # a bad file fails alike each epoch: read, counted and named once
                try:
                    return decode_crop(read_file(path), self.size, box_for, flip), self.labels[i]
                except BadImage as e:
                    self.bad.saw(path, str(e), self.index.relative(i))
            i = self.substitute(k, slot, attempt)
        raise UserError(f"{SUBSTITUTE_TRIES} files of {str(self.index.root)!r} in a row could not be decoded "
                        f"(the last: {self.bad.named[-1] if self.bad.named else path}): is it a folder of images?")

    def substitute(self, k: int, slot: int, attempt: int) -> int:
        """The image that stands in for a bad file at (k, slot): a function of (seed, k, slot, attempt)."""
        return int(np.random.default_rng([self.seed, k, slot, attempt]).integers(len(self.index)))


class FolderEvalBatches(_Normalizing):
    """Evaluation batches from a folder: every image once, in order, resized and centre-cropped;
    split over ranks as `ImageEvalBatches` splits them. The images of a batch decode in threads:
    evaluation asks for batches one by one, with no loader running ahead."""

    def __init__(self, index: FolderIndex, size: int, batch_size: int, rank: int = 0, world: int = 1,
                 bad: BadImages | None = None, threads: int = 1, decode: str = "auto"):
        n = len(index)
        if n < world:
            raise UserError(f"the validation part has {n} images, fewer than the {world} processes: "
                            f"raise data.val_fraction")
        self.index, self.size, self.rank, self.world, self.decode = index, size, rank, world, decode
        self.global_batch = batch_size * world
        self.batches_per_pass = -(-n // self.global_batch)
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
        self.bad, self.threads = bad or BadImages(), threads
        self._pool: ThreadPoolExecutor | None = None
        self._decoder = FolderBatches(index, size, 1, seed=0, bad=self.bad, augment=False)
        self.labels = self._decoder.labels

    def for_device(self, device: torch.device):
        from .gpu_decode import on_device_decoding
        return on_device_decoding(self, device, self.decode)

    def slots(self, k: int) -> list[tuple[int, list[float]]]:
        k %= self.batches_per_pass
        positions = torch.arange(k * self.global_batch, min(len(self.index), (k + 1) * self.global_batch))
        return [(i, []) for i in positions.tensor_split(self.world)[self.rank].tolist()]

    def crop_of(self, u: list[float]) -> tuple[Callable[[int, int], Box], bool]:
        return self._decoder.crop_of([])

    def decoded(self, i: int, u: list[float], k: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decoder.decoded(i, [], k, slot)

    def wire_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots(k)
        if self.threads > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpudl-eval-decode",
                                            initializer=one_torch_thread)

        def work(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.decoded(slots[slot][0], [], k, slot)
        decoded = list((self._pool.map if self._pool else map)(work, range(len(slots))))
        images = _batch_buffer(len(slots), self.size)
        for slot, (image, _) in enumerate(decoded):
            images[slot] = image
        labels = torch.stack([label for _, label in decoded]) if decoded else torch.empty(0, dtype=torch.int64)
        return _as_nchw(images), labels
