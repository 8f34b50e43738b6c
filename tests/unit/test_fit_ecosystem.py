"""Models from the ecosystem train through `gpudl.fit` unmodified, on the data their pipelines yield.

Hugging Face models (random init from a config, nothing downloaded) with dict batches, tuple
batches, their own loss or the user's, map-style datasets and DataLoaders; each run is compared
with the same training written as a plain PyTorch loop, and its FLOPs must be counted (MFU > 0).
The GPT-2, ResNet and nested-batch runs take the device (the CPU; the accelerator where present).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import gpudl
from gpudl.data import DeviceLoader
from gpudl.data.datasets import IterableBatches, as_batch_source
from gpudl.data.images.in_memory import SHAPES, generated_shapes

V, T = 16, 16  # vocabulary and sequence length of the toy GPT-2
# fp32 on the CPU so that fit and the plain loop compute the same numbers; a loss every step.
FIT = dict(lr=3e-3, precision="fp32", device="cpu", log_every=1, progress=False, quiet=True)
# fit and the plain loop agree within this on the CPU; on an accelerator, whose kernels (cuDNN's
# convolutions, atomics in backward passes) need not sum in the same order twice, within 1e-4.
TOL = {"cpu": 1e-5}


def tol(device: str) -> float:
    return TOL.get(device, 1e-4)


def to(batch, device: str):
    """`batch` (tensors in dicts, tuples and lists) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to(v, device) for v in batch)
    return batch


def transformers():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()  # the tiny configs' token ids are outside the vocabulary: said, not needed
    return tf


def gpt2(seed: int = 0):
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=T, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: runs are comparable
    return tf.GPT2LMHeadModel(cfg)


def resnet(seed: int = 0):
    tf = transformers()
    torch.manual_seed(seed)
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                          num_labels=len(SHAPES))
    return tf.ResNetForImageClassification(cfg)


def counting(n: int, seed: int = 1) -> torch.Tensor:
    """(n, T) sequences counting up from a random start, modulo V: every token after the first is learnable."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (n, 1), generator=g) + torch.arange(T)) % V


def dict_batches(n: int, size: int = 16) -> list[dict]:
    ids = counting(n * size)
    return [{"input_ids": ids[i:i + size], "labels": ids[i:i + size]} for i in range(0, len(ids), size)]


class Shapes(Dataset):
    """Generated shape images as Hugging Face image pipelines give them: one dict per sample."""

    def __init__(self, n: int, seed: int = 0):
        self.images = generated_shapes(n, 16, seed)

    def __len__(self) -> int:
        return len(self.images.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.images.images[i].float() / 255, "labels": self.images.labels[i]}


class Tokens(Dataset):
    """Counting sequences, one dict per sample."""

    def __init__(self, n: int):
        self.ids = counting(n)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def losses(result) -> list[float]:
    return [r["loss"] for r in result.records if r["kind"] == "train"]


def plain_pytorch(model, batches, steps: int, loss_of, lr: float = 3e-3, device: str = "cpu") -> list[float]:
    """The same training as a plain PyTorch loop, with fit's defaults: AdamW (betas 0.9, 0.95), cosine
    decay to 10% of `lr`, gradients clipped to norm 1."""
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    out = []
    for _, batch in zip(range(steps), batches):
        loss = loss_of(model, to(batch, device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        out.append(loss.item())
    return out


def assert_trained_like(result, reference: list[float], device: str = "cpu", at_least: float = 0.0) -> None:
    got = losses(result)
    assert got == pytest.approx(reference, abs=max(tol(device), at_least))
    assert next(result.model.parameters()).device.type == torch.device(device).type
    assert got[-1] < 0.6 * got[0]  # it learned
    assert result.metrics.mfu > 0 and result.summary["flops_per_sample"] > 0 and result.metrics.mfu_note is None


def test_gpt2_with_dict_batches_and_its_own_loss(device):
    batches = dict_batches(30)
    result = gpudl.fit(gpt2(), batches, max_steps=30, **{**FIT, "device": device})
    assert_trained_like(result, plain_pytorch(gpt2(), batches, 30, lambda m, b: m(**b).loss, device=device), device)


def test_gpt2_with_tuple_batches_gets_the_last_element_as_labels():
    """A tuple (input_ids, labels) with loss=None: the last element goes to the model's `labels`
    argument (by position it would land in GPT-2's past_key_values)."""
    batches = [(b["input_ids"], b["labels"]) for b in dict_batches(30)]
    result = gpudl.fit(gpt2(), batches, max_steps=30, **FIT)
    assert_trained_like(result, plain_pytorch(gpt2(), batches, 30, lambda m, b: m(input_ids=b[0], labels=b[1]).loss))


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the prediction at t against the token at t + 1: what GPT-2 computes itself."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_user_loss_gets_the_logits_and_the_target(kind):
    batches = dict_batches(30)
    if kind == "tuple":
        batches = [(b["input_ids"], b["labels"]) for b in batches]
    model, seen = gpt2(), []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append((len(args), tuple(sorted(kwargs)))),
                                    with_kwargs=True)
    result = gpudl.fit(model, batches, loss=next_token_loss, max_steps=30, **FIT)
    # The same numbers as GPT-2's own loss in a plain loop; the target never reaches the model.
    assert_trained_like(result, plain_pytorch(gpt2(), dict_batches(30), 30, lambda m, b: m(**b).loss))
    assert set(seen) == ({(0, ("input_ids",))} if kind == "dict" else {(1, ())})


def test_resnet_with_dict_samples_from_a_dataset(device):
    data = Shapes(512)
    result = gpudl.fit(resnet(), data, max_steps=40, batch_size=32, **{**FIT, "lr": 1e-2, "device": device})
    source = as_batch_source(data, 32, seed=0)  # the batches fit drew: positions of a seeded permutation
    reference = plain_pytorch(resnet(), (source.batch(k) for k in range(40)), 40, lambda m, b: m(**b).loss, lr=1e-2,
                              device=device)
    # At this learning rate the last float bit grows: on a Xeon with AVX512 and AMX (2026-12-04) the two
    # runs differ by 1.2e-7 from the third step and by up to 2.9e-5 after step 30 (1e-5 held on AMD EPYC CPUs).
    assert_trained_like(result, reference, device, 1e-4)


def test_a_dataloader_is_used_as_it_is(capsys):
    loader = DataLoader(Tokens(512), batch_size=8, shuffle=True)
    result = gpudl.fit(gpt2(), loader, max_steps=40, **{**FIT, "quiet": False})
    out = " ".join(capsys.readouterr().out.split())  # the console wraps lines
    assert "Data: a DataLoader with batch size 8; fit's batch_size=32 is not used" in out
    model = gpt2()
    torch.manual_seed(0)  # fit's seed: the DataLoader shuffles from the global generator as it starts
    assert_trained_like(result, plain_pytorch(model, loader, 40, lambda m, b: m(**b).loss))
    for r in result.records[1:]:  # throughput counts the DataLoader's 8 samples per step, not 32
        assert r["samples_per_s"] * r["step_s"] == pytest.approx(8, rel=1e-6)


def test_a_generator_loses_no_batch_to_the_flop_count():
    batches = dict_batches(12)
    result = gpudl.fit(gpt2(), (b for b in batches), max_steps=12, **FIT)  # exactly as many batches as steps
    reference = plain_pytorch(gpt2(), batches, 12, lambda m, b: m(**b).loss)
    assert losses(result) == pytest.approx(reference, abs=1e-5) and result.metrics.steps == 12


class PairModel(torch.nn.Module):
    """A model whose batch nests: {"pair": (a, b), "labels": y}, and whose output is a dict with its loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, pair, labels):
        logits = self.head(torch.relu(self.a(pair[0]) + self.b(pair[1])))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def pair_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        a, b = torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)
        out.append({"pair": (a, b), "labels": (a[:, 0] + b[:, 1] > 0).long()})
    return out


def test_nested_batches_and_dict_outputs(device):
    batches = pair_batches(40)
    torch.manual_seed(0)
    result = gpudl.fit(PairModel(), batches, max_steps=40, **{**FIT, "lr": 3e-2, "device": device})
    got = losses(result)
    assert got[-1] < 0.6 * got[0] and result.metrics.mfu > 0
    torch.manual_seed(0)
    first = PairModel()(**batches[0])["loss"].item()  # on the CPU: an accelerator's kernels round otherwise
    assert got[0] == pytest.approx(first, abs=1e-6 if device == "cpu" else 1e-5)


def test_nested_batches_reach_the_device_whole():
    batch = {"pair": (torch.zeros(2, 3), [torch.ones(2)]), "labels": torch.zeros(2), "name": "kept"}
    moved = next(DeviceLoader(IterableBatches([batch]), torch.device("meta")))
    assert moved["pair"][0].device.type == moved["pair"][1][0].device.type == moved["labels"].device.type == "meta"
    assert moved["pair"][0].shape == (2, 3) and moved["name"] == "kept"


class Scale(torch.nn.Module):
    """No matrix product anywhere: the FLOP counter counts nothing."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, y):
        return ((x * self.w - y) ** 2).mean()


def test_mfu_says_why_it_is_not_reported(tmp_path, capsys):
    x = torch.randn(64, 4)
    result = gpudl.fit(Scale(), (x, 2 * x), max_steps=3, batch_size=16, run_dir=tmp_path / "run",
                       **{**FIT, "quiet": False})
    why = "the FLOP counter found no matrix product, convolution or attention in the model"
    assert result.metrics.mfu is None and result.metrics.mfu_note == why and result.summary["mfu_note"] == why
    assert f"MFU not reported: {why}" in " ".join(capsys.readouterr().out.split())  # the console wraps lines
    assert why in (tmp_path / "run" / "summary.json").read_text()
