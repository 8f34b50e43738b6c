"""Device detection, measured peaks and `gpudl info`.

The CPU is detected for real; every other backend is faked by patching only what `torch`
reports (torch.accelerator, torch.cuda, torch.version, torch.get_device_module), so these
tests exercise discovery's own logic end to end on any machine. What a CPU-only machine must
answer is asked with the accelerator hidden (`no_accelerator`), so it holds on a GPU machine
too; where an accelerator is present, the real one is detected as well (`accelerator`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from rich.console import Console

import gpudl.device.peak
from gpudl.device import specs as device_specs
from gpudl.device import DeviceInfo, available, cpu_info, detect
from gpudl.errors import UserError
from gpudl.device.info import as_json, peaks, render
from gpudl.device.peak import measured_peak_flops, peak_key, refresh_peaks

GiB = 2**30


def _fake_accelerator(monkeypatch, device_type: str, count: int) -> None:
    """Make torch.accelerator report `count` devices of `device_type`."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(device_type))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)


def _fake_cuda_props(index: int, **fields):
    if not 0 <= index < 2:
        raise AssertionError(f"device.py asked for the properties of device {index}")
    return types.SimpleNamespace(**fields)


@pytest.fixture
def h200(monkeypatch):
    """Two NVIDIA H200s behind a CUDA 12.8 build of torch."""
    _fake_accelerator(monkeypatch, "cuda", 2)
    props = dict(name="NVIDIA H200", total_memory=141 * GiB, multi_processor_count=132, major=9, minor=0,
                 max_threads_per_multi_processor=2048, warp_size=32)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: _fake_cuda_props(i, **props))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    # A private torch call (no public API reports the driver); absent from CPU builds of torch.
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)


@pytest.fixture
def mi300x(monkeypatch):
    """Eight AMD MI300Xs behind a ROCm 6.2 build of torch (which calls its device type "cuda")."""
    _fake_accelerator(monkeypatch, "cuda", 8)
    props = types.SimpleNamespace(name="AMD Instinct MI300X", total_memory=192 * GiB, multi_processor_count=304,
                                  major=9, minor=4, gcnArchName="gfx942", max_threads_per_multi_processor=2048,
                                  warp_size=64)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.version, "cuda", None)


def _text(renderable) -> str:
    console = Console(record=True, width=120)
    console.print(renderable)
    return console.export_text()


# ---------------------------------------------------------------- the real CPU


def test_real_cpu_is_detected(no_accelerator):
    info = detect("auto")
    assert info.kind == "cpu" and info.type == "cpu" and info.index is None
    assert info.compute_units >= 1 and info.unit_name == "core"
    assert info.memory_bytes > 0
    assert info.lanes_per_unit in (4, 8, 16)
    assert info.torch_device == torch.device("cpu")
    assert info.dist_backend == "gloo"
    assert info.precisions()[0] == "fp32" and "tf32" not in info.precisions()
    assert info.versions["torch"] == torch.__version__.split("+")[0]
    assert detect("cpu") == info
    assert detect(" CPU ") == info


def test_real_cpu_is_detected_when_asked_for_beside_an_accelerator():
    info = detect("cpu")  # whatever else the machine has
    assert (info.kind, info.type, info.index) == ("cpu", "cpu", None) and info.dist_backend == "gloo"
    assert available()[-1] == "cpu"


def test_available_lists_cpu_last(no_accelerator):
    assert available() == ["cpu"]  # a CPU-only machine


@pytest.mark.parametrize("requested", ["cuda", "mps", "xpu", "rocm", "cuda:0", "tpu"])
def test_absent_device_lists_what_is_present(no_accelerator, requested):
    with pytest.raises(UserError) as err:
        detect(requested)
    message = str(err.value)
    assert repr(requested) in message
    assert "present: cpu" in message and "--device cpu" in message


@pytest.mark.parametrize("requested", ["cuda:x", "cuda:-1", "cpu:one"])
def test_malformed_request_is_a_user_error(requested):
    with pytest.raises(UserError, match="bad index"):
        detect(requested)


# ---------------------------------------------------------------- the real accelerator, where there is one


def test_real_accelerator_is_detected(accelerator):
    count = torch.accelerator.device_count()
    kinds = available()
    kind = kinds[0]
    assert kind in (accelerator, "rocm" if accelerator == "cuda" else accelerator) and kinds[-1] == "cpu"
    info = detect(accelerator)
    assert (info.type, info.kind, info.index, info.count) == (accelerator, kind, 0, count)
    assert info.torch_device == torch.device(accelerator, 0)
    assert detect("auto") == info == detect(kind)  # the accelerator is the best device present
    if accelerator in ("cuda", "xpu"):  # the collective library torch ships for it: NCCL (RCCL on ROCm), XCCL
        assert info.dist_backend == torch.distributed.get_default_backend_for_device(accelerator)
    assert info.precisions()[0] == "fp32" and info.versions["torch"] == torch.__version__.split("+")[0]
    assert info.memory_bytes is None or info.memory_bytes > 0  # None: a backend that does not say
    assert detect(f"{accelerator}:{count - 1}").index == count - 1
    assert detect("auto", local_rank=count).index == 0  # more ranks than devices wrap around
    with pytest.raises(UserError, match=rf"does not exist: this machine has {count} {kind} device"):
        detect(f"{accelerator}:{count}")


# ---------------------------------------------------------------- NVIDIA (faked)


def test_faked_h200(h200):
    assert available() == ["cuda", "cpu"]
    info = detect("auto")
    assert (info.kind, info.type, info.index, info.count) == ("cuda", "cuda", 0, 2)
    assert info.name == "NVIDIA H200" and info.memory_bytes == 141 * GiB
    assert (info.compute_units, info.unit_name) == (132, "SM")
    assert info.lanes_per_unit == 128 == device_specs.cuda_cores_per_sm(9, 0)
    assert (info.threads_per_unit, info.warp_size, info.capability) == (2048, 32, "9.0")
    assert info.bf16 and info.tf32 and info.fp16
    assert info.precisions() == ["fp32", "tf32", "bf16", "fp16"]
    assert info.datasheet_tflops["bf16"] == 989.4
    assert info.dist_backend == "nccl"
    assert info.torch_device == torch.device("cuda", 0)
    assert info.label == "cuda:0 (NVIDIA H200)"
    assert info.versions["cuda"] == "12.8" and info.versions["driver (CUDA API)"] == "12.8"
    assert "hip" not in info.versions
    assert detect("cuda") == info


def test_faked_h200_index_and_local_rank(h200):
    one = detect("cuda:1")
    assert one.index == 1 and one.torch_device == torch.device("cuda", 1)
    assert detect("auto", local_rank=1).index == 1
    assert detect("cuda", local_rank=3).index == 1  # more ranks than devices wrap around
    assert detect("cuda:0", local_rank=1).index == 0  # an explicit index wins
    with pytest.raises(UserError, match=r"'cuda:5' does not exist.*2 cuda device\(s\), indices 0\.\.1"):
        detect("cuda:5")
    with pytest.raises(UserError, match="present: cuda, cpu"):
        detect("rocm")  # a CUDA build is not ROCm


def test_faked_cuda_driver_query_may_fail(h200, monkeypatch):
    def no_driver():
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", no_driver, raising=False)
    assert "driver (CUDA API)" not in detect("cuda").versions


def test_faked_pre_ampere_gpu_has_no_tf32_or_bf16(monkeypatch):
    _fake_accelerator(monkeypatch, "cuda", 1)
    props = types.SimpleNamespace(name="Tesla V100-SXM2-16GB", total_memory=16 * GiB, multi_processor_count=80,
                                  major=7, minor=0, max_threads_per_multi_processor=2048, warp_size=32)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    info = detect("cuda")
    assert (info.lanes_per_unit, info.capability) == (64, "7.0")
    assert not info.bf16 and not info.tf32  # emulated bf16 does not count
    assert info.precisions() == ["fp32", "fp16"]
    assert info.datasheet_tflops == {"fp32": 15.7, "fp16": 125.0}


# ---------------------------------------------------------------- AMD (faked)


def test_faked_mi300x_is_rocm(mi300x):
    assert available() == ["rocm", "cpu"]
    info = detect("auto")
    assert (info.kind, info.type, info.count) == ("rocm", "cuda", 8)
    assert (info.compute_units, info.unit_name) == (304, "CU")
    assert info.lanes_per_unit == 64 == device_specs.AMD_SP_PER_CU
    assert (info.warp_size, info.capability) == (64, "gfx942")
    assert info.bf16 and info.tf32
    assert info.datasheet_tflops["bf16"] == 1307.4
    assert info.dist_backend == "nccl"  # RCCL answers to the name nccl
    assert info.torch_device == torch.device("cuda", 0)
    assert info.versions["hip"] == "6.2" and "cuda" not in info.versions
    assert detect("rocm") == info
    assert detect("cuda") == info  # ROCm builds of torch speak "cuda"
    assert detect("rocm:7").index == 7


# ---------------------------------------------------------------- other accelerators (faked)


def _fake_device_module(monkeypatch, device_type: str, module) -> None:
    real = torch.get_device_module

    def get_device_module(device=None):
        return module if str(device) == device_type else real(device)

    monkeypatch.setattr(torch, "get_device_module", get_device_module)


def test_faked_intel_xpu(monkeypatch):
    _fake_accelerator(monkeypatch, "xpu", 1)
    props = types.SimpleNamespace(name="Intel(R) Data Center GPU Max 1550", total_memory=64 * GiB,
                                  gpu_eu_count=512, gpu_subslice_count=64, max_compute_units=512,
                                  sub_group_sizes=[16, 32], has_fp16=True)
    module = types.SimpleNamespace(get_device_properties=lambda i: props, get_device_name=lambda i: props.name,
                                   is_bf16_supported=lambda: True)
    _fake_device_module(monkeypatch, "xpu", module)
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    info = detect("auto")
    assert (info.kind, info.type, info.index, info.count) == ("xpu", "xpu", 0, 1)
    assert info.name == props.name and info.memory_bytes == 64 * GiB
    assert (info.compute_units, info.unit_name) == (64, "Xe core")  # Xe cores, not the 512 EUs in them
    assert info.warp_size == 16
    assert info.bf16 and info.fp16 and not info.tf32
    assert info.dist_backend == "xccl"
    assert info.torch_device == torch.device("xpu", 0)
    assert info.versions["xpu"] == "20250101"
    assert info.datasheet_tflops == {}  # not in the table: nothing invented


def test_faked_npu_like_accelerator_without_properties(monkeypatch):
    # An out-of-tree backend (Gaudi here) whose module reports only a name.
    _fake_accelerator(monkeypatch, "hpu", 2)
    module = types.SimpleNamespace(get_device_name=lambda i: f"GAUDI2 #{i}")
    _fake_device_module(monkeypatch, "hpu", module)
    assert available() == ["hpu", "cpu"]
    info = detect("hpu", local_rank=1)
    assert (info.kind, info.type, info.index, info.name) == ("hpu", "hpu", 1, "GAUDI2 #1")
    assert info.memory_bytes is None and info.compute_units is None and info.warp_size is None
    assert info.bf16  # assumed when the backend cannot say
    assert info.dist_backend == "hccl"
    tree = _text(render([info], measure=False))
    assert "2 × GAUDI2 #1 (hpu) · memory unknown" in tree
    assert "compute units: not reported" in tree
    assert "details not reported by the backend" in tree


def test_faked_apple_mps(monkeypatch):
    _fake_accelerator(monkeypatch, "mps", 1)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 48 * GiB)
    info = detect("auto")
    assert (info.kind, info.type, info.index) == ("mps", "mps", 0)
    assert info.memory_bytes == 48 * GiB and info.warp_size == 32
    assert info.dist_backend == "gloo"
    assert info.torch_device == torch.device("mps", 0)


# ---------------------------------------------------------------- measured peaks


def test_measured_peak_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    info = cpu_info()
    first = measured_peak_flops(info, "fp32")
    assert first > 1e8
    assert (tmp_path / "peak_flops.json").is_file()
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert len(cached) == len(info.precisions()) and first in cached.values()  # all measured together

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again instead of reading the cache")

    monkeypatch.setattr(gpudl.device.peak, "probe_peak_flops", no_probe)
    assert measured_peak_flops(info, "fp32") == first
    with pytest.raises(AssertionError, match="probed again"):
        measured_peak_flops(info, "fp32", use_cache=False)


def test_refreshed_peaks_keep_the_best_figure_seen(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    info = cpu_info()
    probes = iter([2e11, 1e11, 3e11])  # quiet, then a busy moment, then quieter still
    monkeypatch.setattr(gpudl.device.peak, "probe_peak_flops",
                        lambda device, precisions, n: dict.fromkeys(precisions, next(probes)))
    assert measured_peak_flops(info, "fp32") == 2e11
    refresh_peaks(info)
    assert measured_peak_flops(info, "fp32") == 2e11  # the busy measurement does not pull it down
    refresh_peaks(info)
    assert measured_peak_flops(info, "fp32") == 3e11


def test_measured_peak_rejects_a_precision_the_device_lacks(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="does not run tf32"):
        measured_peak_flops(cpu_info(), "tf32")  # no CPU has TF32
    no_bf16 = DeviceInfo(**{**cpu_info().__dict__, "bf16": False})
    with pytest.raises(ValueError, match="does not run bf16"):
        measured_peak_flops(no_bf16, "bf16")
    assert not (tmp_path / "peak_flops.json").exists()


@pytest.mark.parametrize("policy,key", [
    ("fp32", "fp32"), ("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("fp16-mixed", "fp16"),
])
def test_peak_key(policy, key):
    assert peak_key(policy) == key  # fp32 runs in true fp32 (gpudl never turns TF32 on), so its peak is fp32's


# ---------------------------------------------------------------- gpudl info


def _h200_info() -> DeviceInfo:
    return DeviceInfo(kind="cuda", type="cuda", index=0, name="NVIDIA H200", count=8, memory_bytes=141 * GiB,
                      compute_units=132, unit_name="SM", lanes_per_unit=128, threads_per_unit=2048, warp_size=32,
                      capability="9.0", bf16=True, fp16=True, tf32=True, fp8=True,
                      datasheet_tflops=device_specs.datasheet_tflops("NVIDIA H200"),
                      versions={"torch": "2.10.0", "cuda": "12.8"})


def test_info_tree_for_h200():
    text = _text(render([_h200_info()], measure=False))
    assert "8 × NVIDIA H200 (cuda) · 141.0 GiB · arch 9.0" in text
    assert "132 SMs" in text
    assert "128 FP32 cores" in text
    assert "up to 2,048 resident threads (64 warps of 32)" in text
    assert "16,896 FP32 cores" in text and "270,336 threads in flight" in text
    assert "precision: fp32 ✓ tf32 ✓ bf16 ✓ fp16 ✓ fp8 ✓" in text
    assert "bf16: not measured / 989.4" in text and "fp32: not measured / 67.0" in text
    assert "versions: torch 2.10.0, cuda 12.8" in text


def test_info_tree_for_rocm_says_wavefronts():
    info = DeviceInfo(**{**_h200_info().__dict__, "kind": "rocm", "name": "AMD Instinct MI300X", "count": 1,
                         "compute_units": 304, "unit_name": "CU", "lanes_per_unit": 64, "warp_size": 64,
                         "capability": "gfx942"})
    text = _text(render([info], measure=False))
    assert "304 CUs" in text and "(32 wavefronts of 64)" in text and "19,456 FP32 cores" in text
    assert "warps" not in text


def test_info_tree_for_real_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpudl.device.peak, "probe_peak_flops",
                        lambda device, precisions, n: dict.fromkeys(precisions, 1.234e12))
    info = cpu_info()
    text = _text(render([info], measure=True))
    assert f"{info.compute_units} core" in text and f"ISA {info.capability}" in text
    assert f"{info.lanes_per_unit} FP32 SIMD lanes" in text
    assert f"in all: {info.compute_units * info.lanes_per_unit:,} FP32 lanes" in text
    assert "fp32: 1.23 / —" in text  # measured figure; no datasheet for a CPU
    assert "tf32 ✗" in text


def test_as_json_is_serialisable():
    cpu = cpu_info()
    out = as_json([_h200_info(), cpu], measure=False)
    decoded = json.loads(json.dumps(out))
    h200, host = decoded["devices"]
    assert {"kind", "type", "index", "name", "count", "memory_bytes", "compute_units", "unit_name",
            "lanes_per_unit", "threads_per_unit", "warp_size", "capability", "bf16", "fp16", "tf32", "fp8",
            "datasheet_tflops", "versions", "peak_tflops"} == set(h200)
    assert h200["compute_units"] == 132 and h200["lanes_per_unit"] == 128
    assert h200["peak_tflops"]["bf16"] == {"measured": None, "datasheet": 989.4}
    assert set(h200["peak_tflops"]) == {"fp32", "tf32", "bf16", "fp16"}
    assert host["kind"] == "cpu" and set(host["peak_tflops"]) == set(cpu.precisions())
    assert peaks(cpu, measure=False)["fp32"] == {"measured": None, "datasheet": None}


# ---------------------------------------------------------------- nothing at import time


def test_import_detects_nothing():
    # Record every torch query that detection makes, import gpudl and the modules behind
    # `gpudl info`, and check nothing was asked; then detect once to prove the recorder works.
    script = textwrap.dedent("""
        import json, torch
        calls = []
        def spy(owner, name):
            real = getattr(owner, name)
            def wrapper(*a, **k):
                calls.append(name)
                return real(*a, **k)
            setattr(owner, name, wrapper)
        for name in ("is_available", "current_accelerator", "device_count"):
            spy(torch.accelerator, name)
        for name in ("is_available", "device_count", "get_device_properties"):
            spy(torch.cuda, name)
        spy(torch.backends.cpu, "get_cpu_capability")
        import gpudl, gpudl.device, gpudl.device.info, gpudl.device.peak, gpudl.cli
        at_import = list(calls)
        gpudl.detect("cpu")  # the CPU on any machine: "auto" would describe an accelerator where there is one
        print(json.dumps({"at_import": at_import, "after_detect": calls}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["at_import"] == []
    assert "is_available" in result["after_detect"] and "get_cpu_capability" in result["after_detect"]
