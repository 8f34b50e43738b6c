"""Data for a run: which source feeds which model, split into train and validation parts.

>>> from gpudl.config import DataConfig
>>> from gpudl.models import resolve
>>> d = build_data(DataConfig(kind="synthetic"), resolve("gpt-tiny"), batch_size=2, seed=0)
>>> [tuple(t.shape) for t in d.train.batch(0)]
[(2, 128), (2, 128)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig
from ..errors import UserError
from ..models import ModelSpec
from .images.decode import BadImages
from .images.folder import FolderBatches, FolderEvalBatches
from .images.index import index_folder
from .images.in_memory import ImageBatches, ImageEvalBatches, load_images
from .loader import Batch, BatchSource, DeviceLoader, first_batches, usable_cores
from .synthetic import SyntheticImages, SyntheticTokens
from .text.streams import TextBatches, TokenStream
from .text.tokens import text_tokens
from .tokenizer import Tokenizer

NO_VAL = "data.val_fraction is 0: set it > 0 to hold out part of the data"
KINDS_FOR = {"gpt": ("text", "tokens", "synthetic"), "resnet": ("images", "synthetic")}


@dataclass
class Data:
    """Train and validation batch sources, and what one sample is."""

    train: BatchSource
    val: BatchSource | None
    unit: str                      # what throughput counts: "tokens" or "images"
    units_per_sample: int          # tokens per sequence, or 1 image
    description: str
    model_fit: dict = field(default_factory=dict)  # model settings the data implies (classes, channels)
    vocab_size: int | None = None
    no_val: str = ""               # why there is no validation part (when `val` is None)
    tokenizer: Tokenizer | None = None       # text's tokenizer (None: token ids of unknown text)
    bytes_per_token: float | None = None     # UTF-8 bytes of validation text per validation token (bits per byte)

    def eval_batches(self, wanted: int) -> int:
        """How many validation batches to evaluate: `wanted`, but one pass at most of a finite set."""
        return min(wanted, getattr(self.val, "batches_per_pass", wanted))


def build_data(cfg: DataConfig, spec: ModelSpec, batch_size: int, seed: int, rank: int = 0, world: int = 1,
               eval_batch_size: int | None = None, tokenizer: Tokenizer | None = None) -> Data:
    """The data source for model `spec`, sharded for data-parallel `rank` of `world`: training
    batches of `batch_size` rows, validation batches of `eval_batch_size` (default: the same).
    `tokenizer`: the one a run folder kept (a resumed or evaluated run), used for text instead of
    data.tokenizer."""
    sizes = (batch_size, eval_batch_size or batch_size)
    kind = cfg.kind if cfg.kind != "auto" else KINDS_FOR[spec.family][0]
    if kind not in KINDS_FOR[spec.family]:
        raise UserError(f"data.kind={kind!r} cannot feed {spec.name}; use one of: {', '.join(KINDS_FOR[spec.family])}")
    if spec.family == "gpt":
        return _token_data(cfg, kind, spec, sizes, seed, rank, world, tokenizer)
    return _image_data(cfg, kind, spec, sizes, seed, rank, world)


def _token_data(cfg, kind, spec, sizes, seed, rank, world, tokenizer) -> Data:
    block, (batch_size, eval_size) = spec.config.block_size, sizes
    if cfg.val_path:
        raise UserError("data.val_path is read for image folders only: hold out part of the text with "
                        "data.val_fraction, or drop data.val_path")
    if kind == "synthetic":
        v = spec.config.vocab_size
        return Data(SyntheticTokens(v, block, batch_size, seed + rank), SyntheticTokens(v, block, eval_size, seed + 10**6),
                    "tokens", block, f"random tokens (vocab {v})", vocab_size=v)
    if kind == "text":
        text = text_tokens(cfg, spec.config.vocab_size, tokenizer, show=rank == 0)
        stream, description, tokenizer, per_token = text.stream, text.description, text.tokenizer, text.bytes_per_token
    else:
        if cfg.path is None or not Path(cfg.path).is_file():
            raise UserError(f"data.kind='tokens' needs data.path to be a token file, got {cfg.path!r}")
        stream, per_token = TokenStream(Path(cfg.path), cfg.token_dtype, cfg.val_fraction), None
        description = f"{cfg.path}: {len(stream.tokens):,} tokens ({cfg.token_dtype})"
    if stream.vocab_size > spec.config.vocab_size:
        raise UserError(f"the data has token ids up to {stream.vocab_size - 1} but model.vocab_size="
                        f"{spec.config.vocab_size}: set --set model.vocab_size={stream.vocab_size}")
    train = TextBatches(stream.part("train"), block, batch_size, seed, rank, world)
    val_part = stream.part("val")
    val = TextBatches(val_part, block, eval_size, seed + 1, rank, world) if len(val_part) > block + 1 else None
    no_val = "" if val else NO_VAL if not cfg.val_fraction else \
        (f"data.val_fraction={cfg.val_fraction} leaves {len(val_part):,} tokens for validation, fewer than one "
         f"window of model.block_size+1={block + 1}: raise data.val_fraction")
    vocab = tokenizer.vocab_size if kind == "text" else stream.vocab_size
    return Data(train, val, "tokens", block, description, vocab_size=vocab, no_val=no_val, tokenizer=tokenizer,
                bytes_per_token=per_token)


def _image_data(cfg, kind, spec, sizes, seed, rank, world) -> Data:
    c, (batch_size, eval_size) = spec.config, sizes
    if cfg.val_path and (kind == "synthetic" or cfg.path in (None, "sklearn:digits")):
        raise UserError("data.val_path is read beside an image folder (data.path=FOLDER) only: drop it, or "
                        "point data.path at the training folder")
    if kind == "synthetic":
        def make(s, rows):
            return SyntheticImages(c.in_channels, cfg.image_size, c.num_classes, rows, s)
        return Data(make(seed + rank, batch_size), make(seed + 10**6, eval_size), "images", 1,
                    f"random {c.in_channels}x{cfg.image_size}x{cfg.image_size} images, {c.num_classes} classes")
    if kind != "synthetic" and cfg.path not in (None, "sklearn:digits"):
        return _folder_data(cfg, sizes, seed, rank, world)
    images = load_images(cfg.path, cfg.image_size, seed)
    train, val = images.split(cfg.val_fraction, seed)
    what = cfg.path or "generated shapes"
    fit = {"num_classes": len(images.classes), "in_channels": images.images.shape[1]}
    batches = ImageBatches(train, batch_size, seed, rank, world)
    val_set = ImageEvalBatches(val, eval_size, batches.mean, batches.std, rank, world) if len(val.labels) else None
    return Data(batches, val_set, "images", 1, f"{what}: {len(images.labels):,} images, {len(images.classes)} classes",
                model_fit=fit, no_val="" if val_set else NO_VAL)


def _folder_data(cfg, sizes, seed, rank, world) -> Data:
    """An image folder, indexed now and decoded batch by batch as the run goes (`folder.py`)."""
    (batch_size, eval_size), size = sizes, cfg.image_size
    index = index_folder(Path(cfg.path).expanduser())
    if cfg.val_path:  # ImageNet's layout: train/ and val/ side by side
        train, val = index, index_folder(Path(cfg.val_path).expanduser(), "data.val_path").in_classes(
            index.classes, "data.val_path")
    else:
        train, val = index.split(cfg.val_fraction, seed)
    bad = BadImages(cfg.bad_images)
    batches = FolderBatches(train, size, batch_size, seed, rank, world, bad, augment=cfg.augment, decode=cfg.decode)
    val_set = FolderEvalBatches(val, size, eval_size, rank, world, bad, threads=usable_cores(),
                                decode=cfg.decode) if len(val) else None
    crops = "random-resized crops and flips" if cfg.augment else "centre crops"
    left = "".join(f"; left out: {n:,} {why}" for why, n in index.left_out.items())
    return Data(batches, val_set, "images", 1,
                f"{cfg.path}: {len(index):,} images, {len(index.classes)} classes, streamed ({crops} at {size} px, "
                f"decoded as batches are wanted){left}" + (f"; validation: {cfg.val_path}, {len(val):,} images"
                                                         if cfg.val_path else ""),
                model_fit={"num_classes": len(index.classes), "in_channels": 3}, no_val="" if val_set else NO_VAL)

__all__ = ["Data", "build_data", "Batch", "BatchSource", "DeviceLoader", "first_batches", "usable_cores"]
