"""A streamed image folder's batches: pure functions of (seed, k) for a rank, whoever makes them, and
the standard augmentation's geometry against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from gpudl.data import DeviceLoader, build_data
from gpudl.config import DataConfig
from gpudl.data.images.augment import DRAWS, crop_draws, random_resized_crop
from gpudl.data.images.folder import FolderBatches, FolderEvalBatches
from gpudl.data.images.index import index_folder
from jpeg_folder import write_jpeg_folder
from gpudl.errors import UserError
from gpudl.models import resolve

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_jpeg_folder(tmp_path_factory.mktemp("jpegs") / "f", 48, 4, width=96, height=72)


def test_batch_k_is_a_function_of_seed_and_k(folder):
    idx = index_folder(folder)
    a, b = FolderBatches(idx, 24, 8, seed=5), FolderBatches(idx, 24, 8, seed=5)
    for k in (3, 0, 11, 3):  # out of order, into the second epoch (6 batches an epoch), repeated
        xa, ya = a.wire_batch(k)
        xb, yb = b.wire_batch(k)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.wire_batch(0)[0], FolderBatches(idx, 24, 8, seed=6).wire_batch(0)[0])
    assert not torch.equal(a.wire_batch(0)[0], a.wire_batch(6)[0])  # a new epoch: new order, new crops


def test_an_epoch_is_a_permutation_of_the_folder(folder):
    idx = index_folder(folder)
    source = FolderBatches(idx, 16, 8, seed=0, augment=False)
    seen = torch.cat([source.order.indices(k) for k in range(source.per_epoch)])
    assert sorted(seen.tolist()) == list(range(48))
    labels = torch.cat([source.wire_batch(k)[1] for k in range(source.per_epoch)])
    assert labels.tolist() == [int(idx.labels[i]) for i in seen.tolist()]


def test_two_ranks_hold_the_halves_of_one_process_batch(folder):
    idx = index_folder(folder)
    one = FolderBatches(idx, 24, 8, seed=2)
    halves = [FolderBatches(idx, 24, 4, seed=2, rank=r, world=2) for r in (0, 1)]
    for k in (0, 7):
        x, y = one.wire_batch(k)
        parts = [h.wire_batch(k) for h in halves]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_hands_out_the_same_batches_with_threads_or_none(folder, workers):
    idx = index_folder(folder)
    source = FolderBatches(idx, 16, 4, seed=9)
    loader = DeviceLoader(source, torch.device("cpu"), start=5, num_workers=workers)
    try:
        got = [next(loader) for _ in range(4)]
    finally:
        loader.close()
    assert ("2 threads" in loader.description) == (workers == 2)
    for k, (x, y) in zip(range(5, 9), got):
        ex, ey = source.batch(k)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_auto_workers_are_threads_for_a_folder():
    assert FolderBatches.auto_workers(16, accelerator=True) == 15
    assert FolderBatches.auto_workers(2, accelerator=False) == 2


def test_crop_draws_depend_on_seed_and_k_and_shard_by_rows():
    d = crop_draws(1, 4, slice(0, 8), 8)
    assert d.shape == (8, DRAWS) and torch.equal(d, crop_draws(1, 4, slice(0, 8), 8))
    assert torch.equal(crop_draws(1, 4, slice(4, 8), 8), d[4:])
    assert not torch.equal(crop_draws(1, 5, slice(0, 8), 8), d)
    assert not torch.equal(crop_draws(2, 4, slice(0, 8), 8), d)


def test_random_resized_crops_keep_to_their_scale_and_ratio():
    g = torch.Generator().manual_seed(0)
    areas, ratios = [], []
    for u in torch.rand(4000, DRAWS, generator=g, dtype=torch.float64).tolist():
        x, y, w, h = random_resized_crop(500, 375, u)
        assert 0 <= x and 0 <= y and x + w <= 500 and y + h <= 375 and w > 0 and h > 0
        areas.append(w * h / (500 * 375))
        ratios.append(w / h)
    assert 0.08 * 0.98 <= min(areas) and max(areas) <= 1.0
    assert 3 / 4 * 0.98 <= min(ratios) and max(ratios) <= 4 / 3 * 1.02
    # area uniform in [0.08, 1] where it fits: the mean of those that fit on the first try sits below 0.54
    assert 0.3 < sum(areas) / len(areas) < 0.6
    square = [random_resized_crop(400, 400, u) for u in torch.rand(4000, DRAWS, generator=g, dtype=torch.float64).tolist()]
    assert abs(sum(math.log(w / h) for _, _, w, h in square) / len(square)) < 0.01  # log-ratio symmetric about 0


def test_an_impossible_crop_falls_back_to_the_centre():
    never = [0.999, 0.0, 0.5, 0.5] * 10 + [0.9]  # 99.9% of the area at ratio 3/4 never fits a 10:1 strip
    assert random_resized_crop(1000, 100, never) == ((1000 - 133) // 2, 0, 133, 100)


def test_build_data_streams_a_folder_with_a_centre_cropped_validation(folder):
    d = build_data(DataConfig(path=str(folder), image_size=32, val_fraction=0.25), resolve("resnet18"),
                   batch_size=4, seed=0)
    assert isinstance(d.train, FolderBatches) and isinstance(d.val, FolderEvalBatches)
    assert d.model_fit == {"num_classes": 4, "in_channels": 3}
    assert "48 images, 4 classes, streamed" in d.description
    x, y = d.val.batch(0)
    assert x.dtype == torch.float32 and x.shape == (4, 3, 32, 32)
    assert torch.equal(d.val.batch(0)[0], x)  # evaluation has no randomness
    assert d.val.batches_per_pass == 3


def test_a_separate_validation_folder_keeps_the_training_folders_class_numbers(folder, tmp_path):
    # ImageNet's layout: val/ beside train/, here with only two of the four classes, so the
    # validation folder's own numbering (0, 1) differs from the training folder's.
    val_root = tmp_path / "val"
    kept = sorted(p.name for p in folder.iterdir())[2:]
    for name in kept:
        (val_root / name).mkdir(parents=True)
        for f in sorted((folder / name).iterdir())[:3]:
            (val_root / name / f.name).write_bytes(f.read_bytes())
    d = build_data(DataConfig(path=str(folder), val_path=str(val_root), image_size=32), resolve("resnet18"),
                   batch_size=4, seed=0)
    assert len(d.train.index) == 48 and len(d.val.index) == 6 and "validation: " in d.description
    train_index = index_folder(folder)
    want = [train_index.classes.index(n) for n in kept for _ in range(3)]
    assert d.val.labels.tolist() == want == [2, 2, 2, 3, 3, 3]


def test_a_validation_folder_with_unknown_classes_is_one_line(folder, tmp_path):
    (tmp_path / "val" / "zebra").mkdir(parents=True)
    (tmp_path / "val" / "zebra" / "a.jpg").write_bytes((next((folder / "c000").iterdir())).read_bytes())
    with pytest.raises(UserError, match="data.val_path .* class folders the training folder lacks \\(zebra\\)"):
        build_data(DataConfig(path=str(folder), val_path=str(tmp_path / "val"), image_size=32), resolve("resnet18"),
                   batch_size=4, seed=0)
    with pytest.raises(UserError, match="data.val_path is read beside an image folder"):
        build_data(DataConfig(kind="synthetic", val_path=str(tmp_path / "val")), resolve("resnet18"), 4, 0)
    with pytest.raises(UserError, match="data.val_path is read for image folders only"):
        build_data(DataConfig(val_path=str(tmp_path / "val")), resolve("gpt-tiny"), 4, 0)
