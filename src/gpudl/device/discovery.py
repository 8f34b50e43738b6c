"""Find the accelerator through `torch.accelerator` (CPU fallback) and describe it.

Nothing here runs at import time: call `detect()` when a device is needed.

>>> info = detect("cpu")
>>> info.kind, info.type
('cpu', 'cpu')
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import torch

from . import specs as device_specs
from ..errors import UserError

# The process-group backend that torch.distributed ships for each device type.
DIST_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl", "npu": "hccl", "cpu": "gloo", "mps": "gloo"}


@dataclass(frozen=True)
class DeviceInfo:
    """What gpudl knows about one device; fields are None where the backend does not say."""

    kind: str                      # cuda | rocm | mps | xpu | xla | cpu | <other accelerator type>
    type: str                      # torch's device type ("cuda" for ROCm too)
    index: int | None              # None for the CPU
    name: str
    count: int                     # devices of this kind on the machine
    memory_bytes: int | None
    compute_units: int | None      # SMs (NVIDIA), CUs (AMD), Xe cores (Intel), cores (CPU)
    unit_name: str                 # what one compute unit is called
    lanes_per_unit: int | None     # FP32 cores per SM/CU; SIMD FP32 lanes per CPU core
    threads_per_unit: int | None   # max resident threads per SM/CU; hardware threads per core
    warp_size: int | None          # threads in a warp (NVIDIA) or wavefront (AMD)
    capability: str | None         # compute capability (8.0) or GPU arch (gfx942); ISA on CPU
    bf16: bool = False
    fp16: bool = False
    tf32: bool = False
    fp8: bool = False              # fp8 tensor cores that gpudl trains with (torchao): NVIDIA compute capability 8.9+
    datasheet_tflops: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)

    @property
    def label(self) -> str:
        where = f"{self.kind}:{self.index}" if self.index is not None else self.kind
        return f"{where} ({self.name})"

    @property
    def dist_backend(self) -> str:
        return DIST_BACKENDS.get(self.type, "gloo")

    def precisions(self) -> list[str]:
        """Matmul precisions this device runs: fp32 always, then what it supports."""
        return ["fp32"] + [p for p in ("tf32", "bf16", "fp16") if getattr(self, p)]


def _accelerator_type() -> str | None:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else None


def _xla_present() -> bool:
    from importlib.util import find_spec

    return find_spec("torch_xla") is not None


def _kind_of(device_type: str) -> str:
    return "rocm" if device_type == "cuda" and torch.version.hip else device_type


def available() -> list[str]:
    """Device kinds present on this machine, best first; "cpu" is always last."""
    kinds = []
    acc = _accelerator_type()
    if acc is not None:
        kinds.append(_kind_of(acc))
    if _xla_present():
        kinds.append("xla")
    return kinds + ["cpu"]


def _parse_request(requested: str) -> tuple[str, int | None]:
    kind, _, index = requested.strip().lower().partition(":")
    if index and not index.isdigit():
        raise UserError(f"device {requested!r} has a bad index: use e.g. cuda:0")
    return kind, int(index) if index else None


def detect(requested: str = "auto", local_rank: int | None = None) -> DeviceInfo:
    """The device to run on: the best one present for "auto", else the one asked for.

    `local_rank` picks the device of this process when several processes share a machine.
    """
    kinds = available()
    kind, index = _parse_request(requested)
    if kind == "auto":
        kind = kinds[0]
    if kind == "cuda" and "rocm" in kinds:
        kind = "rocm"  # ROCm builds of torch speak "cuda"; accept both spellings
    if kind not in kinds:
        raise UserError(f"device {requested!r} is not present on this machine; present: {', '.join(kinds)} "
                        f"(use --device {kinds[0]})")
    if kind == "cpu":
        return cpu_info()
    if kind == "xla":
        return _xla_info()
    device_type = "cuda" if kind == "rocm" else kind
    count = torch.accelerator.device_count()
    if index is None:
        index = (local_rank or 0) % max(count, 1)
    if index >= count:
        raise UserError(f"device {requested!r} does not exist: this machine has {count} {kind} device(s), "
                        f"indices 0..{count - 1}")
    return accelerator_info(device_type, index, count)


def _versions(device_type: str) -> dict[str, str]:
    out = {"torch": torch.__version__.split("+")[0]}
    if device_type == "cuda" and torch.version.hip:
        out["hip"] = str(torch.version.hip)
    elif device_type == "cuda" and torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # no public API reports it
        if driver is not None:
            try:
                v = driver()
                out["driver (CUDA API)"] = f"{v // 1000}.{(v % 1000) // 10}"
            except RuntimeError:
                pass
    if device_type == "xpu" and getattr(torch.version, "xpu", None):
        out["xpu"] = str(torch.version.xpu)
    return out


def accelerator_info(device_type: str, index: int, count: int) -> DeviceInfo:
    """Describe accelerator `index` of `device_type` from what torch reports."""
    if device_type == "cuda":
        return _cuda_info(index, count)
    if device_type == "mps":
        return _mps_info(count)
    module = torch.get_device_module(device_type)
    props = module.get_device_properties(index) if hasattr(module, "get_device_properties") else None
    name = getattr(props, "name", None) or _safe(lambda: module.get_device_name(index)) or device_type
    # An Xe core is a "subslice" of 8-16 EUs; gpu_eu_count and max_compute_units count EUs, not Xe cores.
    units = getattr(props, "gpu_subslice_count" if device_type == "xpu" else "max_compute_units", None)
    return DeviceInfo(
        kind=device_type, type=device_type, index=index, name=str(name), count=count,
        memory_bytes=getattr(props, "total_memory", None), compute_units=units,
        unit_name="Xe core" if device_type == "xpu" else "compute unit", lanes_per_unit=None,
        threads_per_unit=None, warp_size=_first(getattr(props, "sub_group_sizes", None)), capability=None,
        bf16=bool(_safe(lambda: module.is_bf16_supported(), default=True)), fp16=getattr(props, "has_fp16", True),
        datasheet_tflops=device_specs.datasheet_tflops(str(name)), versions=_versions(device_type))


def _cuda_info(index: int, count: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    hip = bool(torch.version.hip)
    major, minor = props.major, props.minor
    arch = getattr(props, "gcnArchName", None) if hip else None
    return DeviceInfo(
        kind="rocm" if hip else "cuda", type="cuda", index=index, name=props.name, count=count,
        memory_bytes=props.total_memory, compute_units=props.multi_processor_count,
        unit_name="CU" if hip else "SM",
        lanes_per_unit=device_specs.AMD_SP_PER_CU if hip else device_specs.cuda_cores_per_sm(major, minor),
        threads_per_unit=getattr(props, "max_threads_per_multi_processor", None),
        warp_size=getattr(props, "warp_size", None), capability=arch or f"{major}.{minor}",
        bf16=bool(_safe(lambda: torch.cuda.is_bf16_supported(including_emulation=False), default=major >= 8)),
        fp16=True, tf32=(not hip and major >= 8) or (hip and "gfx94" in str(arch)),
        fp8=_fp8_tensor_cores(hip, major, minor),
        datasheet_tflops=device_specs.datasheet_tflops(props.name), versions=_versions("cuda"))


def _fp8_tensor_cores(hip: bool, major: int, minor: int) -> bool:
    """Whether torchao's float8 training kernels run here: NVIDIA Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x).
    AMD's MI300 has fp8 too (its own fnuz formats), but gpudl has not trained on it: False until verified."""
    return not hip and (major, minor) >= (8, 9)


def _mps_info(count: int) -> DeviceInfo:
    name = platform.processor() or "Apple GPU"
    memory = _safe(lambda: torch.mps.recommended_max_memory())
    return DeviceInfo(
        kind="mps", type="mps", index=0, name=f"Apple GPU ({name})", count=count, memory_bytes=memory,
        compute_units=None, unit_name="GPU core", lanes_per_unit=None, threads_per_unit=None, warp_size=32,
        capability=platform.mac_ver()[0] or None, bf16=True, fp16=True, versions=_versions("mps"))


def _xla_info() -> DeviceInfo:
    import torch_xla.runtime as xr  # only imported when the user asked for an XLA device

    kind = str(_safe(xr.device_type, default="XLA"))
    return DeviceInfo(
        kind="xla", type="xla", index=0, name=kind, count=int(_safe(xr.global_runtime_device_count, default=1)),
        memory_bytes=None, compute_units=None, unit_name="core", lanes_per_unit=None, threads_per_unit=None,
        warp_size=None, capability=None, bf16=True, fp16=False, versions=_versions("xla"))


def cpu_info() -> DeviceInfo:
    """The host CPU: cores, threads per core, SIMD width and bf16/fp16 support from oneDNN."""
    cores, threads_per_core = _cpu_topology()
    isa = torch.backends.cpu.get_cpu_capability()  # e.g. AVX512, AVX2, NEON
    lanes = {"AVX512": 16, "AVX2": 8, "DEFAULT": 4}.get(isa.split("_")[0], 4)
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    memory = pages * os.sysconf("SC_PAGE_SIZE") if pages else None
    return DeviceInfo(
        kind="cpu", type="cpu", index=None, name=_cpu_name(), count=1, memory_bytes=memory,
        compute_units=cores, unit_name="core", lanes_per_unit=lanes, threads_per_unit=threads_per_core,
        warp_size=None, capability=isa, bf16=_mkldnn_supports("bf16"), fp16=_mkldnn_supports("fp16"),
        versions=_versions("cpu"))


def _mkldnn_supports(dtype: str) -> bool:
    # oneDNN knows whether this CPU has native bf16/fp16 instructions; torch exposes it only as an op.
    op = getattr(torch.ops.mkldnn, f"_is_mkldnn_{dtype}_supported", None)
    return bool(_safe(op, default=False)) if op is not None else False


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def usable_cpus() -> int:
    """Logical CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_topology() -> tuple[int, int]:
    """(physical cores usable by this process, hardware threads per core)."""
    logical = usable_cpus()
    try:
        text = open("/proc/cpuinfo", encoding="utf8").read()
        siblings = int(text.split("siblings")[1].split(":")[1].split()[0])
        cores = int(text.split("cpu cores")[1].split(":")[1].split()[0])
        per_core = max(1, siblings // max(cores, 1))
    except (OSError, IndexError, ValueError):
        per_core = 1
    return max(1, logical // per_core), per_core


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cpu":
        return
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()
    else:
        torch.accelerator.synchronize(device)


def _first(values):
    return values[0] if values else None


def _safe(fn, default=None):
    try:
        return fn()
    except Exception:  # a backend that cannot answer a question is not an error for a description
        return default
