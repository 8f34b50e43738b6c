"""Numeric precision policies: fp32 | bf16-mixed | fp16-mixed | bf16-true | fp8, and `auto`.

A policy is the one object the training loop asks for autocast, backward, and the optimizer
step, so the loop has no precision branches of its own. fp8 is bf16-mixed whose large linears
`parallelize` turns into torchao's float8 ones (`distributed/float8.py`); the loop sees bf16-mixed.

>>> from gpudl.device import cpu_info
>>> p = make_precision("fp32", cpu_info())
>>> p.name, p.param_dtype
('fp32', torch.float32)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..device import DeviceInfo
from ..errors import UserError
from ..device.peak import measured_peak_flops

POLICIES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp8")

# On the CPU, bf16 autocast pays only where bf16 matmuls are clearly faster than fp32 ones
# (native AVX512-BF16/AMX): measured, not guessed. Below this ratio fp32 is the faster choice.
CPU_BF16_MIN_SPEEDUP = 1.5


@dataclass
class Precision:
    """How to run forward, backward and the step at one precision on one device type."""

    name: str
    device_type: str
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype
    scaler: torch.amp.GradScaler | None = None
    reason: str = ""
    # fp8 only: torchao's emulated float8 matmuls instead of the fp8 tensor cores' (tests, on the CPU)
    fp8_emulate: bool = False
    # fp8 only: which linears `build_job` made float8 and which stayed bf16, for the start block
    linears: str = ""

    @property
    def float8_linears(self) -> bool:
        """Whether `parallelize` turns this policy's linears into float8 ones."""
        return self.name == "fp8"

    def describe(self) -> str:
        """The start block's line: `fp8 (asked for; rowwise: 48 of 49 linears in float8, ...)`."""
        return f"{self.name} ({'; '.join(x for x in (self.reason, self.linears) if x)})"

    def autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale before clipping (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, finite: bool) -> None:
        """Apply the update if the gradients are finite; let the fp16 loss scale adapt either way."""
        if finite:
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler is not None:
            self.scaler.update()

    def step_unless(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                    veto: torch.Tensor | None = None) -> None:
        """The update, skipped on the device where `found_inf` (a 0-dim float32 tensor) is 1: no host read.

        Needs a fused optimizer, whose kernel takes `found_inf` as GradScaler hands it over. With the
        fp16 scaler the scaler's own flag from unscaling decides, and the loss scale adapts as with `step`;
        a `veto` (a loss spike) is then read on the host, as the scaler takes no flag of ours."""
        if self.scaler is not None:
            if veto is None or not bool(veto):
                self.scaler.step(optimizer)
            self.scaler.update()
            return
        optimizer.found_inf, optimizer.grad_scale = found_inf, None  # what the fused step reads
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def auto_policy(info: DeviceInfo) -> tuple[str, str]:
    """(policy, why) for `precision = "auto"` on this device."""
    if info.type == "cpu":
        if not info.bf16:
            return "fp32", "this CPU has no native bf16 instructions"
        speedup = measured_peak_flops(info, "bf16") / measured_peak_flops(info, "fp32")
        if speedup >= CPU_BF16_MIN_SPEEDUP:
            return "bf16-mixed", f"bf16 measured {speedup:.1f}x faster than fp32 on this CPU"
        return "fp32", f"bf16 measured only {speedup:.1f}x fp32 on this CPU"
    if info.bf16:
        return "bf16-mixed", f"{info.name} runs bf16 natively"
    if info.fp16:
        return "fp16-mixed", f"{info.name} has no bf16; fp16 with loss scaling"
    return "fp32", f"{info.name} has neither bf16 nor fp16"


def _check_supported(name: str, info: DeviceInfo) -> None:
    if name == "fp8":
        _check_fp8(info)
        return
    needs = "bf16" if name.startswith("bf16") else "fp16" if name.startswith("fp16") else None
    if needs and not getattr(info, needs):
        others = [p for p in POLICIES if p == "fp32" or getattr(info, p[:4])]
        raise UserError(f"precision {name!r} needs {needs} support, which {info.label} lacks: "
                        f"use one of {', '.join(others)}")


def _check_fp8(info: DeviceInfo) -> None:
    if not info.fp8:
        fix = "bf16-mixed" if info.bf16 else "fp16-mixed" if info.fp16 else "fp32"
        raise UserError(f"precision 'fp8' needs fp8 tensor cores (NVIDIA compute capability 8.9 or newer: Ada, "
                        f"Hopper, Blackwell), which {info.label} lacks: use {fix}")
    require_torchao()


def require_torchao() -> None:
    """torchao, which fp8 training runs on, is an extra: refused in one line where it is missing."""
    from importlib.util import find_spec

    if find_spec("torchao") is None:
        raise UserError("precision 'fp8' needs torchao: pip install 'gpudl[fp8]'")


def _cudnn_tf32(info: DeviceInfo, allow: bool) -> None:
    """Whether cuDNN may run fp32 convolutions in TF32: not under the fp32 policy; torch's default
    (yes) under the others.

    torch runs fp32 matmuls in IEEE fp32 by default but fp32 convolutions in TF32 on Ampere and
    later, so a ResNet "in fp32" would run at TF32's speed and precision while its MFU is taken
    against the fp32 peak. Set for every policy, so runs in one process do not inherit each other's.
    The flag of torch's older API, which sets convolutions and RNNs alike: setting only
    `cudnn.conv.fp32_precision` of the newer one makes torch refuse to read `allow_tf32` after.
    """
    if info.type == "cuda":
        torch.backends.cudnn.allow_tf32 = allow


def param_dtype_of(name: str) -> torch.dtype:
    """The dtype a policy keeps the weights (and so their gradients) in: bf16 for bf16-true, else fp32
    (fp8 too: its weights stay fp32, cast to fp8 for each matmul)."""
    return torch.bfloat16 if name == "bf16-true" else torch.float32


def make_precision(name: str, info: DeviceInfo, emulate_fp8: bool = False) -> Precision:
    """The policy named `name` (or the best one for "auto") on device `info`.

    `emulate_fp8` (internal, for tests: no config key reaches it): fp8 on a device without fp8 tensor
    cores, through torchao's emulated float8 matmuls; slow, for checking numerics and plumbing only.
    """
    reason = "asked for"
    if name == "auto":
        name, reason = auto_policy(info)  # never fp8: opt-in until measurements say where it pays
    if name not in POLICIES:
        raise UserError(f"unknown precision {name!r}; choose one of: auto, {', '.join(POLICIES)}")
    if name == "fp8" and emulate_fp8:
        require_torchao()
    else:
        _check_supported(name, info)
    _cudnn_tf32(info, allow=name != "fp32")
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16-true": None,
             "fp8": torch.bfloat16}[name]
    scaler = torch.amp.GradScaler(info.type) if name == "fp16-mixed" else None
    return Precision(name, info.type, dtype, param_dtype_of(name), scaler, reason,
                     fp8_emulate=name == "fp8" and emulate_fp8)
