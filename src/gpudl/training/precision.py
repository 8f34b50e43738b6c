"""Numeric precision policies: fp32 | bf16-mixed | fp16-mixed | bf16-true, and `auto`.

A policy is the one object the training loop asks for autocast, backward, and the optimizer
step, so the loop has no precision branches of its own.

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

POLICIES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")

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
    needs = "bf16" if name.startswith("bf16") else "fp16" if name.startswith("fp16") else None
    if needs and not getattr(info, needs):
        others = [p for p in POLICIES if p == "fp32" or getattr(info, p[:4])]
        raise UserError(f"precision {name!r} needs {needs} support, which {info.label} lacks: "
                        f"use one of {', '.join(others)}")


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
    """The dtype a policy keeps the weights (and so their gradients) in: bf16 for bf16-true, else fp32."""
    return torch.bfloat16 if name == "bf16-true" else torch.float32


def make_precision(name: str, info: DeviceInfo) -> Precision:
    """The policy named `name` (or the best one for "auto") on device `info`."""
    reason = "asked for"
    if name == "auto":
        name, reason = auto_policy(info)
    if name not in POLICIES:
        raise UserError(f"unknown precision {name!r}; choose one of: auto, {', '.join(POLICIES)}")
    _check_supported(name, info)
    _cudnn_tf32(info, allow=name != "fp32")
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16-true": None}[name]
    scaler = torch.amp.GradScaler(info.type) if name == "fp16-mixed" else None
    return Precision(name, info.type, dtype, param_dtype_of(name), scaler, reason)
