"""An image folder as real folders are: the index (links, hidden files, scale), the decoder against
Pillow's own resize, and every kind of bad file the issue names, each decoded for real."""

from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np
import pytest
import torch

from gpudl.data.images.augment import centre_crop
from gpudl.data.images.decode import MAX_PIXELS, BadImage, BadImages, decode_crop, read_file
from gpudl.data.images.folder import FolderBatches, FolderEvalBatches
from gpudl.data.images.index import index_folder
from jpeg_folder import write_jpeg_folder
from gpudl.errors import UserError

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


def whole(w: int, h: int):
    return (0, 0, w, h)


def jpeg_bytes(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=95, **kw)
    return buf.getvalue()


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def gradient(w: int = 64, h: int = 48) -> Image.Image:
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    return Image.fromarray(np.concatenate([np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)),
                                           np.full((h, w, 1), 90, np.float32)], axis=2).astype(np.uint8))


# --- the index -------------------------------------------------------------------------------------------------

def test_index_lists_images_by_class_sorted_and_leaves_out_the_rest(tmp_path):
    root = tmp_path / "data"
    for c in ("b", "a"):
        (root / c / "deeper").mkdir(parents=True)
    for p in ("a/2.jpg", "a/1.PNG", "a/deeper/3.jpeg", "b/x.webp", "a/notes.txt", "a/.hidden.jpg"):
        (root / p).write_bytes(b"")
    (root / ".cache").mkdir()
    (root / ".cache" / "z.jpg").write_bytes(b"")
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(b"")
    os.symlink(outside, root / "b" / "leak.jpg")            # leaves the folder: out
    os.symlink(root / "a" / "1.PNG", root / "b" / "same.jpg")  # stays inside: in, as its target
    os.symlink(tmp_path, root / "b" / "up")                  # a folder outside: out
    os.symlink(root / "a", root / "a" / "deeper" / "loop")   # a loop back: walked once
    idx = index_folder(root)
    assert idx.classes == ["a", "b"]
    rel = [os.path.relpath(idx.path(i), idx.root) for i in range(len(idx))]
    assert rel == ["a/1.PNG", "a/2.jpg", "a/deeper/3.jpeg", "a/1.PNG", "b/x.webp"]
    assert idx.labels.tolist() == [0, 0, 0, 1, 1]
    assert idx.left_out == {"links that leave the folder": 2, "files that are not images": 1}


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_text("x"), "is not a folder"),
    (lambda p: p.mkdir(), "holds no images in class subfolders"),
    (lambda p: (p.mkdir(), (p / "loose.jpg").write_bytes(b"")), "holds no images in class subfolders"),
])
def test_an_unusable_folder_is_one_line(tmp_path, make, words):
    path = tmp_path / "d"
    make(path)
    with pytest.raises(UserError, match=words) as e:
        index_folder(path)
    assert "\n" not in str(e.value)


def test_the_index_holds_paths_not_pixels_and_splits_like_a_permutation(tmp_path):
    root = tmp_path / "many"
    for c in range(10):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(500):
            (root / f"class{c}" / f"img_{i:06d}.jpg").write_bytes(b"")
    idx = index_folder(root)
    assert len(idx) == 5000
    per_file = (idx.packed.nbytes + idx.ends.nbytes + idx.labels.nbytes) / len(idx)
    assert per_file < 40, per_file  # "class3/img_000123.jpg" is 21 bytes, plus 12 of offsets and label
    train, val = idx.split(0.1, seed=3)
    paths = {train.path(i) for i in range(len(train))} | {val.path(i) for i in range(len(val))}
    assert len(val) == 500 and len(paths) == 5000
    assert val.labels.tolist() == [int(p.split("class")[1][0]) for p in (val.path(i) for i in range(len(val)))]


# --- decoding, against Pillow's own resize ---------------------------------------------------------------------

def test_decoded_crop_matches_pillow_resize_and_flips():
    im = gradient(80, 60)
    box = (10, 5, 50, 40)
    out = decode_crop(jpeg_bytes(im), 32, lambda w, h: box)
    assert out.shape == (32, 32, 3) and out.dtype == torch.uint8
    reference = np.asarray(Image.open(io.BytesIO(jpeg_bytes(im))).convert("RGB").resize(
        (32, 32), Image.BILINEAR, box=(10, 5, 60, 45))).astype(np.float32)
    assert np.abs(out.numpy().astype(np.float32) - reference).mean() < 2.0
    flipped = decode_crop(jpeg_bytes(im), 32, lambda w, h: box, flip=True)
    assert torch.equal(flipped, out.flip(1))


def test_draft_decodes_a_large_jpeg_at_reduced_scale_with_the_same_picture():
    im = gradient(1024, 768)
    data = jpeg_bytes(im)
    small = decode_crop(data, 64, lambda w, h: whole(w, h))  # 1024/64 = 16: drafted at 1/8
    reference = np.asarray(im.resize((64, 64), Image.BILINEAR)).astype(np.float32)
    assert np.abs(small.numpy().astype(np.float32) - reference).mean() < 3.0


def test_exif_rotation_is_applied_before_the_crop():
    im = gradient(60, 30)  # landscape as stored; orientation 6: shown turned a quarter, 30 x 60
    exif = Image.Exif()
    exif[0x0112] = 6
    seen = []
    out = decode_crop(jpeg_bytes(im, exif=exif), 16, lambda w, h: seen.append((w, h)) or whole(w, h))
    assert seen == [(30, 60)]
    shown = np.asarray(im.transpose(Image.Transpose.ROTATE_270).resize((16, 16), Image.BILINEAR)).astype(np.float32)
    assert np.abs(out.numpy().astype(np.float32) - shown).mean() < 3.0


@pytest.mark.parametrize("mode", ["CMYK", "L", "LA", "RGBA", "P"])
def test_every_mode_becomes_rgb(mode):
    im = gradient().convert(mode)
    data = jpeg_bytes(im) if mode in ("CMYK", "L") else png_bytes(im)
    out = decode_crop(data, 16, whole)
    assert out.shape == (16, 16, 3)
    reference = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((16, 16), Image.BILINEAR))
    assert np.abs(out.numpy().astype(np.float32) - reference.astype(np.float32)).mean() < 3.0


def test_sixteen_bit_png_keeps_its_top_eight_bits():
    grey = np.full((20, 20), 40_000, dtype=np.uint16)
    out = decode_crop(png_bytes(Image.fromarray(grey)), 8, whole)
    assert out.unique().tolist() == [40_000 >> 8]  # 156, where Pillow's own convert("RGB") gives 255


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims `width` x `height` (a decompression bomb's first bytes)."""
    data = bytearray(png_bytes(Image.new("L", (4, 4))))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


@pytest.mark.parametrize("data, words", [
    (b"", r"^an empty file \(0 bytes\)$"),
    (b"this is a text file that ends in .jpg", r"^not an image \(no format Pillow reads starts like it\)$"),
    (None, "truncated|broken|image file"),
    (_png_claiming(10_000, 10_000), "10000x10000 pixels, over the 89,478,485 allowed"),
], ids=["zero bytes", "text", "truncated", "too many pixels"])
def test_bad_files_are_bad_images_naming_the_reason(data, words):
    if data is None:  # truncated: the first half of a real JPEG
        whole_file = jpeg_bytes(gradient(200, 150))
        data = whole_file[:len(whole_file) // 2]
    with pytest.raises(BadImage, match=words) as caught:
        decode_crop(data, 16, whole)
    assert "object at 0x" not in str(caught.value)  # no `<_io.BytesIO object at 0x...>`: the reader names the file


@pytest.mark.parametrize("side", [10_000, 20_000])  # over our limit; over Pillow's own refusal too
def test_a_decompression_bomb_is_refused_before_decoding(side):
    assert side * side > MAX_PIXELS
    with pytest.raises(BadImage, match="decompression bomb"):
        decode_crop(_png_claiming(side, side), 16, whole)


def test_read_file_refuses_a_link_put_in_after_indexing(tmp_path):
    target = tmp_path / "elsewhere.jpg"
    target.write_bytes(jpeg_bytes(gradient()))
    link = tmp_path / "swapped.jpg"
    os.symlink(target, link)
    with pytest.raises(BadImage, match="cannot open"):
        read_file(str(link))
    assert read_file(str(target)) == target.read_bytes()


# --- a folder with bad files in it, through the batch source ---------------------------------------------------

def folder_with_bad_files(tmp_path):
    root = write_jpeg_folder(tmp_path / "mixed", 24, 2, width=64, height=48)
    (root / "c000" / "00000.jpg").write_bytes(b"")                                        # zero bytes
    (root / "c001" / "00001.jpg").write_bytes((root / "c001" / "00003.jpg").read_bytes()[:300])  # truncated
    (root / "c000" / "zz_text.png").write_text("not an image")                            # not an image
    return root


def test_bad_files_are_skipped_deterministically_and_counted(tmp_path):
    idx = index_folder(folder_with_bad_files(tmp_path))
    first = FolderBatches(idx, 16, 25, seed=1)   # 25 of the 25 files: every bad one is met in batch 0
    images, labels = first.wire_batch(0)
    assert images.shape == (25, 3, 16, 16) and first.bad.count == 3
    assert sorted(line.split(":")[0].rsplit("/", 1)[1] for line in first.bad.news()) == \
        ["00000.jpg", "00001.jpg", "zz_text.png"]
    assert first.bad.news() == []  # each named once
    again = FolderBatches(idx, 16, 25, seed=1)
    images2, labels2 = again.wire_batch(0)
    assert torch.equal(images, images2) and torch.equal(labels, labels2)  # the same substitutes


def test_each_bad_file_is_counted_and_named_once_by_its_relative_path_across_epochs(tmp_path):
    """Training over 4 epochs and 3 evaluations of the same folder meet each bad file 7 times."""
    root = write_jpeg_folder(tmp_path / "photos", 21, 3, width=64, height=48)
    (root / "c000" / "empty.jpg").write_bytes(b"")
    (root / "c001" / "cut.jpg").write_bytes((root / "c001" / "00001.jpg").read_bytes()[:300])
    (root / "c002" / "notes.jpg").write_text("a text file named .jpg")
    idx = index_folder(root)
    bad = BadImages()
    train = FolderBatches(idx, 16, len(idx), seed=3, bad=bad)  # one batch is one epoch: every file each time
    val = FolderEvalBatches(idx, 16, 8, bad=bad)
    for k in range(4):
        train.wire_batch(k)
        if k:
            [val.wire_batch(j) for j in range(val.batches_per_pass)]
    named = bad.news()
    assert bad.count == 3 and len(named) == 3
    assert sorted(line.split(": ", 1)[0] for line in named) == ["c000/empty.jpg", "c001/cut.jpg", "c002/notes.jpg"]
    assert not any("BytesIO" in line or str(root) in line for line in named), named
    assert bad.news() == []


def test_bad_images_error_stops_naming_the_file(tmp_path):
    idx = index_folder(folder_with_bad_files(tmp_path))
    source = FolderBatches(idx, 16, 25, seed=1, bad=BadImages("error"))
    with pytest.raises(UserError, match=r"cannot use image '.*(00000.jpg|00001.jpg|zz_text.png)'.*bad_images=skip"):
        source.wire_batch(0)


def test_a_folder_of_nothing_but_bad_files_is_one_clear_error(tmp_path):
    root = tmp_path / "junk"
    (root / "a").mkdir(parents=True)
    for i in range(20):
        (root / "a" / f"{i}.jpg").write_bytes(b"nope")
    with pytest.raises(UserError, match="in a row could not be decoded.*is it a folder of images"):
        FolderBatches(index_folder(root), 8, 4, seed=0).wire_batch(0)


def test_centre_crop_is_resize_then_crop():
    # 500 x 375 at 224 px: shorter side to 256, centre 224 -> 375 * 224 / 256 = 328 px of the original
    assert centre_crop(500, 375, 224) == ((500 - 328) // 2, (375 - 328) // 2, 328, 328)
