"""Token streams for language models: bytes of text, or a token file, memory-mapped.

The embedded default corpus needs no download: the Python standard library's own source
files, read as bytes (vocabulary 256), written once to a token file in the cache directory.
Text through a tokenizer (BPE) becomes a token file in `tokenise.py`; both are read here.

Batch k is a pure function of (seed, k): `batch_size * world` random windows are drawn for
the whole job and each data-parallel rank takes its own rows. Resuming at batch k, or
splitting a batch across ranks, therefore gives exactly the data of an uninterrupted,
single-process run.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

from ...errors import UserError
from ...cache import atomic_file, cache_dir
from .sources import Corpus, file_fingerprint, find_corpus, stdlib_sources

# Bump when the way files become a token file changes, so cached corpora are rebuilt.
CORPUS_FORMAT = 1

__all__ = ["CORPUS_FORMAT", "ResidentTextBatches", "TextBatches", "TokenStream", "byte_corpus", "byte_file",
           "stdlib_sources"]


@functools.cache
def _stdlib_fingerprint() -> str:
    return file_fingerprint(stdlib_sources())


def _write_bytes_file(files: list[Path], out: Path) -> None:
    """Concatenate the files (skipping binaries) into `out`, atomically."""
    with atomic_file(out) as f:
        for p in files:
            data = p.read_bytes().rstrip(b"\n")
            if data and b"\x00" not in data[:4096]:  # a NUL byte marks a binary file, not text
                f.write(data + b"\n\n")


def byte_corpus(path: str | None) -> Path:
    """The byte-level token file for a text file or folder (None: the standard library), cached."""
    return byte_file(find_corpus(path))


def byte_file(corpus: Corpus) -> Path:
    """The byte-level token file of a corpus of text files: their bytes as they are, each followed by
    a blank line, cached (a file's bytes need no decoding, so text in any encoding trains)."""
    assert corpus.plain_text, "tables go through tokenise.token_file"
    files = [s.path for s in corpus.sources]
    fingerprint = _stdlib_fingerprint() if corpus.path is None else file_fingerprint(files)
    out = cache_dir() / f"text-v{CORPUS_FORMAT}-{corpus.label}-{fingerprint}.u8"
    if not out.exists():
        _write_bytes_file(files, out)
    if out.stat().st_size == 0:
        raise UserError(f"data.path {corpus.path_label!r} holds no text (only empty or binary files)")
    return out


class TokenStream:
    """A memory-mapped 1-D array of token ids, split into train and validation parts."""

    def __init__(self, file: Path, dtype: str = "uint8", val_fraction: float = 0.05, split_at: int | None = None):
        try:
            self.tokens = np.memmap(file, dtype=np.dtype(dtype), mode="r")
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read token file {str(file)!r} as {dtype}: {e}") from e
        if len(self.tokens) == 0:
            raise UserError(f"token file {str(file)!r} is empty")
        self.file = file
        self.vocab_size = 256 if dtype == "uint8" else int(self.tokens.max()) + 1
        # a token file made from text knows where its validation text starts (`tokenise.py`)
        self.split_at = int(len(self.tokens) * (1.0 - val_fraction)) if split_at is None else split_at

    def part(self, split: str) -> np.ndarray:
        return self.tokens[: self.split_at] if split == "train" else self.tokens[self.split_at:]

    def fingerprint(self) -> str:
        """sha256 of the token file, for tests that must know which corpus they ran on."""
        return hashlib.sha256(Path(self.file).read_bytes()).hexdigest()


# A token set up to this share of the device's memory lives there: batches are then drawn on the
# device with no host work and no copy (GPT-2's 9B-token OpenWebText in uint16 is 18 GB, too big
# for this; the default corpus, 20 MB, is not).
RESIDENT_SHARE = 0.05


def _device_memory(device: torch.device) -> int | None:
    try:
        return int(torch.get_device_module(device.type).get_device_properties(device).total_memory)
    except (AttributeError, RuntimeError, AssertionError):  # a device type without that query
        return None


def _storage_dtype(tokens: np.ndarray) -> type | None:
    """The smallest dtype that holds these ids exactly and that torch indexes on every device
    (uint16 and uint32 are not among them)."""
    if tokens.dtype == np.uint8:
        return np.uint8
    top = int(tokens.max())
    for dtype in (np.int16, np.int32):
        if top <= np.iinfo(dtype).max:
            return dtype
    return None


class TextBatches:
    """Batch source: (x, y) token windows, y shifted by one; rows for one data-parallel rank."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1):
        if len(tokens) <= block_size + 1:
            raise UserError(f"the data has {len(tokens)} tokens, fewer than one window of block_size+1="
                            f"{block_size + 1}: use more text or a smaller model.block_size")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.rank, self.world = seed, rank, world
        self.offsets = np.arange(block_size + 1)

    def starts(self, k: int) -> torch.Tensor:
        """This rank's window starts for batch k, drawn for the whole job on the CPU."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        starts = torch.randint(0, len(self.tokens) - self.block_size - 1, (self.batch_size * self.world,),
                               generator=g)
        return starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.starts(k).numpy()
        windows = torch.from_numpy(self.tokens[mine[:, None] + self.offsets].astype(np.int64))  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]

    def resident_on(self, device: torch.device, budget_bytes: int | None = None) -> ResidentTextBatches | None:
        """The same batches drawn on `device` from a copy of the tokens there, or None where the
        tokens take more than `budget_bytes` (default: RESIDENT_SHARE of the device's memory)."""
        if budget_bytes is None:
            memory = _device_memory(device)
            budget_bytes = 0 if memory is None else int(memory * RESIDENT_SHARE)
        if self.tokens.nbytes > budget_bytes:
            return None
        dtype = _storage_dtype(self.tokens)
        if dtype is None or len(self.tokens) * np.dtype(dtype).itemsize > budget_bytes:
            return None
        held = torch.from_numpy(np.asarray(self.tokens).astype(dtype))  # a copy: the memmap stays read-only
        return ResidentTextBatches(self, held.to(device))


class ResidentTextBatches:
    """TextBatches whose tokens sit on the device: the starts (a few hundred numbers) are drawn on
    the CPU by the same generator, so every batch is bit-identical to the host-made one."""

    def __init__(self, host: TextBatches, tokens: torch.Tensor):
        self.host, self.tokens = host, tokens
        self.offsets = torch.arange(host.block_size + 1, device=tokens.device)

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.host.starts(k).to(self.tokens.device)
        windows = self.tokens[starts[:, None] + self.offsets].long()  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]
