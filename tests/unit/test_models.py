"""Models: parameter counts against independent references, FLOPs against the formula (on the meta
device), and forward, backward and generation on each device (the CPU; the accelerator where present)."""

import pytest
import torch

from gpudl import models
from gpudl.observe.flops import count_training_flops, meta_batch
from gpudl.models.gpt import GPTConfig, formula_flops_per_token

# Parameter counts published with torchvision's ImageNet models (1000 classes, ImageNet stem):
# an independent reference for our ResNets.
TORCHVISION_RESNET_PARAMS = {18: 11_689_512, 34: 21_797_672, 50: 25_557_032, 101: 44_549_160, 152: 60_192_808}


def n_params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("depth, expected", TORCHVISION_RESNET_PARAMS.items())
def test_resnet_parameter_counts_match_torchvision(depth, expected):
    spec = models.resolve(f"resnet{depth}", {"num_classes": 1000, "small_stem": False})
    assert n_params(models.build_meta(spec)) == expected


def gpt_param_formula(c: GPTConfig) -> int:
    """By hand: embeddings + per block (4 attention matrices, 2 MLP matrices, 2 norms) + final norm."""
    d, f = c.d_model, c.mlp_ratio * c.d_model
    block = 4 * d * d + 2 * d * f + 2 * d
    head = 0 if c.tie_embeddings else c.vocab_size * d
    return c.vocab_size * d + c.block_size * d + c.n_layer * block + d + head


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt-1b"])
def test_gpt_presets_build_on_meta_with_the_formula_count(name):
    spec = models.resolve(name)
    m = models.build_meta(spec)
    assert all(p.device.type == "meta" for p in m.parameters())
    assert n_params(m) == gpt_param_formula(spec.config)


def test_untied_gpt_has_its_own_head(device):
    spec = models.resolve("gpt-tiny", {"tie_embeddings": False})
    m = models.build(spec, torch.device(device))
    assert m.lm_head.weight is not m.wte.weight and n_params(m) == gpt_param_formula(spec.config)


def test_gpt2_124m_is_gpt2_small():
    assert 124e6 < n_params(models.build_meta(models.resolve("gpt2-124m"))) < 125e6
    assert 0.95e9 < n_params(models.build_meta(models.resolve("gpt-1b"))) < 1.1e9


def test_build_materialises_on_the_device_with_tied_weights_and_gpt2_init(device):
    spec = models.resolve("gpt-tiny")
    m = models.build(spec, torch.device(device), seed=1)
    assert all(p.device.type == torch.device(device).type for p in m.parameters())
    assert m.lm_head.weight is m.wte.weight
    assert abs(m.wte.weight.std().item() - 0.02) < 0.002
    assert torch.equal(m.blocks["0"].norm1.weight, torch.ones(128, device=device))
    again = models.build(spec, torch.device(device), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters()))


def test_gpt_is_causal(device):
    m = models.build(models.resolve("gpt-tiny", {"n_layer": 2}), torch.device(device))
    x = torch.randint(0, 256, (1, 16), device=device)
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    a, b = m(x), m(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_loss_at_init_is_near_uniform_and_its_gradients_reach_every_weight(device):
    m = models.build(models.resolve("gpt-tiny"), torch.device(device))
    x, y = torch.randint(0, 256, (4, 64), device=device), torch.randint(0, 256, (4, 64), device=device)
    loss = m(x, y)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("small_stem, size", [(True, 32), (False, 64)])
def test_resnet_forward_shapes(device, small_stem, size):
    m = models.build(models.resolve("resnet18", {"num_classes": 7, "small_stem": small_stem}), torch.device(device))
    assert m(torch.randn(2, 3, size, size, device=device)).shape == (2, 7)


def test_resnet_channels_last_is_a_layout_only(device, monkeypatch):
    """Same weights, same loss and gradients as the plain (NCHW) model; only the strides differ."""
    if device == "cuda":  # cuDNN runs fp32 convolutions in TF32 unless told not to: compare true fp32
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    def build(channels_last):
        return models.build(models.resolve("resnet18", {"channels_last": channels_last, "width": 16}),
                            torch.device(device), seed=3)
    nhwc, nchw = build(True), build(False)
    assert nhwc.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not nchw.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    x, y = torch.randn(4, 3, 32, 32).to(device), torch.randint(0, 10, (4,)).to(device)
    loss = models.loss_for(models.resolve("resnet18"))
    losses = [loss(m, (x, y)) for m in (nhwc, nchw)]
    for m, value in zip((nhwc, nchw), losses):
        value.backward()
    # An accelerator picks other convolution algorithms for each layout (other summation orders): 1e-4.
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(losses[0], losses[1], rtol=tol, atol=tol)
    for (name, a), b in zip(nhwc.named_parameters(), nchw.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=tol, msg=name)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-124m", "gpt-1b"])
def test_counted_flops_match_the_gpt_formula(name):
    """flop_counter over forward+backward on the meta device vs 6N + 12*L*H*Q*T per token."""
    spec = models.resolve(name)
    m = models.build_meta(spec)
    c = spec.config
    batch = meta_batch((torch.zeros(2, c.block_size, dtype=torch.long),) * 2)
    counted = count_training_flops(m, batch, models.loss_for(spec))
    # N: every matmul weight, the tied embedding counted once as the head (position embeddings do no matmul).
    n = n_params(m) - c.block_size * c.d_model
    expected = 2 * c.block_size * formula_flops_per_token(c, n)
    assert counted == pytest.approx(expected, rel=0.01)


def test_flop_counter_on_a_linear_layer_is_exact():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    flops = count_training_flops(lin, (x,), lambda m, b: m(b[0]).sum())
    assert flops == 2 * 8 * 64 * 32 * 2  # forward, plus the weight gradient (no input grad needed)
    assert lin.weight.grad is None


def test_flop_counting_leaves_batchnorm_statistics_alone():
    m = models.build(models.resolve("resnet18"), torch.device("cpu"))
    before = m.stem[1].running_mean.clone()
    count_training_flops(m, (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))),
                         models.loss_for(models.resolve("resnet18")))
    assert torch.equal(before, m.stem[1].running_mean)
    assert all(p.grad is None for p in m.parameters())


def test_gpt_generate_extends_the_sequence(device):
    from gpudl.run.sample import sample_text

    m = models.build(models.resolve("gpt-tiny", {"n_layer": 1}), torch.device(device))
    text = sample_text(m, "def ", 20, seed=3)
    assert text.startswith("def ") and len(text.encode("utf8", errors="replace")) >= 20
    assert text == sample_text(m, "def ", 20, seed=3)


def test_gpt_generate_at_temperature_zero_is_the_argmax_of_each_step(device):
    from gpudl.run.sample import sample_text

    m = models.build(models.resolve("gpt-tiny", {"n_layer": 1}), torch.device(device)).eval()
    ids = list(b"def ")
    with torch.no_grad():  # greedy by hand: the likeliest of the 256 byte ids, one step at a time
        for _ in range(30):
            logits = m(torch.tensor([ids[-m.cfg.block_size:]], device=device))[0, -1, :256]  # (256,)
            ids.append(int(logits.float().argmax()))
    expected = bytes(ids).decode("utf8", errors="replace")
    assert sample_text(m, "def ", 30, temperature=0, seed=1) == expected
    assert sample_text(m, "def ", 30, temperature=0, top_k=3, seed=2) == expected  # no draw: seed, top_k idle


def test_the_forward_flops_checkpointing_reruns_are_the_blocks_by_formula():
    from gpudl.distributed.parallelize import block_units
    from gpudl.observe.flops import count_step_flops

    spec = models.resolve("gpt-tiny", {"n_layer": 3, "d_model": 32, "n_head": 2, "block_size": 16})
    m, c = models.build_meta(spec), spec.config
    batch = meta_batch((torch.zeros(2, c.block_size, dtype=torch.long),) * 2)
    counted = count_step_flops(m, batch, models.loss_for(spec), block_units(m))[1]
    # per token and block: q, k, v, output projection (4 d^2 multiply-adds) and the MLP (8 d^2), then
    # scores and the weighted sum over all T keys (the math kernel counts the masked ones too): 2 T d
    per_token = 2 * (12 * c.d_model**2 + 2 * c.block_size * c.d_model)
    assert counted == c.n_layer * 2 * c.block_size * per_token
