import numpy as np
import pytest
import torch

from gpudl import models
from gpudl.config import DataConfig
from gpudl.data import DeviceLoader, build_data
from gpudl.data.datasets import DatasetBatches, IterableBatches, as_batch_source
from gpudl.data.images.folder import FolderEvalBatches
from gpudl.data.images.index import index_folder
from gpudl.data.images.in_memory import SHAPES, ImageBatches, generated_shapes, load_images
from gpudl.data.text.streams import TextBatches, TokenStream, byte_corpus, stdlib_sources
from gpudl.errors import UserError

GPT = models.resolve("gpt-tiny", {"block_size": 16})


def test_stdlib_corpus_is_the_bytes_of_the_standard_library():
    path = byte_corpus(None)
    data = path.read_bytes()
    first = stdlib_sources()[0].read_bytes().rstrip(b"\n")
    assert data.startswith(first) and len(data) > 1_000_000
    assert byte_corpus(None) == path  # cached: built once


def test_windows_are_shifted_by_one_and_deterministic():
    tokens = np.arange(1000, dtype=np.uint16)
    src = TextBatches(tokens, block_size=8, batch_size=4, seed=0)
    x, y = src.batch(5)
    assert x.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(src.batch(5)[0], x) and not torch.equal(src.batch(6)[0], x)


def test_ranks_split_the_global_batch_exactly():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    full = TextBatches(tokens, 8, batch_size=6, seed=1).batch(3)
    parts = [TextBatches(tokens, 8, batch_size=3, seed=1, rank=r, world=2).batch(3) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full[0])
    imgs = generated_shapes(64, 8, seed=0)
    full = ImageBatches(imgs, 8, seed=2).batch(5)
    parts = [ImageBatches(imgs, 4, seed=2, rank=r, world=2).batch(5) for r in range(2)]
    assert torch.equal(torch.cat([p[1] for p in parts]), full[1])


def test_image_epochs_visit_every_image_once():
    imgs = generated_shapes(40, 8, seed=0)
    src = ImageBatches(imgs, 8, seed=0)
    seen = torch.cat([src.batch(k)[1] for k in range(5)])
    assert sorted(seen.tolist()) == sorted(imgs.labels.tolist())


def test_generated_shapes_are_learnable_classes():
    imgs = generated_shapes(300, 16, seed=0)
    assert imgs.images.shape == (300, 3, 16, 16) and imgs.images.dtype == torch.uint8
    assert set(imgs.labels.tolist()) == set(range(len(SHAPES)))
    # a disc covers more pixels than a bar: the classes differ in what the pixels show
    bright = (imgs.images.float().mean(1) > 100).float().mean((1, 2))
    assert bright[imgs.labels == 0].mean() > bright[imgs.labels == 5].mean()


def test_sklearn_digits():
    pytest.importorskip("sklearn")
    d = load_images("sklearn:digits", 16, seed=0)
    assert d.images.shape == (1797, 1, 16, 16) and len(d.classes) == 10


def test_image_folder(tmp_path):
    pil = pytest.importorskip("PIL.Image")
    for cls, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        for i in range(3):
            pil.new("RGB", (20, 10), colour).save(tmp_path / cls / f"{i}.png")
    index = index_folder(tmp_path)
    assert index.classes == ["blue", "red"] and len(index) == 6
    images, labels = FolderEvalBatches(index, 8, 6).wire_batch(0)  # streamed, centre-cropped, uint8
    assert images.shape == (6, 3, 8, 8) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert images[labels == 1][:, 0].float().mean() > 250  # red images are red
    assert images[labels == 1][:, 2].float().mean() < 5


@pytest.mark.parametrize("path, words", [("/no/such/folder", "not a folder"), (None, "holds no images")])
def test_image_folder_errors(tmp_path, path, words):
    with pytest.raises(UserError, match=words):
        build_data(DataConfig(path=path or str(tmp_path)), models.resolve("resnet18"), 2, 0)


def test_text_path_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        byte_corpus(str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="holds no files"):
        byte_corpus(str(tmp_path))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="holds no text"):
        byte_corpus(str(tmp_path))


def test_users_text_folder_and_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    d = build_data(DataConfig(kind="text", path=str(tmp_path)), GPT, batch_size=2, seed=0)
    x, _ = d.train.batch(0)
    assert bytes(x[0].tolist()).decode() in ("hello world " * 60)
    tok = tmp_path / "tokens.bin"
    np.arange(3000, dtype=np.uint16).tofile(tok)
    with pytest.raises(UserError, match="set --set model.vocab_size=3000"):
        build_data(DataConfig(kind="tokens", path=str(tok)), GPT, batch_size=2, seed=0)
    big = models.resolve("gpt-tiny", {"block_size": 16, "vocab_size": 3000})
    d = build_data(DataConfig(kind="tokens", path=str(tok)), big, batch_size=2, seed=0)
    x, y = d.train.batch(0)
    assert torch.equal(y[:, 0], x[:, 0] + 1)


def test_too_little_text_is_a_clear_error():
    with pytest.raises(UserError, match="fewer than one window"):
        TextBatches(np.zeros(10, np.uint8), block_size=16, batch_size=2, seed=0)


def test_data_kind_must_suit_the_model():
    with pytest.raises(UserError, match="cannot feed resnet18"):
        build_data(DataConfig(kind="text"), models.resolve("resnet18"), 2, 0)


def test_token_stream_split_and_vocab(tmp_path):
    f = tmp_path / "t.bin"
    np.array([1, 2, 7, 3] * 25, dtype=np.uint16).tofile(f)
    s = TokenStream(f, "uint16", val_fraction=0.2)
    assert s.vocab_size == 8 and len(s.part("train")) == 80 and len(s.part("val")) == 20


@pytest.mark.parametrize("num_workers", [0, 1])
def test_device_loader_hands_out_batches_in_order_on_the_device_and_counts_position(device, num_workers):
    """Batch k on the device, whole and in order, made in this process or in a worker process (on an
    accelerator: pinned and copied on a side stream, so also after the next copy has started)."""
    src = TextBatches(np.arange(500, dtype=np.uint16), 4, 2, seed=0)
    loader = DeviceLoader(src, torch.device(device), start=3, num_workers=num_workers)
    got = [next(loader) for _ in range(3)]
    for k, (x, y) in zip((3, 4, 5), got):
        assert x.device.type == y.device.type == torch.device(device).type
        assert torch.equal(x.cpu(), src.batch(k)[0]) and torch.equal(y.cpu(), src.batch(k)[1])
    assert loader.position == 6


@pytest.mark.parametrize("num_workers", [0, 1])
def test_image_batches_travel_as_uint8_and_are_normalised_on_the_device(device, num_workers):
    """On an accelerator the host gathers uint8 pixels (a quarter of the bytes to pin and copy) and the
    device normalises them with the training part's statistics (on the CPU, with no copy to save, the
    batch is made whole on the host): either way what arrives is the source's own `batch(k)`."""
    src = ImageBatches(generated_shapes(64, 16, seed=0), 8, seed=1)
    wire = src.wire_batch(2)
    assert wire[0].dtype == torch.uint8 and wire[0].shape == (8, 3, 16, 16)
    loader = DeviceLoader(src, torch.device(device), start=2, num_workers=num_workers)
    for k in (2, 3):
        x, y = next(loader)
        want_x, want_y = src.batch(k)  # on the host, after the loader's own use of the source
        assert x.device.type == torch.device(device).type and x.dtype == torch.float32
        assert torch.allclose(x.cpu(), want_x, atol=1e-6, rtol=0) and torch.equal(y.cpu(), want_y)
    assert want_x.mean(dim=(0, 2, 3)).abs().max() < 0.5  # normalised, not raw pixels


def test_user_data_sources():
    x, y = torch.arange(20.0).view(10, 2), torch.arange(10)
    src = as_batch_source((x, y), batch_size=4, seed=0)
    assert isinstance(src, DatasetBatches)
    bx, by = src.batch(0)
    assert torch.equal(bx[:, 0] / 2, by.float())  # rows stay paired with their targets
    it = as_batch_source([(x[:5], y[:5]), (x[5:], y[5:])], 4, 0)
    assert isinstance(it, IterableBatches)
    assert torch.equal(it.batch(0)[1], y[:5]) and torch.equal(it.batch(1)[1], y[5:])
    assert torch.equal(it.batch(2)[1], y[:5])  # starts a new pass when the iterable runs out
    assert torch.equal(it.batch(1)[1], y[5:])  # and replays when asked out of order
    with pytest.raises(UserError, match="cannot train on a int"):
        as_batch_source(3, 4, 0)


@pytest.mark.parametrize("shape, channels_last", [((6, 3, 20, 12), True), ((6, 3, 20, 12), False),
                                                  ((4, 1, 9, 7), True), ((2, 5, 3, 3), True)])
def test_normalized_pixels_match_the_formula_in_the_pixels_layout(shape, channels_last):
    # The CPU path takes two passes (and tiles the constants along channels-last rows): it must
    # give the formula's floats, in double precision, and keep the layout the convolutions want.
    from gpudl.data.images.in_memory import normalized
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    mean = torch.rand(shape[1], 1, 1, generator=g)
    std = torch.rand(shape[1], 1, 1, generator=g) + 0.1
    want = (x.double() / 255 - mean.double()) / std.double()
    got = normalized(x, mean, std)
    assert got.dtype == torch.float32 and got.stride() == x.stride()
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5)
