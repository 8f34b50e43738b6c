"""What a run measures as it goes: throughput, MFU and memory.

MFU is achieved model FLOP/s (the step's FLOPs, `flops.py`) over the peak measured on this
device for the precision the run uses.
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
    flops_per_step: float
    peak_flops: float
    world: int = 1                      # devices working on the job
    _t0: float = field(default_factory=time.perf_counter)
    _steps: int = 0

    def tick(self) -> None:
        self._steps += 1

    def window(self, exclude_s: float = 0.0) -> dict[str, float]:
        """Rates since the last call, leaving out `exclude_s` seconds; then start a new window."""
        now = time.perf_counter()
        dt = max(now - self._t0 - exclude_s, 1e-9)
        steps, self._t0, self._steps = self._steps, now, 0
        samples = steps * self.samples_per_step / dt
        return {
            "step_s": dt / max(steps, 1),
            "samples_per_s": samples,
            "units_per_s": samples * self.units_per_sample,
            "mfu": steps * self.flops_per_step / dt / (self.peak_flops * self.world) if self.peak_flops else 0.0,
        }

    def restart(self) -> None:
        self._t0, self._steps = time.perf_counter(), 0
