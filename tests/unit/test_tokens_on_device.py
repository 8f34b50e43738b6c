"""A token set that fits on the device is drawn there: the batches must be bit-identical to the
host-made ones (same generator, same windows), for every storage dtype, on every rank."""

import numpy as np
import pytest
import torch

from gpudl.data.loader import DeviceLoader
from gpudl.data.text.streams import TextBatches

CPU = torch.device("cpu")


def _tokens(dtype, top, n=5_000, seed=0):
    return np.random.default_rng(seed).integers(0, top + 1, n).astype(dtype)


@pytest.mark.parametrize("dtype,top,held", [(np.uint8, 255, torch.uint8), (np.uint16, 32_767, torch.int16),
                                            (np.uint16, 50_256, torch.int32), (np.uint32, 100_000, torch.int32)])
def test_resident_batches_equal_host_batches(dtype, top, held):
    tokens = _tokens(dtype, top)
    tokens[17] = top  # the largest id is present, so the storage choice is tested at its edge
    host = TextBatches(tokens, block_size=16, batch_size=6, seed=3)
    resident = host.resident_on(CPU, budget_bytes=1 << 20)
    assert resident is not None and resident.tokens.dtype == held
    for k in (0, 1, 57):
        for got, want in zip(resident.batch(k), host.batch(k)):
            assert got.dtype == torch.int64 and torch.equal(got, want)


def test_resident_batches_split_across_ranks_like_the_host():
    tokens = _tokens(np.uint16, 40_000)
    whole = TextBatches(tokens, 8, batch_size=6, seed=1).batch(4)
    parts = [TextBatches(tokens, 8, batch_size=3, seed=1, rank=r, world=2).resident_on(CPU, 1 << 20).batch(4)
             for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_too_big_stays_on_the_host():
    tokens = _tokens(np.uint16, 30_000, n=10_000)  # 20 kB as int16
    source = TextBatches(tokens, 8, 2, seed=0)
    assert source.resident_on(CPU, budget_bytes=19_999) is None
    assert source.resident_on(CPU, budget_bytes=20_000) is not None
    wide = _tokens(np.uint16, 60_000, n=10_000)  # int32 storage doubles it: 40 kB no longer fits in 30 kB
    wide[0] = 60_000
    assert TextBatches(wide, 8, 2, seed=0).resident_on(CPU, budget_bytes=30_000) is None


def test_unknown_device_memory_means_host():
    # The CPU has no device-memory query: without an explicit budget nothing moves.
    assert TextBatches(_tokens(np.uint8, 255), 8, 2, seed=0).resident_on(CPU) is None


def test_memmapped_tokens_are_copied_not_written(tmp_path):
    path = tmp_path / "tokens.u16"
    _tokens(np.uint16, 1000).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    resident = TextBatches(tokens, 8, 2, seed=0).resident_on(CPU, 1 << 20)
    resident.tokens[0] = 7  # the device copy is its own; the file and the map are untouched
    assert np.array_equal(np.fromfile(path, dtype=np.uint16), np.asarray(tokens))


def test_the_cpu_loader_keeps_host_batches():
    source = TextBatches(_tokens(np.uint8, 255), 8, 2, seed=0)
    loader = DeviceLoader(source, CPU)
    assert "drawn on the device" not in loader.description
    assert torch.equal(next(loader)[0], source.batch(0)[0])
    loader.close()
