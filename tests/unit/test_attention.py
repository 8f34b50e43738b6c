"""Causal attention on the measured CPU kernel: right numbers, the faster kernel, measured once, and
the model calling whichever kernel training hands it."""

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpudl.training import kernels
from gpudl.training.kernels import fastest_cpu_kernel, measured_cpu_attention as causal_attention
from gpudl.models import attention

SHAPE = (2, 3, 16, 8)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and no choices remembered from earlier tests."""
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    kernels.remembered_choice.cache_clear()
    yield tmp_path
    kernels.remembered_choice.cache_clear()


def by_hand(q, k, v):
    """softmax(q kᵀ / √d + causal mask) v in fp64: the reference."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("name", list(attention.CPU_KERNELS))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_every_kernel_matches_the_formula_and_its_gradients(name, dtype, tol):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SHAPE, generator=g).to(dtype).requires_grad_() for _ in range(3))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, reference = attention.CPU_KERNELS[name](q, k, v, 0.0), by_hand(*exact)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference, atol=tol, rtol=tol)
    upstream = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    out.backward(upstream.to(dtype))
    reference.backward(upstream)
    for mine, theirs in zip((q, k, v), exact, strict=True):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("winner", list(attention.CPU_KERNELS))
def test_bf16_training_runs_on_the_kernel_measured_fastest(fresh, monkeypatch, winner):
    monkeypatch.setattr(kernels, "_time_kernels", lambda *a: {k: 1.0 + (k != winner) for k in attention.CPU_KERNELS})
    calls = []
    monkeypatch.setitem(attention.CPU_KERNELS, winner, lambda *args: calls.append(winner) or by_hand(*args[:3]))
    q = torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    causal_attention(q, q, q)
    assert calls == [winner]


def test_composed_attention_drops_weights_as_sdpa_math_does():
    """Same seed, same mask: dropout acts on the softmax weights, scaled by 1 / (1 - p)."""
    q, k, v = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch.manual_seed(7)
    dropped = attention.composed(q, k, v, 0.5)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
        torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.manual_seed(7)
    torch.testing.assert_close(dropped, torch.nn.functional.dropout(scores.softmax(-1), 0.5) @ v)
    assert not torch.allclose(dropped, attention.composed(q, k, v, 0.0))


@pytest.mark.parametrize("seconds, expected", [((2.0, 1.0, 3.0), "math"), ((1.0, 2.0, 3.0), "flash"),
                                               ((2.0, 3.0, 1.0), "composed")])
def test_the_fastest_measured_kernel_is_chosen(fresh, monkeypatch, seconds, expected):
    monkeypatch.setattr(kernels, "_time_kernels",
                        lambda dtype, shape: dict(zip(("flash", "math", "composed"), seconds, strict=True)))
    assert fastest_cpu_kernel(torch.bfloat16, SHAPE) == expected


def test_kernels_are_timed_once_per_shape_and_kept_on_disk(fresh, monkeypatch):
    q = torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    causal_attention(q, q, q)  # measures, for real
    cached = json.loads((fresh / "attention.json").read_text())
    assert len(cached) == len(attention.CPU_KERNELS) and all("2x3x16x8" in key and seconds > 0 for key, seconds in cached.items())

    def no_timing(*args):
        raise AssertionError("timed again instead of reading the cache")

    monkeypatch.setattr(kernels, "_time_kernels", no_timing)
    kernels.remembered_choice.cache_clear()  # a new process: only the file remembers
    causal_attention(q, q, q)


def test_probing_leaves_the_runs_random_state_alone(fresh):
    torch.manual_seed(1)
    before = torch.get_rng_state()
    fastest_cpu_kernel(torch.bfloat16, SHAPE)
    assert torch.equal(torch.get_rng_state(), before)


def test_sdpa_keeps_its_own_choice_where_nothing_is_gained_or_asked(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "fastest_cpu_kernel", lambda *a: pytest.fail("measured where it should not"))
    bf16 = torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    causal_attention(*(torch.randn(SHAPE, requires_grad=True),) * 3)  # fp32: flash won everywhere measured
    with torch.no_grad():  # inference: a new length each generated token
        causal_attention(bf16, bf16, bf16)
    with sdpa_kernel(SDPBackend.MATH):  # the caller chose (the FLOP counter does)
        causal_attention(bf16, bf16, bf16)
    assert kernels.remembered_choice.cache_info().currsize == 0


def test_kernels_that_store_the_scores_are_not_tried_where_its_scores_would_be_large(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "_time_kernels", lambda *a: pytest.fail("timed a shape that is flash's"))
    assert fastest_cpu_kernel(torch.bfloat16, (64, 16, 1024, 64)) is None


def test_measuring_from_inside_activation_checkpointing_and_autocast_works(fresh):
    """The first forward that needs a measurement may be anywhere; the probe must not care."""
    x = torch.randn(SHAPE, requires_grad=True)

    def block(x):
        q = x.bfloat16()
        return causal_attention(q, q, q).float().sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    loss.backward()  # recomputes the block: the same kernel, from memory this time
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert len(json.loads((fresh / "attention.json").read_text())) == len(attention.CPU_KERNELS)


@pytest.mark.parametrize("winner, op", [("composed", "softmax"), ("flash", "scaled_dot_product_attention")])
def test_compiled_training_takes_the_measured_kernel_into_its_graph(fresh, monkeypatch, winner, op):
    """Chosen while tracing, without a graph break (fullgraph); with dynamic shapes, chosen too (one break)."""
    monkeypatch.setattr(kernels, "_time_kernels", lambda *a: {k: 1.0 + (k != winner) for k in attention.CPU_KERNELS})
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op.startswith("call_")])
        return gm.forward

    torch.compiler.reset()
    for batch, how in ((4, {"fullgraph": True}), (3, {"dynamic": True})):
        attend = torch.compile(lambda q, k, v: causal_attention(q, k, v), backend=record, **how)
        q, k, v = (torch.randn((batch, *SHAPE[1:]), dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = attend(q, k, v)
        torch.testing.assert_close(out.double(), by_hand(q, k, v), atol=3e-2, rtol=3e-2)
        out.sum().backward()
        assert torch.isfinite(q.grad).all()
        if kernels.CHOICE_TRACEABLE:
            assert any(op in target for target in graphs[-1]), f"{winner} is not in the graph compiled with {how}"
    if kernels.CHOICE_TRACEABLE:
        assert kernels.remembered_choice.cache_info().currsize == 2  # batch 4, then batch 3
    else:  # older torch: compiled attention keeps SDPA's choice
        assert kernels.remembered_choice.cache_info().currsize == 0
        assert all("scaled_dot_product_attention" in str(g) for g in graphs)
    torch.compiler.reset()


@pytest.mark.parametrize("setting, device, expected", [("auto", "cpu", "measured_cpu_attention"),
                                                      ("sdpa", "cpu", "sdpa"), ("auto", "cuda", "sdpa")])
def test_training_hands_the_model_the_kernel_its_setting_names(setting, device, expected):
    """build_job gives every attention layer the kernel `train.attention` names; a model alone keeps SDPA."""
    from gpudl import models
    from gpudl.config import load_config
    from gpudl.device import DeviceInfo, cpu_info
    from gpudl.training.job import Task, build_job
    from gpudl.training.precision import make_precision
    from gpudl.distributed.session import Session

    model = models.build(models.resolve("gpt-tiny", {"n_layer": 2}), torch.device("cpu"))
    layers = [m for m in model.modules() if type(m).__name__ == "Attention"]
    assert len(layers) == 2 and all(m.kernel is attention.sdpa for m in layers)
    info = cpu_info()
    if device == "cuda":  # only the choice is asked of it: the model stays where it is
        assert kernels.attention_kernel(DeviceInfo(**{**info.__dict__, "type": "cuda"}), setting) is attention.sdpa
        return
    cfg = load_config(None, [f"train.attention={setting}"])
    build_job(model, cfg, Session(info), make_precision("fp32", info), Task(models.loss_for(models.resolve("gpt-tiny"))))
    assert all(m.kernel.__name__ == expected for m in layers)
