"""Peak FLOP/s measured by a short probe of dense kernels, cached per device, torch and precision.

MFU in gpudl is model FLOP/s over the vendor's datasheet peak (`datasheet_peak_flops`), as the
field quotes it, and beside it over the peak measured here for the precision the run uses: a
figure the reader's own machine produced, not a datasheet promise (and the only one a CPU has).

>>> from gpudl.device import cpu_info
>>> measured_peak_flops(cpu_info(), "fp32") > 1e9
True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .discovery import DeviceInfo, synchronize
from ..cache import cache_dir, read_json, write_json

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextmanager
def _matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def probe_peak_flops(device: torch.device, precisions: list[str], n: int,
                     min_seconds: float = 0.4) -> dict[str, float]:
    """Best FLOP/s of the probe's dense kernels at each precision, over timed rounds that take turns.

    The precisions alternate, a few kernel calls each, for `min_seconds` apiece: a busy moment on
    a shared machine then slows all of them alike instead of one, and the ratio between them
    (which `precision = "auto"` decides on) stays true.
    """
    g = torch.Generator().manual_seed(0)  # a private generator: probing must not move the run's RNG
    kernels = {p: _dense_kernels(device, DTYPES[p], n, g) for p in precisions}
    best = dict.fromkeys(precisions, 0.0)
    for p in precisions:  # warm-up: kernels chosen, caches filled
        with _matmul_precision(p):
            for run, _ in kernels[p]:
                run(), run()
    spent = 0.0
    while spent < min_seconds * len(precisions):
        for p in precisions:
            for run, flops in kernels[p]:
                with _matmul_precision(p):
                    dt = _time_calls(device, run, reps=3)
                spent += dt
                best[p] = max(best[p], flops * 3 / dt)
    return best


def _dense_kernels(device: torch.device, dtype: torch.dtype, n: int, g: torch.Generator) -> list[tuple]:
    """(call, FLOPs per call): an n x n x n matmul; on the CPU also a 3x3 convolution, because
    oneDNN's convolutions can outrun the BLAS matmul there (fp32 on an AMD EPYC: 221 against
    151 GFLOP/s), and a peak below what a model's kernels reach would put MFU over 100%."""
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    kernels = [(lambda: torch.mm(a, b), 2 * n**3)]
    if device.type == "cpu":
        batch, channels, side = 64, 128, 16
        x = torch.randn(batch, channels, side, side, generator=g).to(dtype).to(memory_format=torch.channels_last)
        w = torch.randn(channels, channels, 3, 3, generator=g).to(dtype).to(memory_format=torch.channels_last)
        conv = (lambda: F.conv2d(x, w, padding=1), 2 * batch * side * side * channels * channels * 9)
        try:
            conv[0]()
            kernels.append(conv)
        except RuntimeError:  # no CPU convolution at this dtype in this build: the matmul alone
            pass
    return kernels


def _time_calls(device: torch.device, run: Callable[[], object], reps: int) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    synchronize(device)
    return time.perf_counter() - t0


def _cache_key(info: DeviceInfo, precision: str) -> str:
    threads = f"|threads={torch.get_num_threads()}" if info.type == "cpu" else ""
    return f"{info.kind}|{info.name}|torch={torch.__version__}|{precision}{threads}"


def cached_measurements(file_name: str, info: DeviceInfo, whats: list[str], measure: Callable[[], dict[str, float]],
                        use_cache: bool = True, refresh: bool = False) -> dict[str, float]:
    """Figures for `whats`, measured together by `measure()` once per device and torch version.

    Kept in the cache file `file_name`; measured again when one of them is missing, or on
    `refresh`, which keeps the higher of the cached and the new figure (used for peaks: a busy
    moment on a shared machine can only pull a measurement down, never up).
    """
    path = cache_dir() / file_name
    cache = read_json(path) if use_cache else {}
    keys = {what: _cache_key(info, what) for what in whats}
    if refresh or not all(key in cache for key in keys.values()):
        fresh = {keys[what]: max(figure, cache.get(keys[what], 0.0) if refresh else 0.0)
                 for what, figure in measure().items()}
        cache.update(fresh)
        if use_cache:
            write_json(path, {**read_json(path), **fresh})
    return {what: float(cache[key]) for what, key in keys.items()}


def cached_measurement(file_name: str, info: DeviceInfo, what: str, measure: Callable[[], float],
                       use_cache: bool = True, refresh: bool = False) -> float:
    """`measure()` once per device, torch version and `what`; see `cached_measurements`."""
    return cached_measurements(file_name, info, [what], lambda: {what: measure()}, use_cache, refresh)[what]


def measured_peak_flops(info: DeviceInfo, precision: str, use_cache: bool = True, refresh: bool = False) -> float:
    """Peak FLOP/s of `info`'s device at `precision` (fp32 | tf32 | bf16 | fp16), measured once.

    The first call measures every precision the device runs, side by side, and caches them all;
    `refresh` measures again and keeps the best figure seen.
    """
    if precision not in info.precisions():
        raise ValueError(f"{info.label} does not run {precision}")
    n = 1024 if info.type == "cpu" else 8192
    return cached_measurements("peak_flops.json", info, info.precisions(),
                               lambda: probe_peak_flops(info.torch_device, info.precisions(), n),
                               use_cache, refresh)[precision]


def refresh_peaks(info: DeviceInfo) -> None:
    """Measure every precision's peak on `info`'s device again, keeping the best figures seen."""
    measured_peak_flops(info, info.precisions()[0], refresh=True)


def datasheet_peak_flops(info: DeviceInfo, precision: str) -> float | None:
    """The vendor's dense peak FLOP/s of `info`'s device at `precision` (a `peak_key`), or None where
    specs.py has no figure for it (every CPU, parts not in the table): MFU against it is then unknown,
    never guessed from another precision's figure."""
    tflops = info.datasheet_tflops.get(precision)
    return tflops * 1e12 if tflops else None


def peak_key(precision_policy: str) -> str:
    """Which peak (measured and datasheet) a precision policy is held against for MFU."""
    # fp8 against bf16's, as torchtitan quotes it: attention, the head and the small linears stay bf16,
    # and one figure across bf16-mixed and fp8 runs shows what fp8 bought.
    if precision_policy.startswith("bf16") or precision_policy == "fp8":
        return "bf16"
    if precision_policy.startswith("fp16"):
        return "fp16"
    return "fp32"


def measure_cpu_peaks_for_workers(threads: int) -> None:
    """Measure (and cache) the CPU's peaks at the thread count each CPU worker will run with.

    Called by the launcher before it starts the workers: measured by each worker instead, the
    probes would run side by side on shared cores and cache figures that are too low, for every
    later run's MFU and `precision = "auto"`.
    """
    from .discovery import cpu_info

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        measured_peak_flops(cpu_info(), "fp32")  # and every other precision the CPU runs
    finally:
        torch.set_num_threads(before)
