"""A user's own data as a batch source: a map-style Dataset, a tuple of tensors, or any iterable of batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ..errors import UserError


class DatasetBatches:
    """Batch k of a map-style dataset: positions of a per-epoch permutation, this rank's slice."""

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        n = len(dataset)
        if n < batch_size * world:
            raise UserError(f"the dataset has {n} samples, fewer than one batch of {batch_size * world}: "
                            f"lower batch_size")
        self.dataset, self.batch_size, self.seed, self.rank, self.world = dataset, batch_size, seed, rank, world
        self.per_epoch = n // (batch_size * world)
        self._epoch, self._perm = -1, None

    def batch(self, k: int) -> tuple[torch.Tensor, ...]:
        epoch, pos = divmod(k, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.dataset), generator=g)
        start = pos * self.batch_size * self.world + self.rank * self.batch_size
        items = [self.dataset[int(i)] for i in self._perm[start:start + self.batch_size]]
        batch = default_collate(items)
        return tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)


class IterableBatches:
    """Batches from any iterable (a DataLoader, say), started again when it runs out.

    With several data-parallel ranks, rank r takes items r, r + world, r + 2 world, ...
    """

    def __init__(self, batches: Iterable, rank: int = 0, world: int = 1):
        self.batches, self.rank, self.world = batches, rank, world
        self._it, self._next_k = iter(batches), 0

    def _advance(self):
        try:
            item = next(self._it)
        except StopIteration:
            self._it = iter(self.batches)  # a new pass over the data
            item = next(self._it, None)
            if item is None:
                raise UserError("the training data yields no batches") from None
        self._next_k += 1
        return item

    def batch(self, k: int) -> tuple[torch.Tensor, ...]:
        item_k = k * self.world + self.rank  # the item of the whole stream this rank trains on
        if item_k < self._next_k:  # asked out of order: replay from the start
            self._it, self._next_k = iter(self.batches), 0
        while self._next_k < item_k:
            self._advance()
        item = self._advance()
        return tuple(item) if isinstance(item, (list, tuple)) else (item,)


def as_batch_source(data, batch_size: int, seed: int, rank: int = 0, world: int = 1):
    """Turn what a user passes to `gpudl.fit` into a batch source."""
    if isinstance(data, tuple) and all(isinstance(t, torch.Tensor) for t in data):
        data = TensorDataset(*data)
    if isinstance(data, Dataset) and hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return DatasetBatches(data, batch_size, seed, rank, world)
    if isinstance(data, Iterable):
        return IterableBatches(data, rank, world)
    raise UserError(f"cannot train on a {type(data).__name__}: pass a Dataset, a tuple of tensors (inputs, targets) "
                    f"or an iterable of batches")
