"""The index of an image folder: which files, in which class, and nothing of their pixels.

`root/<class>/.../<image>` as two compact arrays (the paths packed into one byte buffer, the labels
as int32), so a folder of a million files costs tens of megabytes, not the pixels' hundreds of
gigabytes, and the training process's memory does not grow with the data set.

The folder is somebody else's: links are followed only where they stay inside it (a link to
`/etc/shadow` or to another user's files is left out and counted), hidden files and files of
other kinds are ignored, and a folder that cannot feed a run is one clear line before anything starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class FolderIndex:
    """Image files under `root` (paths relative to it, packed) and their class numbers."""

    root: Path
    classes: list[str]
    packed: np.ndarray       # uint8: every relative path's bytes, one after another
    ends: np.ndarray         # int64: where each path ends in `packed`
    labels: np.ndarray       # int32
    left_out: dict[str, int] = field(default_factory=dict)  # why files were not indexed: how many

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.relative(i))

    def relative(self, i: int) -> str:
        """Image i's path relative to the folder: how messages name it."""
        start = int(self.ends[i - 1]) if i else 0
        return os.fsdecode(self.packed[start:int(self.ends[i])].tobytes())

    def subset(self, idx: np.ndarray) -> FolderIndex:
        starts = np.concatenate(([0], self.ends[:-1]))[idx]
        lengths = self.ends[idx] - starts
        packed = np.concatenate([self.packed[s:s + n] for s, n in zip(starts, lengths)]) if len(idx) else self.packed[:0]
        return FolderIndex(self.root, self.classes, packed, np.cumsum(lengths), self.labels[idx], self.left_out)

    def in_classes(self, classes: list[str], setting: str) -> FolderIndex:
        """This index with its labels numbered as in `classes` (a validation folder read beside its
        training folder: the same class names, perhaps fewer of them)."""
        unknown = sorted(set(self.classes) - set(classes))
        if unknown:
            raise UserError(f"{setting} {str(self.root)!r} has class folders the training folder lacks "
                            f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}): give both the same "
                            f"class subfolders")
        number = np.array([classes.index(c) for c in self.classes], dtype=np.int32)
        return FolderIndex(self.root, list(classes), self.packed, self.ends, number[self.labels], self.left_out)

    def split(self, val_fraction: float, seed: int) -> tuple[FolderIndex, FolderIndex]:
        """(train, validation) parts, drawn as `ImageSet.split` draws them."""
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed)).numpy()
        n_val = max(1, int(len(perm) * val_fraction)) if val_fraction > 0 else 0
        return self.subset(np.sort(perm[n_val:])), self.subset(np.sort(perm[:n_val]))


def index_folder(root: Path, setting: str = "data.path") -> FolderIndex:
    """Walk `root/<class>/...` (sorted, so every process and every run sees one order); `setting`
    names where the folder came from in an error."""
    if not root.is_dir():
        raise UserError(f"{setting} {str(root)!r} is not a folder: point it at a folder of class subfolders")
    real_root = os.path.realpath(root)
    walk = _Walk(real_root)
    classes = sorted(e.name for e in _entries(real_root) if not e.name.startswith(".") and walk.is_dir(e))
    chunks, labels = [], []
    for label, name in enumerate(classes):
        for rel in walk.files(os.path.join(real_root, name)):
            chunks.append(os.fsencode(rel))
            labels.append(label)
    if not chunks:
        raise UserError(f"{setting} {str(root)!r} holds no images in class subfolders (expected "
                        f"{root}/<class>/<image>.jpg; suffixes {', '.join(IMAGE_SUFFIXES)})")
    packed = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    ends = np.cumsum(np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks)))
    return FolderIndex(Path(real_root), classes, packed, ends, np.asarray(labels, dtype=np.int32), walk.left_out)


def _entries(folder: str) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


class _Walk:
    """Image files under a folder, links resolved and kept only when they stay inside the root."""

    def __init__(self, root: str):
        self.root, self.left_out, self._seen = root, {}, set()

    def _count(self, why: str) -> None:
        self.left_out[why] = self.left_out.get(why, 0) + 1

    def _resolve(self, entry: os.DirEntry) -> tuple[str | None, bool, bool]:
        """(real path, is a folder, is a file); a link that leaves the root gives (None, False, False)."""
        if not entry.is_symlink():  # the common case costs no system call: scandir knows the type
            return entry.path, entry.is_dir(follow_symlinks=False), entry.is_file(follow_symlinks=False)
        target = os.path.realpath(entry.path)
        if os.path.commonpath((self.root, target)) != self.root:
            self._count("links that leave the folder")
            return None, False, False
        return target, os.path.isdir(target), os.path.isfile(target)

    def is_dir(self, entry: os.DirEntry) -> bool:
        return self._resolve(entry)[1]

    def files(self, folder: str):
        """Relative paths (to the root) of the image files under `folder`, depth first, sorted."""
        if folder in self._seen:  # a link back to a folder already walked: no loops, no duplicates
            return
        self._seen.add(folder)
        prefix = os.path.relpath(folder, self.root) + os.sep
        for entry in _entries(folder):
            if entry.name.startswith("."):
                continue
            real, is_dir, is_file = self._resolve(entry)
            if is_dir:
                yield from self.files(os.path.realpath(real))
            elif real is None or not is_file:
                continue
            elif not entry.name.lower().endswith(IMAGE_SUFFIXES):
                self._count("files that are not images")
            else:
                yield prefix + entry.name if real == entry.path else os.path.relpath(real, self.root)
