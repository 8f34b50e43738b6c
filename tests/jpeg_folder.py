"""A folder of JPEGs at ImageNet-like sizes, generated (nothing can be downloaded): for the input
pipeline's benchmark, the GPU check and the tests.

Each image is a smooth random background with a few discs and, for its class, one shape in one
colour family, plus sensor-like noise, saved at quality 90: files of ~50-60 KB at 500x375, which
decode like photographs (libjpeg does the same work per pixel whatever the picture shows).
Deterministic: the same (n, classes, size, seed) writes the same bytes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from gpudl.cache import cache_dir

FORMAT = 1  # bump when the pictures change, so cached folders are made anew


def _picture(i: int, label: int, width: int, height: int, seed: int):
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, i])
    im = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(4):
        x, y, r = rng.integers(0, width), rng.integers(0, height), rng.integers(10, width // 5)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    x, y, r = rng.integers(width // 4, 3 * width // 4), rng.integers(height // 4, 3 * height // 4), height // 4
    colour = tuple(int(v) for v in (np.array([label * 67 % 256, label * 151 % 256, label * 199 % 256]) +
                                    rng.integers(-20, 20, 3)).clip(0, 255))
    shape = [(x - r, y - r, x + r, y + r)]
    (draw.rectangle if label % 3 == 0 else draw.ellipse if label % 3 == 1 else draw.chord)(
        *shape, *([] if label % 3 < 2 else [30, 300]), fill=colour)
    noisy = np.asarray(im).astype(np.int16) + rng.normal(0, 8, (height, width, 3)).astype(np.int16)
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def _write(job: tuple) -> None:
    root, i, classes, width, height, seed, quality = job
    label = i % classes
    _picture(i, label, width, height, seed).save(root / f"c{label:03d}" / f"{i:05d}.jpg", quality=quality)


def write_jpeg_folder(root: Path, n: int, classes: int, width: int = 500, height: int = 375,
                      seed: int = 0, quality: int = 90, processes: int = 1) -> Path:
    """root/c000/00000.jpg ...: n images, round-robin over `classes` class folders (in `processes`
    processes: Pillow's encoder holds the GIL for the picture drawing)."""
    for c in range(classes):
        (root / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    jobs = [(root, i, classes, width, height, seed, quality) for i in range(n)]
    if processes > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            pool.map(_write, jobs, chunksize=64)
    else:
        for job in jobs:
            _write(job)
    return root


def sample_folder(n: int = 10_000, classes: int = 100, width: int = 500, height: int = 375,
                  processes: int = 1) -> Path:
    """The generated folder in the cache, written once (atomically: a half-written folder is never used)."""
    out = cache_dir() / f"jpegs-v{FORMAT}-{n}x{classes}-{width}x{height}"
    if not out.is_dir():
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".jpegs-"))
        write_jpeg_folder(tmp, n, classes, width, height, processes=processes)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    return out
