"""The GPU-decoding half of a folder source, driven here by a real JPEG decoder of the host's (Pillow,
handed the same file bytes nvJPEG would get): which files go to the device decoder, the crops, flips
and normalisation done after it, and the fall-back to the host for what it cannot take. nvJPEG itself
runs in `scripts/gpu-check --only input-pipeline` on a GPU machine."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from gpudl.data.images.folder import FolderBatches, FolderEvalBatches
from gpudl.data.images.index import index_folder
from gpudl.data.images.gpu_decode import DeviceDecoded, nvjpeg, on_device_decoding
from jpeg_folder import write_jpeg_folder
from gpudl.errors import UserError

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


class PillowAsDevice:
    """Decodes a list of JPEG byte tensors to (3, H, W) uint8, as torchvision's decode_jpeg does; like it,
    a batch with one undecodable file fails whole (RuntimeError). Counts what it was given."""

    def __init__(self):
        self.given = 0

    def __call__(self, files):
        self.given += len(files)
        out = []
        for f in files:
            try:
                im = Image.open(io.BytesIO(f.numpy().tobytes())).convert("RGB")
                out.append(torch.from_numpy(np.array(im)).permute(2, 0, 1))
            except Exception as e:
                raise RuntimeError(f"decode failed: {e}") from e
        return out


@pytest.fixture()
def folder(tmp_path):
    root = write_jpeg_folder(tmp_path / "f", 16, 2, width=120, height=90)
    Image.open(root / "c000" / "00002.jpg").save(root / "c000" / "00002.png")  # a PNG: the host's
    (root / "c001" / "00003.jpg").write_bytes((root / "c001" / "00005.jpg").read_bytes()[:400])  # truncated
    return root


# Crops of 120 x 90 images at 64 px are never 2x the output: the host path decodes them at full size
# too (no draft), so both halves resize the same pixels.
def pixels(source, x):
    return (x * source.std + source.mean) * 255


@pytest.mark.parametrize("augment", [True, False])
def test_device_half_matches_the_host_path(folder, augment):
    host = FolderBatches(index_folder(folder), 64, 17, seed=4, augment=augment)
    reference = FolderBatches(index_folder(folder), 64, 17, seed=4, augment=augment)
    decoder = PillowAsDevice()
    gpu = DeviceDecoded(host, decoder, "test decoder")
    x, y = gpu.batch(0)
    ex, ey = reference.batch(0)
    assert torch.equal(y, ey)
    assert x.shape == ex.shape and x.is_contiguous(memory_format=torch.channels_last)
    diff = (pixels(gpu, x) - pixels(reference, ex)).abs()
    assert diff.mean() < 1.0 and diff.max() < 16  # float resize against uint8 resize: rounding only
    # the PNG went to the host; the truncated JPEG failed the batch, was tried alone, and was substituted
    assert 0 < decoder.given and host.bad.count == 1 and reference.bad.count == 1


def test_a_file_the_device_could_not_decode_is_counted_once_and_not_given_to_it_again(folder):
    whole = (folder / "c001" / "00005.jpg").read_bytes()
    (folder / "c001" / "00003.jpg").write_bytes(whole[:len(whole) // 2])  # its header whole: it goes to the device
    decoder = PillowAsDevice()
    gpu = DeviceDecoded(FolderBatches(index_folder(folder), 64, 17, seed=4), decoder, "test decoder")
    gpu.batch(0)  # epoch 0: 16 JPEGs fail as a batch (the truncated one), then go one by one
    assert decoder.given == 32 and gpu.bad.count == 1
    for k in range(1, 4):  # epochs 1-3: the 15 good JPEGs only, in one batch each
        gpu.batch(k)
        assert decoder.given == 32 + 15 * k
    assert gpu.bad.count == 1 and [line.split(": ")[0] for line in gpu.bad.news()] == ["c001/00003.jpg"]


def test_evaluation_batches_decode_on_the_device_too(folder):
    idx = index_folder(folder)
    gpu = DeviceDecoded(FolderEvalBatches(idx, 64, 8), PillowAsDevice(), "test decoder")
    x, y = gpu.batch(1)
    ex, ey = FolderEvalBatches(idx, 64, 8).batch(1)
    assert torch.equal(y, ey) and (pixels(gpu, x) - pixels(gpu, ex)).abs().mean() < 1.0
    assert gpu.batches_per_pass == 3


def test_where_there_is_no_gpu_decoder_the_host_decodes_and_says_so(folder):
    host = FolderBatches(index_folder(folder), 32, 4, seed=0)
    assert on_device_decoding(host, torch.device("cpu"), "auto") is host
    assert "on the host" in host.decoding
    decoder, why = nvjpeg(torch.device("cuda"))
    if decoder is None:  # this machine: torchvision is absent or cannot load beside this torch
        assert "torchvision" in why
        with pytest.raises(UserError, match="data.decode=device, but torchvision"):
            on_device_decoding(host, torch.device("cuda"), "device")
        assert on_device_decoding(host, torch.device("cuda"), "auto") is host and "not on the GPU" in host.decoding
