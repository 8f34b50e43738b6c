"""A benchmark's results as one folder: bench.json (every figure), report.md, and PNG plots.

Also the terminal tables: one per model, a row per device x precision x compile cell.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table

from ..observe import plots
from ..observe.sinks import si

# MFU against the datasheet peak first, as the field quotes it; the measured peak's beside it
COLUMNS = ("device", "precision", "compile", "samples/s", "step ms p50/p90", "CV", "MFU (datasheet)",
           "MFU (measured)", "peak mem", "× CPU", "status")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _bytes(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def short_device(label: str) -> str:
    """'cuda:0 (NVIDIA H200)' -> 'cuda:0': the model's table names the hardware once."""
    return label.split(" (")[0]


def cell_row(c: dict) -> list[str]:
    """One cell as table text, in the order of COLUMNS."""
    status = "ok" if c["status"] == "ok" else f"failed: {c['reason']}"
    compiled = "off" if not c["compile"] else "on" if c["compile_s"] is None else f"on ({c['compile_s']:.0f} s)"
    steps = "—" if c["step_s_p50"] is None else f"{1e3 * c['step_s_p50']:.1f}/{1e3 * c['step_s_p90']:.1f}"
    return [short_device(c["device"]), c["precision"], compiled, si(c["samples_per_s"]), steps, _pct(c["cv"]),
            _pct(c.get("mfu_datasheet")), _pct(c["mfu"]), _bytes(c["peak_mem_bytes"]),
            "—" if c["speedup_vs_cpu"] is None else f"{c['speedup_vs_cpu']:.2f}×", status]


def _grid(doc: dict, model: str) -> list[dict]:
    return [c for c in doc["cells"] if c["model"] == model and c["data"] == "synthetic"]


def tables(doc: dict) -> list:
    """The terminal view: a table per model, then the data-loading findings as lines."""
    out = []
    devices = ", ".join(d["label"] for d in doc["devices"])
    for m in doc["models"]:
        t = Table(title=f"{m['name']} · batch {m['batch_size']} · {devices}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
        for col in COLUMNS:
            t.add_column(col, justify="left" if col in ("device", "precision", "compile", "status") else "right")
        for c in _grid(doc, m["name"]):
            t.add_row(*map(escape, cell_row(c)), style=None if c["status"] == "ok" else "red")
        out.append(t)
    out.append("[bold]Data loading[/] (the recipe's real data through the training loader):")
    for f in doc["loader"]:
        out.append(escape(f"  {loader_line(f)}"))
        out += [escape(f"    - {tip}") for tip in f["advice"]]
    return out


def loader_line(f: dict) -> str:
    where = f"{f['model']} on {short_device(f['device'])} ({f['precision']})"
    if f["status"] != "ok":
        return f"{where}: failed: {f['reason']}"
    slow = "" if f["slowdown"] is None else f"; step {f['slowdown']:.2f}× the step on synthetic data"
    verdict = "the loader is the bottleneck; change:" if f["bottleneck"] else "the loader keeps up"
    return f"{where}: waits for data {_pct(f['wait_frac'])} of each step{slow}: {verdict}"


def loader_row(f: dict) -> list[str]:
    if f["status"] != "ok":
        return [f["model"], short_device(f["device"]), "—", "—", f"failed: {f['reason']}"]
    slow = "—" if f["slowdown"] is None else f"{f['slowdown']:.2f}×"
    tips = "; ".join(f["advice"]) if f["advice"] else "nothing: the loader keeps up"
    return [f["model"], short_device(f["device"]), f"{_pct(f['wait_frac'])} of each step", slow, tips]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |"
    return [line(header), "|" + "|".join("---" for _ in header) + "|", *(line(r) for r in rows), ""]


def markdown(doc: dict) -> str:
    """report.md: the same tables, the devices' roofs, the plots, and how the figures were taken."""
    mach = doc["machine"]
    lines = [f"# gpudl bench · {doc['created']}", "",
             f"Machine: {mach['cpu']} ({mach['cpu_cores']} cores, {mach['cpu_isa']}) · {mach['platform']} · "
             + ", ".join(f"{k} {v}" for k, v in mach["versions"].items()),
             f"Command: `{doc['command'] or 'gpudl.bench.run_bench'}` · per cell {doc['settings']['warmup']} "
             f"warm-up steps, then up to {doc['settings']['steps']} timed steps or "
             f"{doc['settings']['max_seconds']:g} s "
             f"(at least {doc['settings']['min_steps']}) · {doc['duration_s']:.0f} s in all", ""]
    for m in doc["models"]:
        lines += [f"## {m['name']}", "", f"{m['description']}; {m['params'] / 1e6:.2f}M parameters; batch "
                  f"{m['batch_size']}; {si(m['flops_per_sample'], 'FLOP')} per sample (forward + backward)", ""]
        lines += _md_table(list(COLUMNS), [cell_row(c) for c in _grid(doc, m["name"])])
    lines += ["## Data loading", "", "Real data through the loader `gpudl train` uses, against synthetic batches "
              "already on the device (same device and precision, eager).", ""]
    lines += _md_table(["model", "device", "waits for data", "step vs synthetic", "what to change"],
                       [loader_row(f) for f in doc["loader"]])
    lines += _roofline_md(doc)
    lines += [f"![{p}]({p})" for p in doc["plots"]] + [""] + _method_md(doc)
    return "\n".join(lines) + "\n"


def _roofline_md(doc: dict) -> list[str]:
    rows = [[d["label"], ", ".join(f"{k} {si(v, 'FLOP/s')}" for k, v in d["peak_flops"].items()),
             si(d["bandwidth_bytes_per_s"], "B/s"),
             ", ".join(f"{k} {v / d['bandwidth_bytes_per_s']:.0f}" for k, v in d["peak_flops"].items())]
            for d in doc["devices"]]
    out = ["## Roofline", "", *_md_table(["device", "measured peak", "memory bandwidth", "ridge (FLOP/byte)"], rows)]
    rows = [[m["name"], *(f"{d}: {m['flops_per_sample'] * m['batch_size'] / b:.1f}" if m["flops_per_sample"] else "—"
                          for d, b in m["bytes_per_step"].items())] for m in doc["models"]]
    out += ["Arithmetic intensity (FLOP per byte moved, one training step):", ""]
    out += [f"- {r[0]}: " + ", ".join(r[1:]) for r in rows] + [""]
    out += ["Bytes moved are the sum of every operator's inputs and outputs, counted on the meta device: an upper "
            "bound on memory traffic (caches and fused kernels move less), so a model's true point lies at or right "
            "of the one drawn. Mixed precision is counted with every floating-point tensor in the low-precision "
            "dtype, which makes its intensity an estimate. The optimizer step is not counted.", ""]
    return out


def _method_md(doc: dict) -> list[str]:
    return ["## How these figures were taken", "",
            "- Each step is the training loop's own step (forward, backward, clipping, finiteness check, optimizer, "
            "schedule), synchronised with the device before and after, on synthetic batches already on the device.",
            "- samples/s and MFU come from the median step; p90 and the coefficient of variation (CV) of the step "
            "times say how steady they were. MFU is model FLOPs per second over a peak for the precision in use: "
            "MFU (datasheet) over the vendor's datasheet figure, as the field quotes it (— where there is none, "
            "as on every CPU), and MFU (measured) over the peak measured on this device.",
            "- Warm-up steps are not timed as steps; for a compiled model their extra time is the compile time, shown "
            "as `on (N s)` (shorter on a second run, when the compiler's caches are warm).",
            "- × CPU: samples/s over the fastest CPU cell of the same model.",
            "- Peak memory: the device's peak allocation; on the CPU, the process's peak resident set (it includes "
            "the Python process itself).", ""]


def write_report(doc: dict, out_dir: Path) -> list[str]:
    """Write plots, report.md and bench.json into `out_dir`; returns notes for the user (e.g. no plots)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    if plots.available():
        doc["plots"] = [p.name for p in plots.bench_plots(doc, out_dir)]
    else:
        notes.append(plots.MISSING)
    (out_dir / "report.md").write_text(markdown(doc), encoding="utf8")
    (out_dir / "bench.json").write_text(json.dumps(doc, indent=1, default=str), encoding="utf8")
    return notes
