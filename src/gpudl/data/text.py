"""Token streams for language models: bytes of text, or a pre-tokenised token file, memory-mapped.

The embedded default corpus needs no download: the Python standard library's own source
files, read as bytes (vocabulary 256), written once to a token file in the cache directory.

Batch k is a pure function of (seed, k): `batch_size * world` random windows are drawn for
the whole job and each data-parallel rank takes its own rows. Resuming at batch k, or
splitting a batch across ranks, therefore gives exactly the data of an uninterrupted,
single-process run.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..cache import cache_dir

# Parts of the standard library that are data-like or test fixtures rather than typical code.
# Bump when the way files become a token file changes, so cached corpora are rebuilt.
CORPUS_FORMAT = 1

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


@functools.cache  # the installed standard library does not change while a process runs; walking it takes a second
def stdlib_sources() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(p for p in sorted(root.rglob("*.py")) if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")]


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


@functools.cache
def _stdlib_fingerprint() -> str:
    return _fingerprint(stdlib_sources())


def _write_bytes_file(files: list[Path], out: Path) -> None:
    """Concatenate the files (skipping binaries) into `out`, atomically."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tokens-")
    with os.fdopen(fd, "wb") as f:
        for p in files:
            data = p.read_bytes().rstrip(b"\n")
            if data and b"\x00" not in data[:4096]:  # a NUL byte marks a binary file, not text
                f.write(data + b"\n\n")
    os.replace(tmp, out)


def byte_corpus(path: str | None) -> Path:
    """The byte-level token file for a text file or folder (None: the standard library), cached."""
    if path is None:
        files, label = stdlib_sources(), "stdlib"
        fingerprint = _stdlib_fingerprint()
    else:
        src = Path(path).expanduser()
        if not src.exists():
            raise UserError(f"data.path {path!r} does not exist: point it at a text file or a folder of text files")
        files, label = _text_files(src), src.name
        fingerprint = _fingerprint(files) if files else ""
    if not files:
        raise UserError(f"data.path {path!r} holds no files: add text files or choose another folder")
    out = cache_dir() / f"text-v{CORPUS_FORMAT}-{label}-{fingerprint}.u8"
    if not out.exists():
        _write_bytes_file(files, out)
    if out.stat().st_size == 0:
        raise UserError(f"data.path {path!r} holds no text (only empty or binary files)")
    return out


class TokenStream:
    """A memory-mapped 1-D array of token ids, split into train and validation parts."""

    def __init__(self, file: Path, dtype: str = "uint8", val_fraction: float = 0.05):
        try:
            self.tokens = np.memmap(file, dtype=np.dtype(dtype), mode="r")
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read token file {str(file)!r} as {dtype}: {e}") from e
        if len(self.tokens) == 0:
            raise UserError(f"token file {str(file)!r} is empty")
        self.file = file
        self.vocab_size = 256 if dtype == "uint8" else int(self.tokens.max()) + 1
        self.split_at = int(len(self.tokens) * (1.0 - val_fraction))

    def part(self, split: str) -> np.ndarray:
        return self.tokens[: self.split_at] if split == "train" else self.tokens[self.split_at:]

    def fingerprint(self) -> str:
        """sha256 of the token file, for tests that must know which corpus they ran on."""
        return hashlib.sha256(Path(self.file).read_bytes()).hexdigest()


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

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        starts = torch.randint(0, len(self.tokens) - self.block_size - 1, (self.batch_size * self.world,),
                               generator=g).numpy()
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        windows = torch.from_numpy(self.tokens[mine[:, None] + self.offsets].astype(np.int64))  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]
