"""Where to crop: the standard ImageNet augmentation as geometry, with its randomness drawn up front.

Training takes a random-resized crop (an area of 8-100% of the image, aspect ratio 3/4-4/3,
ten tries and then a centre crop, as torchvision's `RandomResizedCrop` does) and flips half of the
crops left to right; evaluation resizes the shorter side to size / 0.875 and takes the centre.

The random numbers come before any file is opened: `crop_draws(seed, k, ...)` gives each sample of
batch k its own row of uniforms, a pure function of (seed, k, sample), so a resumed run, another
rank count's run or a rerun cuts exactly the same crops, whichever thread decodes which file.
"""

from __future__ import annotations

import math

import torch

SCALE = (0.08, 1.0)
LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
TRIES = 10
DRAWS = 4 * TRIES + 1          # per try: area, ratio, x, y; then the flip
EVAL_CROP = 0.875              # the centre crop's share of the resized shorter side
_AUGMENT_STREAM = 0x9E3779B1   # keeps the crops' random stream apart from the permutation's

Box = tuple[int, int, int, int]  # (left, top, width, height) in the image's pixels


def crop_draws(seed: int, k: int, rows: slice, global_rows: int) -> torch.Tensor:
    """Uniforms in [0, 1) for the samples of global batch k (float64, (rows, DRAWS)): the whole
    global batch is drawn and each rank keeps its rows, so sharding changes no sample's crop."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + k) ^ _AUGMENT_STREAM)
    return torch.rand(global_rows, DRAWS, generator=g, dtype=torch.float64)[rows]


def random_resized_crop(width: int, height: int, u: list[float]) -> Box:
    """The crop box for one image of `width` x `height` from its row of `crop_draws`."""
    area = width * height
    for t in range(TRIES):
        a, r, ux, uy = u[4 * t:4 * t + 4]
        target = area * (SCALE[0] + a * (SCALE[1] - SCALE[0]))
        ratio = math.exp(LOG_RATIO[0] + r * (LOG_RATIO[1] - LOG_RATIO[0]))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return int(ux * (width - w + 1)), int(uy * (height - h + 1)), w, h
    return _centre_with_ratio(width, height)


def _centre_with_ratio(width: int, height: int) -> Box:
    """The fallback after ten misses: the largest centred box whose aspect ratio is in range."""
    lo, hi = math.exp(LOG_RATIO[0]), math.exp(LOG_RATIO[1])
    w, h = width, height
    if width / height < lo:
        h = round(width / lo)
    elif width / height > hi:
        w = round(height * hi)
    return (width - w) // 2, (height - h) // 2, w, h


def flips(u: list[float]) -> bool:
    return u[-1] < 0.5


def centre_crop(width: int, height: int, size: int) -> Box:
    """Evaluation's box: the square that `resize(shorter side = size / 0.875)` then `centre_crop(size)` keeps."""
    resized_short = round(size / EVAL_CROP)
    side = max(1, min(width, height, round(size * min(width, height) / resized_short)))
    return (width - side) // 2, (height - side) // 2, side, side
