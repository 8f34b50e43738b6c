"""Reading a DCP checkpoint without ever running code from it.

A checkpoint comes from other people and machines, so its bytes are untrusted input.
`torch.distributed.checkpoint`'s own `FileSystemReader` unpickles `.metadata` with plain
pickle (a crafted file runs any command it likes) and its default planner loads non-tensor
entries with `weights_only=False`. Here:

- `.metadata` goes through `MetadataUnpickler`, which resolves only the classes DCP's metadata
  is made of (its dataclasses and enums, `torch.Size`, dtypes and layouts, paths as pure paths)
  and refuses every other global: a payload's `os.system` is never even looked up;
- every file the metadata points to must be a plain file of this checkpoint folder;
- tensors load as DCP loads them (`torch.load(weights_only=True)`), non-tensor entries too
  (`SafeLoadPlanner`), and a file that fails is named in the error.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
import re
from collections import OrderedDict, defaultdict
from pathlib import Path

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.futures import Future

METADATA_FILE = ".metadata"


def _why_refused(e: Exception) -> str:
    """What torch.load(weights_only=True) objected to, without its advice to load unsafely instead."""
    text = str(e)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it refers to {found.group(1)}, which is not checkpoint data"
    if text.startswith("Weights only load failed"):
        return "torch.load(weights_only=True) refused it"
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else 'no detail'}"


class UnsafeCheckpointFile(Exception):
    """A checkpoint file that gpudl will not load: it holds something that is not checkpoint data."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why

    def __reduce__(self):  # DCP gathers a rank's failure to every rank by pickling it
        return type(self), (self.name, self.why)


def _dcp_metadata_class(name: str):
    """A dataclass or enum defined by DCP's metadata module (never a function it imports)."""
    obj = getattr(dcp_metadata, name, None)
    is_own_type = isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
    return obj if is_own_type and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)) else None


# Paths in metadata (the checkpoint id it was saved under) are only data: pure paths never touch
# the file system, and a Windows path read on Linux stays readable.
_PATHS = {"PosixPath": pathlib.PurePosixPath, "PurePosixPath": pathlib.PurePosixPath,
          "WindowsPath": pathlib.PureWindowsPath, "PureWindowsPath": pathlib.PureWindowsPath}


def _allowed_global(module: str, name: str):
    """The object `module.name` may stand for in checkpoint metadata, or None."""
    if module == dcp_metadata.__name__:
        return _dcp_metadata_class(name)
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        return _StorageInfo
    if module == "torch":
        if name == "Size":
            return torch.Size
        obj = getattr(torch, name, None)
        return obj if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if module == "torch.serialization" and name == "_get_layout":  # how torch pickles a layout: by its name
        return torch.serialization._get_layout
    if module == "pathlib":
        return _PATHS.get(name)
    if module == "collections" and name == "OrderedDict":
        return OrderedDict
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Plain data and DCP's own metadata types only; any other global is refused before it is looked up.

    Globals are the only way a pickle reaches a callable (GLOBAL, STACK_GLOBAL, INST, OBJ and the
    extension registry all go through `find_class`), and persistent ids are refused by default.
    """

    def find_class(self, module: str, name: str):
        obj = _allowed_global(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not checkpoint metadata")
        return obj


def read_metadata_file(path: Path) -> Metadata:
    """Unpickle `.metadata` with `MetadataUnpickler`; raise UnsafeCheckpointFile for anything else in it."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise UnsafeCheckpointFile(path.name, f"is not DCP metadata ({e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpointFile(path.name, f"is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


def check_storage_files(metadata: Metadata, folder: Path) -> None:
    """Every file the metadata points to is a plain file directly inside `folder` (no `..`, no links out)."""
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str):
            raise UnsafeCheckpointFile(METADATA_FILE, "names its data files in a way DCP never writes")
        path = folder / name
        if pathlib.PurePath(name).name != name or name in ("", ".", "..") or path.is_symlink() \
                or not path.is_file():
            raise UnsafeCheckpointFile(METADATA_FILE, f"points to {name!r}, which is not a file of this checkpoint")


def check_byte_entries(metadata: Metadata, folder: Path) -> None:
    """Every non-tensor entry loads as plain data (`weights_only=True`), whichever of them a load will ask for."""
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # weights_only's refusal, or bytes that are no torch.save archive at all
            raise UnsafeCheckpointFile(info.relative_path, f"is not checkpoint data (entry {index.fqn}: "
                                                           f"{_why_refused(e)})") from e


class SafeReader(FileSystemReader):
    """DCP's file reader, with metadata read by `MetadataUnpickler` and data files checked and named."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = Path(folder)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata_file(self.folder / METADATA_FILE)
        check_storage_files(metadata, self.folder)
        if getattr(metadata, "storage_meta", None) is None:  # what DCP's reader does after loading
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future:
        """DCP's reading, one data file at a time, so that a file that fails is the one named."""
        by_file: dict[str, list] = defaultdict(list)
        for item in plan.items:
            by_file[self.storage_data[item.storage_index].relative_path].append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise UnsafeCheckpointFile(name, f"is not checkpoint data ({_why_refused(e)})") from e
        done: Future = Future()
        done.set_result(None)
        return done


class MissingEntries(ValueError):
    """A partial load asked for an entry the checkpoint must hold (the model's weights) and it has none."""

    def __init__(self, names: list[str]):
        super().__init__(f"no {names[0]}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""))
        self.names = names


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but a non-tensor entry loads with `weights_only=True` and nothing else.

    `required`: with `allow_partial_load`, the entries under this prefix must still all be there (a
    load of the model without the optimizer state may skip the latter, never a weight)."""

    def __init__(self, *args, required: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.required = required

    def create_local_plan(self):
        if self.required is not None:
            missing = [k for k in self.state_dict
                       if k.startswith(self.required) and k not in self.metadata.state_dict_metadata]
            if missing:
                raise MissingEntries(missing)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # raises on anything but plain data
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        # The entry's place in the nested state dict we asked for (which has every container on the way).
        node, *path = self.original_state_dict, *self.mappings[fqn]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = obj
