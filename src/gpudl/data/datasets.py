"""A user's own data as a batch source: a map-style Dataset, tensors (a tuple, or a dict of columns),
or any iterable of batches (a DataLoader, a list, a generator).

A batch reaches the loop as a tuple (inputs..., target) or as a dict (a model's keyword
arguments, as Hugging Face data pipelines yield them); a tensor alone is a tuple of one.
A resumed fit starts its source at the batch the run had reached: a dataset's batch k is a pure
function of (seed, k); an iterable is read again from its start and the batches before k skipped
(a generator cannot be read again). Validation data is read whole at every evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ..errors import UserError
from .loader import Batch, map_tensors, tensors_in


def _as_batch(item: Any, what: str) -> Batch:
    """What the loop takes: a tensor alone becomes (tensor,), a list a tuple, any mapping a dict."""
    if isinstance(item, torch.Tensor):
        return (item,)
    if isinstance(item, Mapping):
        return dict(item)
    if isinstance(item, (tuple, list)):
        return tuple(item)
    raise UserError(f"{what} yields a {type(item).__name__} as a batch: a batch must be a tensor, or tensors in "
                    f"a tuple, list or dict")


def _shapes(item: Any) -> tuple:
    return tuple(tuple(t.shape) for t in tensors_in(item))


def _collate(items: list, indices: list[int]) -> Any:
    """default_collate, with its error for samples that do not stack turned into one line."""
    try:
        return default_collate(items)
    except (RuntimeError, TypeError) as e:
        first = _shapes(items[0])
        odd = next(((i, item) for i, item in zip(indices, items) if _shapes(item) != first), None)
        if odd is None:
            raise UserError(f"the dataset's samples cannot be made into a batch ({str(e).splitlines()[0]}): "
                            f"return tensors, numbers, or tuples and dicts of them") from e
        shown = [map_tensors(lambda t: tuple(t.shape), x) for x in (items[0], odd[1])]
        raise UserError(f"samples {indices[0]} and {odd[0]} of the dataset have different shapes, {shown[0]} and "
                        f"{shown[1]}, so they cannot be stacked into one batch: make every sample the same shape "
                        f"(pad or crop), or pass a DataLoader with a collate_fn that pads") from e


class DatasetBatches:
    """Batch k of a map-style dataset: positions of a per-epoch permutation, this rank's slice."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        n = len(dataset)
        if n == 0:
            raise UserError(f"the training data, a {type(dataset).__name__}, is empty (length 0): pass at least "
                            f"one batch of samples")
        if n < batch_size * world:
            raise UserError(f"the dataset has {n} samples, fewer than one batch of {batch_size * world}: "
                            f"lower batch_size")
        self.dataset, self.batch_size, self.seed, self.rank, self.world = dataset, batch_size, seed, rank, world
        self.per_epoch = n // (batch_size * world)
        self._epoch, self._perm = -1, None

    def batch(self, k: int) -> Batch:
        epoch, pos = divmod(k, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.dataset), generator=g)
        start = pos * self.batch_size * self.world + self.rank * self.batch_size
        indices = self._perm[start:start + self.batch_size].tolist()
        return _as_batch(_collate([self.dataset[i] for i in indices], indices), "the dataset")


class IterableBatches:
    """Batches from any iterable (a DataLoader, say), started again when it runs out.

    With several data-parallel ranks, rank r takes items r, r + world, r + 2 world, ... A
    one-shot iterator (a generator) cannot start again: it runs until it is empty, and the batch
    read last is kept, so asking for it twice (FLOPs are counted on batch 0) reads it once.
    """

    def __init__(self, batches: Iterable, rank: int = 0, world: int = 1):
        self.batches, self.rank, self.world = batches, rank, world
        self._what = f"the training data, a {type(batches).__name__},"
        self._it = iter(batches)
        self._one_shot = self._it is batches  # an iterator is its own iterator: it can be read only once
        # Resuming reads the data again from its start and skips what the run consumed: a list, a
        # DataLoader can; a generator cannot (what it yielded before the checkpoint is gone).
        self.replayable = not self._one_shot
        self._next_k, self._last = 0, None    # _last: (item number, item) read last

    def _read_again(self) -> None:
        """A new iterator over the data; a one-shot iterator has none."""
        if self._one_shot:
            raise UserError(f"{self._what} ran out after {self._next_k} batches: a generator or iterator can be "
                            f"read only once; pass a list of batches, a Dataset, or an iterable that can be read "
                            f"again (a DataLoader), or lower max_steps")
        self._it = iter(self.batches)

    def _advance(self) -> Any:
        try:
            item = next(self._it)
        except RuntimeError as e:  # a DataLoader's default_collate on samples of different shapes
            if "stack expects each tensor to be equal size" not in str(e):
                raise
            raise UserError(f"{self._what} cannot stack its samples into one batch ({str(e).splitlines()[0]}): make "
                            f"every sample the same shape, or give it a collate_fn that pads") from e
        except StopIteration:
            if self._next_k == 0:
                raise UserError(f"{self._what} yields no batches: pass at least one batch") from None
            self._read_again()  # a new pass over the data
            item = next(self._it, None)
            if item is None:
                raise UserError(f"{self._what} yields no batches when read again: pass data that can be read "
                                f"more than once (a list, a Dataset)") from None
        self._last = (self._next_k, item)
        self._next_k += 1
        return item

    def batch(self, k: int) -> Batch:
        item_k = k * self.world + self.rank  # the item of the whole stream this rank trains on
        if self._last is not None and self._last[0] == item_k:
            return _as_batch(self._last[1], self._what)
        if item_k < self._next_k:  # asked out of order: replay from the start
            self._read_again()
            self._next_k = 0
        while self._next_k < item_k:
            self._advance()
        return _as_batch(self._advance(), self._what)


class _Columns(Dataset):
    """A dict of tensors with one row per sample, as a dataset whose samples are dicts."""

    def __init__(self, columns: dict[str, torch.Tensor]):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


def _tensors(data: Any) -> dict | None:
    """The tensors of `data` by name (a tuple's by position), if it is a tuple or dict of tensors only."""
    named = dict(enumerate(data)) if isinstance(data, tuple) else data if isinstance(data, Mapping) else {}
    if not named or not all(isinstance(t, torch.Tensor) for t in named.values()):
        return None
    rows = {k: t.shape[0] if t.dim() else None for k, t in named.items()}
    if None in rows.values() or len(set(rows.values())) > 1:
        raise UserError(f"the tensors of the training data must hold one row per sample, as many each; their "
                        f"first dimensions are {rows}: give every tensor the same first dimension")
    return named


def _as_dataset(data: Any) -> Any:
    """Tensors (a tuple, or a dict of columns) as a dataset; anything else as it is."""
    columns = _tensors(data)
    if columns is not None:
        return TensorDataset(*columns.values()) if isinstance(data, tuple) else _Columns(dict(columns))
    return data


def _map_style(data: Any) -> bool:
    return isinstance(data, Dataset) and hasattr(data, "__len__") and hasattr(data, "__getitem__")


def as_batch_source(data, batch_size: int, seed: int, rank: int = 0, world: int = 1):
    """Turn what a user passes to `gpudl.fit` into a batch source."""
    data = _as_dataset(data)
    if _map_style(data):
        return DatasetBatches(data, batch_size, seed, rank, world)
    if isinstance(data, Mapping):
        raise UserError(f"cannot train on a {type(data).__name__} that holds other things than tensors: pass a dict "
                        f"of tensors (one row per sample), a list of dict batches, or a Dataset")
    if isinstance(data, Iterable):
        return IterableBatches(data, rank, world)
    raise UserError(f"cannot train on a {type(data).__name__}: pass a Dataset, a tuple of tensors (inputs, targets) "
                    f"or an iterable of batches")



def as_eval_batches(data, batch_size: int) -> Callable[[], Iterator[Batch]]:
    """`gpudl.fit`'s `val_data` as a function that yields all of it, in order, each time it is called.

    A dataset (or tensors) comes in batches of `batch_size` samples, the last one smaller; an
    iterable of batches as it is. A generator is refused: every evaluation reads the data again.
    """
    what = f"the validation data, a {type(data).__name__},"
    data = _as_dataset(data)
    if _map_style(data):
        n = len(data)
        if n == 0:
            raise UserError(f"{what} is empty (length 0): pass at least one sample, or leave val_data out")

        def dataset_pass() -> Iterator[Batch]:
            for start in range(0, n, batch_size):
                indices = list(range(start, min(n, start + batch_size)))
                yield _as_batch(_collate([data[i] for i in indices], indices), what)
        return dataset_pass
    if isinstance(data, Iterator):  # checked before iter(): iter() on a DataLoader would start its workers
        raise UserError(f"{what} can be read only once, and every evaluation reads all of it: pass a list of "
                        f"batches, a Dataset, tensors or a DataLoader")
    if isinstance(data, Iterable) and not isinstance(data, Mapping):
        def iterable_pass() -> Iterator[Batch]:
            empty = True
            for item in data:
                empty = False
                yield _as_batch(item, what)
            if empty:
                raise UserError(f"{what} yields no batches: pass at least one batch, or leave val_data out")
        return iterable_pass
    raise UserError(f"cannot evaluate on a {type(data).__name__}: pass val_data as a Dataset, a tuple of tensors "
                    f"(inputs, targets), a dict of tensors or an iterable of batches")
