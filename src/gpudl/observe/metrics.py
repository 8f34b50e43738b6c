"""What a run measures as it goes: throughput, MFU and memory.

MFU is achieved model FLOP/s (the step's FLOPs, `flops.py`) over a peak for the precision the run
uses: `mfu` over the peak measured on this device (the key's meaning since the first run folders),
`mfu_datasheet` over the vendor's datasheet figure, which the field quotes. Either is None where it
is unknown (FLOPs that could not be counted; no datasheet figure, as on every CPU): never 0.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field

import torch

from ..device.accel import peak_allocated, reset_peak


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory this process has used on `device`: tensors on an accelerator (torch.accelerator's
    statistics), the peak resident set size on the CPU."""
    if device.type != "cpu":
        return peak_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for `peak_memory_bytes` (the CPU: Linux resets the peak RSS on request)."""
    if device.type != "cpu":
        reset_peak(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets the process's peak RSS
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak stays the process's lifetime peak
        pass


@dataclass
class Throughput:
    """Rates over a window of steps: samples/s, units (tokens or images)/s, MFU."""

    samples_per_step: int
    units_per_sample: int
    flops_per_step: float               # 0: not counted, so no MFU
    peak_flops: float                   # one device's, measured (device/peak.py)
    world: int = 1                      # devices working on the job
    datasheet_flops: float | None = None  # one device's datasheet peak; None where there is none
    _t0: float = field(default_factory=time.perf_counter)
    _steps: int = 0

    def tick(self) -> None:
        self._steps += 1

    def window(self, exclude_s: float = 0.0) -> dict[str, float | None]:
        """Rates since the last call, leaving out `exclude_s` seconds; then start a new window."""
        now = time.perf_counter()
        dt = max(now - self._t0 - exclude_s, 1e-9)
        steps, self._t0, self._steps = self._steps, now, 0
        samples = steps * self.samples_per_step / dt
        per_device = steps * self.flops_per_step / dt / self.world
        return {
            "step_s": dt / max(steps, 1),
            "samples_per_s": samples,
            "units_per_s": samples * self.units_per_sample,
            "mfu": self._share(per_device, self.peak_flops),
            "mfu_datasheet": self._share(per_device, self.datasheet_flops),
        }

    def _share(self, flops_per_s: float, peak: float | None) -> float | None:
        # None, not 0.0, where either side is unknown: a 0% MFU would read as a measurement
        return flops_per_s / peak if self.flops_per_step and peak else None

    def restart(self) -> None:
        self._t0, self._steps = time.perf_counter(), 0
