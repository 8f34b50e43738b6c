"""JPEGs decoded on the GPU: the host reads the files' bytes, the device decodes them in one batched
nvJPEG call (`torchvision.io.decode_jpeg(..., device="cuda")`), then crops, flips, resizes and
normalises there. A 16-core host decodes 4-5k images a second, less than one H100 or H200 trains
ResNet-50 on; the GPU's JPEG decoder is what keeps it fed.

What nvJPEG is not given is decoded on the host as before (`decode.py`): files that are not baseline
JPEGs the header says are RGB or grey (PNGs, CMYK, EXIF-rotated, oversized), files whose header
cannot be read, and, when a batched decode fails, each file of that batch it cannot decode alone.
Crops are the host path's (same draws, same boxes); the resize runs in float on the device, so
pixels differ from the host path's by rounding (tests/unit/test_gpu_decode.py bounds it).
Where torchvision is not installed (or cannot load beside this torch) the host decodes everything,
and the run's start block says so.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import UserError
from .decode import MAX_PIXELS, BadImage, read_file
from .in_memory import _Normalizing

Decoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # file bytes -> (3, H, W) uint8 on the device


def nvjpeg(device: torch.device) -> tuple[Decoder | None, str]:
    """torchvision's batched GPU JPEG decoder for `device`, or None and why not."""
    if device.type != "cuda":
        return None, f"{device.type} has no JPEG decoder gpudl drives"
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as e:  # ImportError, or torchvision built for another torch (RuntimeError at import)
        return None, f"torchvision is not importable here ({type(e).__name__}: {str(e)[:80]})"
    return (lambda files: decode_jpeg(files, mode=ImageReadMode.RGB, device=device)), "nvJPEG via torchvision"


def on_device_decoding(source, device: torch.device, setting: str):
    """`source` (a folder's batches) decoding its JPEGs on `device` where `setting` and the machine allow;
    else `source` itself. `setting` "device" with no decoder there is the user's error, said before the run."""
    if setting == "host" or device.type == "cpu":
        source.decoding = "on the host (Pillow)"
        return source
    decoder, why = nvjpeg(device)
    if decoder is None:
        if setting == "device":
            raise UserError(f"data.decode=device, but {why}: install torchvision for this torch, or set data.decode=auto")
        source.decoding = f"on the host (Pillow; not on the GPU: {why})"
        return source
    return DeviceDecoded(source, decoder, why)


@dataclass
class HostFiles:
    """The files nvJPEG will decode: not a tensor, so the loader carries it as it is (nvJPEG reads host memory)."""

    data: list[torch.Tensor]                  # each file's bytes, uint8
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    slots: list[int]                          # where each goes in the batch
    redo: list[tuple[int, list[float], int]]  # (image, draws, slot): what the host decodes if nvJPEG refuses
    k: int


def _jpeg_header(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG nvJPEG can take as it is (RGB or grey, not rotated, not oversized), else None."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(data))
        if im.format != "JPEG" or im.mode not in ("RGB", "L") or im.getexif().get(0x0112, 1) != 1:
            return None
        w, h = im.size
    except Exception:  # the host path decides what is wrong with it, and counts it
        return None
    return (w, h) if w * h <= MAX_PIXELS else None


class DeviceDecoded(_Normalizing):
    """A folder source whose JPEGs decode on the GPU: `wire_batch` reads files, `on_device` decodes."""

    def __init__(self, host, decoder: Decoder, why: str):
        self.host, self.decoder = host, decoder
        self.mean, self.std = host.mean, host.std
        self.decoding = f"on the GPU ({why}); other files on the host"
        for name in ("per_epoch", "batches_per_pass", "bad", "parallel", "auto_workers", "index", "size"):
            if hasattr(host, name):
                setattr(self, name, getattr(host, name))

    def wire_batch(self, k: int):
        slots = self.host.slots(k)
        size = self.host.size
        images = torch.zeros(len(slots), 3, size, size, dtype=torch.uint8)
        labels = torch.empty(len(slots), dtype=torch.int64)
        files = HostFiles([], [], [], [], [], k)
        for slot, (i, u) in enumerate(slots):
            path = self.host.index.path(i)
            try:  # a file found bad before goes straight to the host's substitute, not to nvJPEG again
                data = b"" if self.host.bad.known(path) else read_file(path)
            except BadImage:
                data = b""
            shape = _jpeg_header(data) if data else None
            if shape is None:  # the host decodes it (or its substitute) as it always has
                image, labels[slot] = self.host.decoded(i, u, k, slot)
                images[slot] = image.permute(2, 0, 1)
                continue
            box_for, flip = self.host.crop_of(u)
            files.data.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            files.boxes.append(box_for(*shape))
            files.flips.append(flip)
            files.slots.append(slot)
            files.redo.append((i, u, slot))
            labels[slot] = self.host.labels[i]
        return files, images, labels

    def on_device(self, batch):
        files, images, labels = batch
        out = images.float()
        for slot, crop in zip(files.slots, self._decoded(files, images.device)):
            out[slot] = crop
        if self.mean.device != out.device:
            self.mean, self.std = self.mean.to(out.device), self.std.to(out.device)
        normed = (out / 255.0 - self.mean) / self.std
        return normed.contiguous(memory_format=torch.channels_last), labels

    def _decoded(self, files: HostFiles, device: torch.device) -> list[torch.Tensor]:
        """(3, S, S) float crops of the files, decoded in one batch; one by one where the batch fails."""
        if not files.data:
            return []
        try:
            pictures = self.decoder(files.data)
        except RuntimeError:  # nvJPEG refuses a whole batch for one bad file: find it, decode the rest
            pictures = [self._alone(data) for data in files.data]
        size = self.host.size
        crops = []
        for picture, box, flip, (i, u, slot) in zip(pictures, files.boxes, files.flips, files.redo):
            if picture is None:
                image, _ = self.host.decoded(i, u, files.k, slot)
                crops.append(image.permute(2, 0, 1).to(device).float())
                continue
            x, y, w, h = box
            crop = picture[None, :, y:y + h, x:x + w].float()
            crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
            crops.append(crop.flip(-1) if flip else crop)
        return crops

    def _alone(self, data: torch.Tensor) -> torch.Tensor | None:
        try:
            return self.decoder([data])[0]
        except RuntimeError:
            return None
