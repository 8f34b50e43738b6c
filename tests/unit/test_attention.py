"""Causal attention on the measured CPU kernel: right numbers, the faster kernel, measured once."""

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpudl.models import attention
from gpudl.models.attention import causal_attention, fastest_cpu_kernel

SHAPE = (2, 3, 16, 8)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and no choices remembered from earlier tests."""
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention, "_chosen", {})
    return tmp_path


def by_hand(q, k, v):
    """softmax(q kᵀ / √d + causal mask) v in fp64: the reference."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("winner", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_attention_matches_the_formula_and_its_gradients_flow(fresh, monkeypatch, dtype, tol, winner):
    monkeypatch.setattr(attention, "_time_kernels", lambda *a: {k: 1.0 + (k != winner) for k in attention.CPU_CANDIDATES})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SHAPE, generator=g).to(dtype).requires_grad_() for _ in range(3))
    out = causal_attention(q, k, v)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), by_hand(q, k, v), atol=tol, rtol=tol)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("flash, math_, expected", [(2.0, 1.0, SDPBackend.MATH), (1.0, 2.0, SDPBackend.FLASH_ATTENTION)])
def test_the_faster_measured_kernel_is_chosen(fresh, monkeypatch, flash, math_, expected):
    monkeypatch.setattr(attention, "_time_kernels",
                        lambda dtype, shape: {SDPBackend.FLASH_ATTENTION: flash, SDPBackend.MATH: math_})
    assert fastest_cpu_kernel(torch.bfloat16, SHAPE) == expected


def test_kernels_are_timed_once_per_shape_and_kept_on_disk(fresh, monkeypatch):
    q = torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    causal_attention(q, q, q)  # measures, for real
    cached = json.loads((fresh / "attention.json").read_text())
    assert len(cached) == 2 and all("2x3x16x8" in key and seconds > 0 for key, seconds in cached.items())

    def no_timing(*args):
        raise AssertionError("timed again instead of reading the cache")

    monkeypatch.setattr(attention, "_time_kernels", no_timing)
    monkeypatch.setattr(attention, "_chosen", {})  # a new process: only the file remembers
    causal_attention(q, q, q)


def test_probing_leaves_the_runs_random_state_alone(fresh):
    torch.manual_seed(1)
    before = torch.get_rng_state()
    fastest_cpu_kernel(torch.bfloat16, SHAPE)
    assert torch.equal(torch.get_rng_state(), before)


def test_sdpa_keeps_its_own_choice_where_nothing_is_gained_or_asked(fresh, monkeypatch):
    monkeypatch.setattr(attention, "fastest_cpu_kernel", lambda *a: pytest.fail("measured where it should not"))
    bf16 = torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    causal_attention(*(torch.randn(SHAPE, requires_grad=True),) * 3)  # fp32: flash won everywhere measured
    with torch.no_grad():  # inference: a new length each generated token
        causal_attention(bf16, bf16, bf16)
    with sdpa_kernel(SDPBackend.MATH):  # the caller chose (the FLOP counter does)
        causal_attention(bf16, bf16, bf16)
    assert attention._chosen == {}


def test_the_math_kernel_is_not_tried_where_its_scores_would_be_large(fresh, monkeypatch):
    monkeypatch.setattr(attention, "_time_kernels", lambda *a: pytest.fail("timed a shape that is flash's"))
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
    assert len(json.loads((fresh / "attention.json").read_text())) == 2
