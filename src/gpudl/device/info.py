"""`gpudl info`: the devices found, drawn as a GPU primer draws them: GPU -> SMs -> cores -> threads."""

from __future__ import annotations

import dataclasses

from rich.console import Group
from rich.tree import Tree

from .discovery import DeviceInfo
from .peak import measured_peak_flops


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "memory unknown"


def peaks(info: DeviceInfo, measure: bool = True) -> dict[str, dict[str, float | None]]:
    """{precision: {"measured": TFLOP/s, "datasheet": TFLOP/s}} for every precision the device runs."""
    return {p: {"measured": measured_peak_flops(info, p) / 1e12 if measure else None,
                "datasheet": info.datasheet_tflops.get(p)} for p in info.precisions()}


def _unit_line(info: DeviceInfo) -> str:
    parts = []
    if info.lanes_per_unit:
        parts.append(f"{info.lanes_per_unit} FP32 {'SIMD lanes' if info.type == 'cpu' else 'cores'}")
    if info.threads_per_unit:
        if info.type == "cpu":
            parts.append(f"{info.threads_per_unit} hardware thread{'s' if info.threads_per_unit > 1 else ''}")
        elif info.warp_size:
            parts.append(f"up to {info.threads_per_unit:,} resident threads "
                         f"({info.threads_per_unit // info.warp_size} {'wavefronts' if info.kind == 'rocm' else 'warps'}"
                         f" of {info.warp_size})")
        else:
            parts.append(f"up to {info.threads_per_unit:,} resident threads")
    elif info.warp_size:
        parts.append(f"{'wavefront' if info.kind == 'rocm' else 'warp'} size {info.warp_size}")
    return f"each {info.unit_name}: " + (" · ".join(parts) if parts else "details not reported by the backend")


def device_tree(info: DeviceInfo, peak: dict) -> Tree:
    count = f"{info.count} × " if info.count > 1 else ""
    cap = f" · {'ISA' if info.type == 'cpu' else 'arch'} {info.capability}" if info.capability else ""
    root = Tree(f"[bold]{count}{info.name}[/] ({info.kind}) · {_gib(info.memory_bytes)}{cap}")
    units = root.add(f"{info.compute_units} {info.unit_name}s" if info.compute_units else f"{info.unit_name}s: not reported")
    leaf = units.add(_unit_line(info))
    if info.compute_units and info.lanes_per_unit:
        total = info.compute_units * info.lanes_per_unit
        threads = info.compute_units * (info.threads_per_unit or 1)
        leaf.add(f"in all: {total:,} FP32 {'lanes' if info.type == 'cpu' else 'cores'} · {threads:,} "
                 f"{'hardware threads' if info.type == 'cpu' else 'threads in flight'}")
    support = " ".join(f"{p} {'✓' if p in peak else '✗'}" for p in ("fp32", "tf32", "bf16", "fp16"))
    support += f" fp8 {'✓' if info.fp8 else '✗'}"  # training only (precision=fp8); no peak is probed for it
    root.add(f"precision: {support}")
    table = root.add("peak TFLOP/s (measured / datasheet)")
    for p, v in peak.items():
        measured = f"{v['measured']:.2f}" if v["measured"] is not None else "not measured"
        sheet = f"{v['datasheet']:.1f}" if v["datasheet"] else "—"
        table.add(f"{p}: {measured} / {sheet}")
    root.add("versions: " + ", ".join(f"{k} {v}" for k, v in info.versions.items()))
    return root


def render(infos: list[DeviceInfo], measure: bool = True) -> Group:
    return Group(*(device_tree(i, peaks(i, measure)) for i in infos))


def as_json(infos: list[DeviceInfo], measure: bool = True) -> dict:
    out = []
    for info in infos:
        d = dataclasses.asdict(info)
        d["peak_tflops"] = peaks(info, measure)
        out.append(d)
    return {"devices": out}
