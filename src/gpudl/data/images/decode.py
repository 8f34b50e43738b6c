"""One image file to one square crop of uint8 pixels, on the host, safe against what real folders hold.

Pillow decodes (libjpeg-turbo for JPEGs; it and torch's resize both release the GIL, so decoding
threads run in parallel: docs/data.md has the measurement); for a JPEG much larger than its crop
Pillow's `draft` decodes at 1/2, 1/4 or 1/8 scale. Torch's antialiased bilinear resize of uint8
pixels then makes the crop's size (3x as fast here as Pillow's own resize).

Files come from other people: EXIF rotation is applied, every mode (CMYK, greyscale, palette,
16-bit, alpha) becomes RGB, images over `MAX_PIXELS` are refused before they are decoded
(decompression bombs), links are not followed at open (the index resolved them inside the folder),
and whatever Pillow cannot decode is a `BadImage` naming the reason, never a crash.
"""

from __future__ import annotations

import io
import math
import os
import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import UserError
from .augment import Box

# Pillow's pixels reach torch read-only (no copy); the resize only reads them. torch warns once of it.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
# Pillow warns of images over its threshold, which is MAX_PIXELS: they are refused below, undecoded.
warnings.filterwarnings("ignore", message=r"Image size \(\d+ pixels\) exceeds limit")

MAX_PIXELS = 89_478_485        # Pillow's own warning threshold (a 9,459 px square): more is refused, undecoded
MAX_FILE_BYTES = 1 << 28       # 256 MiB
_ORIENTATION = 0x0112          # the EXIF tag; 5-8 turn the image a quarter
_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}


class BadImage(Exception):
    """A file that cannot become an image; the message says why."""


def read_file(path: str) -> bytes:
    """The file's bytes, refusing a link (the index resolved links) and anything oversized."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise BadImage(f"cannot open it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise BadImage(f"{size:,} bytes, over the {MAX_FILE_BYTES:,} a training image may have")
        return f.read()


def decode_crop(data: bytes, size: int, box_for: Callable[[int, int], Box], flip: bool = False) -> torch.Tensor:
    """(size, size, 3) uint8: the box `box_for(width, height)` of the image (as displayed, EXIF
    rotation applied), resized to size x size, flipped left to right when asked."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadImage("an empty file (0 bytes)")
    try:
        im = Image.open(io.BytesIO(data))
        width, height = im.size
        if width * height > MAX_PIXELS:
            raise BadImage(f"{width}x{height} pixels, over the {MAX_PIXELS:,} allowed (a decompression bomb?)")
        turned = im.getexif().get(_ORIENTATION, 1) in (5, 6, 7, 8)
        shown = (height, width) if turned else (width, height)
        box = box_for(*shown)
        _draft(im, shown, box, size)
        image, scale = _rgb(im, shown)
    except BadImage:
        raise
    except Image.DecompressionBombError:  # Pillow's own refusal, at twice its threshold
        raise BadImage(f"over {MAX_PIXELS:,} pixels (a decompression bomb?)") from None
    except UnidentifiedImageError:  # Pillow's message names the in-memory buffer, not the file: say what it means
        raise BadImage("not an image (no format Pillow reads starts like it)") from None
    except Exception as e:  # Pillow raises many kinds for damaged files (OSError, SyntaxError, ValueError, ...)
        raise BadImage(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    return _resize(image, box, scale, size, flip)


def _draft(im, shown: tuple[int, int], box: Box, size: int) -> None:
    """Ask a JPEG to decode at the smallest 1/2^n scale that still leaves the crop at least `size`."""
    s = min(box[2], box[3]) / size
    if im.format == "JPEG" and s >= 2:
        im.draft(im.mode, (math.ceil(im.size[0] / s), math.ceil(im.size[1] / s)))


def _rgb(im, shown: tuple[int, int]):
    """The image decoded as RGB in its displayed orientation, and its size's scale against `shown`."""
    from PIL import Image, ImageOps

    im.load()
    if im.getexif().get(_ORIENTATION, 1) != 1:
        im = ImageOps.exif_transpose(im)
    if im.mode in _SIXTEEN_BIT:  # 16-bit greyscale: keep the top 8 bits (Pillow's convert clips at 255)
        grey = (np.asarray(im).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
        im = Image.fromarray(grey, "L")
    if im.mode in ("P", "PA") and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode != "RGB":
        im = im.convert("RGB")
    return im, im.size[0] / shown[0]


def _resize(im, box: Box, scale: float, size: int, flip: bool) -> torch.Tensor:
    from PIL import Image

    x, y, w, h = box
    x0, y0 = min(int(x * scale), im.size[0] - 1), min(int(y * scale), im.size[1] - 1)
    x1, y1 = max(x0 + 1, round((x + w) * scale)), max(y0 + 1, round((y + h) * scale))
    region = im.crop((x0, y0, min(x1, im.size[0]), min(y1, im.size[1])))
    if flip:
        region = region.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # (1, 3, h, w) laid out channels-last: the resize keeps that layout, so the result is already
    # (size, size, 3) with no transposing copy. The pixels are read, never written (see the filter).
    crop = torch.from_numpy(np.asarray(region)).permute(2, 0, 1)[None]
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0)


class BadImages:
    """What the decoders skipped: a count for metrics.jsonl, the first few named, or the end of the run
    where `data.bad_images="error"`. Shared by a run's decoding threads and its training and evaluation
    sources, so a file is counted and named once however often epochs and evaluations meet it."""

    NAMED = 5

    def __init__(self, policy: str = "skip"):
        self.policy, self.count, self._lock = policy, 0, threading.Lock()
        self.named: list[str] = []     # "path: reason" of the first NAMED
        self._announced = 0
        self._seen: set[str] = set()   # every bad file's full path (two folders may share a relative name)

    def known(self, path: str) -> bool:
        """Whether `path` was found bad already: it is not read again (it would fail the same way)."""
        with self._lock:
            return path in self._seen

    def saw(self, path: str, reason: str, name: str | None = None) -> None:
        """File `path` (shown as `name`, e.g. its path relative to the folder) cannot be decoded, for `reason`."""
        name = name or path
        if self.policy == "error":
            raise UserError(f"cannot use image {name!r}: {reason}; remove or replace it, "
                            f"or set data.bad_images=skip to train on without it")
        with self._lock:
            if path in self._seen:  # another thread met it in the same batch
                return
            self._seen.add(path)
            self.count += 1
            if len(self.named) < self.NAMED:
                self.named.append(f"{name}: {reason}")

    def news(self) -> list[str]:
        """The named files not yet reported (each is reported once)."""
        with self._lock:
            fresh, self._announced = self.named[self._announced:], len(self.named)
        return fresh
