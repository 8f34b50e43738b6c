"""Precision policies: on the device each body is given (the CPU, told it has bf16/fp16; the
accelerator as it is, where there is one), then the choices and refusals, which are logic only."""

import dataclasses

import pytest
import torch

from gpudl.training import precision as prec
from gpudl.device import cpu_info, detect
from gpudl.errors import UserError


def cpu(**changes):
    return dataclasses.replace(cpu_info(), **changes)


def on(device: str, needs: str | None = None):
    """The description of `device`: the CPU said to run bf16 and fp16 (autocast runs both there, if slowly),
    an accelerator as it reports itself (skipped when it lacks `needs`)."""
    if device == "cpu":
        return cpu(bf16=True, fp16=True)
    info = detect(device)
    if needs and not getattr(info, needs):
        pytest.skip(f"{info.label} does not run {needs}")
    return info


def test_fp32_has_no_autocast_and_no_scaler(device):
    p = prec.make_precision("fp32", on(device))
    x = torch.randn(4, 4, device=device)
    with p.autocast():
        assert (x @ x).dtype == torch.float32
    assert p.scaler is None and p.param_dtype == torch.float32


def test_bf16_mixed_runs_matmuls_in_bf16_and_keeps_fp32_weights(device):
    p = prec.make_precision("bf16-mixed", on(device, "bf16"))
    lin = torch.nn.Linear(4, 4).to(device)
    with p.autocast():
        assert lin(torch.randn(2, 4, device=device)).dtype == torch.bfloat16
    assert p.param_dtype == torch.float32 and lin.weight.dtype == torch.float32 and p.scaler is None


def test_bf16_true_stores_weights_in_bf16(device):
    p = prec.make_precision("bf16-true", on(device, "bf16"))
    assert p.param_dtype == torch.bfloat16 and p.autocast_dtype is None


def test_fp16_mixed_runs_matmuls_in_fp16_with_a_grad_scaler(device):
    p = prec.make_precision("fp16-mixed", on(device, "fp16"))
    assert isinstance(p.scaler, torch.amp.GradScaler) and p.autocast_dtype == torch.float16
    lin = torch.nn.Linear(4, 4).to(device)
    with p.autocast():
        out = lin(torch.randn(2, 4, device=device))
    assert out.dtype == torch.float16 and lin.weight.dtype == torch.float32
    # Small enough that the scaled gradient (x 65536, the scaler's first scale) stays below fp16's 65504.
    p.backward(out.float().sum() * 2.0**-10)
    p.unscale(torch.optim.SGD(lin.parameters(), lr=0.0))
    assert all(torch.isfinite(q.grad).all() for q in lin.parameters())
    assert lin.bias.grad.eq(2 * 2.0**-10).all()  # d(loss)/d(bias): the batch's 2 rows, back at the true scale


def test_a_precision_the_device_lacks_is_refused_with_the_choices():
    with pytest.raises(UserError, match=r"precision 'bf16-mixed' needs bf16 support.*use one of fp32"):
        prec.make_precision("bf16-mixed", cpu(bf16=False))
    with pytest.raises(UserError, match=r"precision 'fp16-mixed' needs fp16"):
        prec.make_precision("fp16-mixed", cpu(fp16=False))
    with pytest.raises(UserError, match="unknown precision 'fp4'"):
        prec.make_precision("fp4", cpu())


@pytest.mark.parametrize("ratio, expected", [(2.4, "bf16-mixed"), (1.1, "fp32")])
def test_auto_on_the_cpu_follows_the_measured_bf16_speedup(monkeypatch, ratio, expected):
    monkeypatch.setattr(prec, "measured_peak_flops", lambda info, p: {"fp32": 1e11, "bf16": ratio * 1e11}[p])
    p = prec.make_precision("auto", cpu(bf16=True))
    assert p.name == expected and f"{ratio:.1f}x" in p.reason


def test_auto_on_a_cpu_without_bf16_is_fp32():
    assert prec.make_precision("auto", cpu(bf16=False)).name == "fp32"


def test_auto_on_accelerators():
    gpu = dataclasses.replace(cpu(), kind="cuda", type="cuda", index=0, name="Fake GPU")
    assert prec.auto_policy(dataclasses.replace(gpu, bf16=True, fp16=True))[0] == "bf16-mixed"
    assert prec.auto_policy(dataclasses.replace(gpu, bf16=False, fp16=True))[0] == "fp16-mixed"
    assert prec.auto_policy(dataclasses.replace(gpu, bf16=False, fp16=False))[0] == "fp32"


def test_fp32_means_no_tf32_convolutions_on_cuda_and_the_others_restore_torchs_default():
    # cuDNN's fp32 convolutions default to TF32; the fp32 policy must not silently run them so.
    before = torch.backends.cudnn.allow_tf32
    gpu = dataclasses.replace(cpu(), kind="cuda", type="cuda", index=0, name="Fake GPU", bf16=True)
    try:
        prec.make_precision("fp32", gpu)
        assert torch.backends.cudnn.allow_tf32 is False
        prec.make_precision("fp32", cpu())  # the CPU leaves cuDNN's setting alone
        assert torch.backends.cudnn.allow_tf32 is False
        prec.make_precision("bf16-mixed", gpu)
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cudnn.allow_tf32 = before
