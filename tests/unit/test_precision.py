import dataclasses

import pytest
import torch

from gpudl.training import precision as prec
from gpudl.device import cpu_info
from gpudl.errors import UserError


def cpu(**changes):
    return dataclasses.replace(cpu_info(), **changes)


def test_fp32_has_no_autocast_and_no_scaler():
    p = prec.make_precision("fp32", cpu())
    x = torch.randn(4, 4)
    with p.autocast():
        assert (x @ x).dtype == torch.float32
    assert p.scaler is None and p.param_dtype == torch.float32


def test_bf16_mixed_runs_matmuls_in_bf16_and_keeps_fp32_weights():
    p = prec.make_precision("bf16-mixed", cpu(bf16=True))
    lin = torch.nn.Linear(4, 4)
    with p.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    assert p.param_dtype == torch.float32 and lin.weight.dtype == torch.float32


def test_bf16_true_stores_weights_in_bf16():
    p = prec.make_precision("bf16-true", cpu(bf16=True))
    assert p.param_dtype == torch.bfloat16 and p.autocast_dtype is None


def test_fp16_mixed_has_a_grad_scaler():
    p = prec.make_precision("fp16-mixed", cpu(fp16=True))
    assert isinstance(p.scaler, torch.amp.GradScaler) and p.autocast_dtype == torch.float16


def test_a_precision_the_device_lacks_is_refused_with_the_choices():
    with pytest.raises(UserError, match=r"precision 'bf16-mixed' needs bf16 support.*use one of fp32"):
        prec.make_precision("bf16-mixed", cpu(bf16=False))
    with pytest.raises(UserError, match=r"precision 'fp16-mixed' needs fp16"):
        prec.make_precision("fp16-mixed", cpu(fp16=False))
    with pytest.raises(UserError, match="unknown precision 'fp8'"):
        prec.make_precision("fp8", cpu())


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
