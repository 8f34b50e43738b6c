"""Every plot gpudl draws, with matplotlib (the optional `gpudl[plot]` extra): a training run's
loss, throughput and memory over its steps; a benchmark's throughput by device and precision,
its roofline and its scaling.

The one plot that does not need matplotlib is a run's loss curve: `gpudl train` after a bare
`pip install .` (torch, numpy and rich only) still leaves a picture of its loss, as a plain SVG.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

MISSING = "plots need matplotlib: pip install 'gpudl[plot]'"


def available() -> bool:
    return find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def bench_plots(doc: dict, out_dir: Path) -> list[Path]:
    """throughput.png and, where anything succeeded, roofline.png."""
    out = [plot_throughput(doc, out_dir / "throughput.png")]
    if any(c["status"] == "ok" and c["intensity"] for c in doc["cells"]):
        out.append(plot_roofline(doc, out_dir / "roofline.png"))
    return out


def plot_throughput(doc: dict, path: Path) -> Path:
    """One panel per model: samples/s per device and precision, eager and compiled side by side."""
    plt = _pyplot()
    names = [m["name"] for m in doc["models"]]
    modes = doc["settings"]["compile"]
    width = 0.8 / len(modes)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), dpi=110, squeeze=False)
    for ax, name in zip(axes[0], names):
        cells = [c for c in doc["cells"] if c["model"] == name and c["data"] == "synthetic"]
        labels = list(dict.fromkeys(_where(c) for c in cells))
        for i, compiled in enumerate(modes):
            found = [next((c for c in cells if _where(c) == lab and c["compile"] == compiled), None) for lab in labels]
            ys = [c["samples_per_s"] or 0.0 if c else 0.0 for c in found]
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(labels))]
            bars = ax.bar(xs, ys, width=width, label="compiled" if compiled else "eager",
                          hatch="//" if compiled else None)
            ax.bar_label(bars, labels=[f"{y:,.0f}" if y else "failed" if c else "" for y, c in zip(ys, found)],
                         fontsize=7)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set(title=name, ylabel="samples/s (median step)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_scaling(doc: dict, path: Path) -> Path:
    """Samples/s against processes, beside ideal linear scaling; efficiency on the right axis."""
    plt = _pyplot()
    n = [p["processes"] for p in doc["points"]]
    rate = [p["samples_per_s"] for p in doc["points"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    ax.plot(n, rate, "o-", label="measured")
    ax.plot(n, [rate[0] * k for k in n], "--", color="grey", label="ideal (linear)")
    ax.set(xlabel="processes", ylabel="samples/s", title=f"{doc['model']} on {doc['device']}", xticks=n)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    eff = ax.twinx()
    eff.plot(n, [100 * p["efficiency"] for p in doc["points"]], "s:", color="tab:orange")
    eff.set(ylabel="efficiency %", ylim=(0, 110))
    return _save(fig, path)


def _where(cell: dict) -> str:
    return f"{cell['device'].split(' (')[0]}\n{cell['precision']}"


def plot_roofline(doc: dict, path: Path) -> Path:
    """Per device: compute roofs (one per measured precision) and the bandwidth slope; each cell a point."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=110)
    ok = [c for c in doc["cells"] if c["status"] == "ok" and c["intensity"] and c["data"] == "synthetic"]
    xs = [c["intensity"] for c in ok]
    lo, hi = min(xs + [1.0]) / 4, max(xs + [1e3]) * 4
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, d in enumerate(doc["devices"]):
        colour = colours[i % len(colours)]
        bw = d["bandwidth_bytes_per_s"]
        for key, peak in d["peak_flops"].items():
            ridge = peak / bw
            ax.plot([lo, ridge, hi], [bw * lo, peak, peak], color=colour, linewidth=1.2,
                    linestyle="-" if key in ("bf16", "fp16") else "--")
            ax.annotate(f"{d['kind']} {key} {peak / 1e12:.2f} TFLOP/s", (hi, peak), fontsize=7, ha="right",
                        va="bottom", color=colour)
        for c in (c for c in ok if c["device"] == d["label"]):
            ax.scatter(c["intensity"], c["achieved_flops"], color=colour, marker="o" if c["compile"] else "s", s=22)
            ax.annotate(f"{c['model']} {c['precision']}{' c' if c['compile'] else ''}",
                        (c["intensity"], c["achieved_flops"]), fontsize=6, xytext=(3, -8), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte, upper-bound bytes)",
           ylabel="FLOP/s", title="Roofline: measured peaks and bandwidth; circles compiled, squares eager")
    ax.grid(which="both", alpha=0.2)
    return _save(fig, path)


def _series(records: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in records if r.get("kind") == kind and r.get(key) is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def _line(path: Path, series: list[tuple], ylabel: str, title: str, twin: tuple | None = None) -> Path:
    """Lines over the training step: `series` as (steps, values, label, style); `twin` on a right axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for xs, ys, label, style in series:
        ax.plot(xs, ys, style, label=label, linewidth=1.2)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    if twin is not None and twin[0]:
        right = ax.twinx()
        right.plot(twin[0], twin[1], ":", color="tab:gray", linewidth=1)
        right.set_ylabel(twin[2])
    return _save(fig, path)


def _loss_series(records: list[dict]) -> list[tuple]:
    val = _series(records, "eval", "loss")
    return [(*_series(records, "train", "loss"), "train", "-")] + ([(*val, "validation", "o-")] if val[0] else [])


def plot_loss(records: list[dict], out_base: Path, title: str) -> Path | None:
    """out_base.png (out_base.svg without matplotlib): a run's training and validation loss; None if no records."""
    series = _loss_series(records)
    if not series[0][0]:
        return None
    if not available():
        return _svg([s[:2] for s in series], out_base.with_suffix(".svg"), title)
    return _line(out_base.with_suffix(".png"), series, "loss", title)


def run_plots(records: list[dict], out_dir: Path, unit: str) -> list[Path]:
    """loss.png, throughput.png and memory.png from a training run's metric records."""
    mfu = _series(records, "train", "mfu")  # windows without a FLOP count (mfu None) are left out
    return [
        _line(out_dir / "loss.png", _loss_series(records), "loss", "loss"),
        _line(out_dir / "throughput.png", [(*_series(records, "train", "units_per_s"), unit, "-")], f"{unit}/s",
              "throughput (dotted: MFU)", twin=(mfu[0], [100 * v for v in mfu[1]], "MFU % of measured peak")),
        _line(out_dir / "memory.png", [(*_series(records, "train", "peak_mem_gb"), "peak", "-")], "GiB",
              "peak memory"),
    ]


def _svg(series: list[tuple], path: Path, title: str) -> Path:
    """The loss curve as a plain SVG: (steps, losses) of training, then of validation if any."""
    train, val = series[0], series[1] if len(series) > 1 else ([], [])
    w, h, pad = 640, 360, 50
    xs, ys = train[0] + val[0], train[1] + val[1]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (w - 2 * pad) / max(x1 - x0, 1)
    sy = (h - 2 * pad) / max(y1 - y0, 1e-9)

    def line(series, colour):
        pts = " ".join(f"{pad + (x - x0) * sx:.1f},{h - pad - (y - y0) * sy:.1f}" for x, y in zip(*series))
        return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{pts}"/>'

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle">{title}</text>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
        f'<text x="{pad}" y="{h - pad + 16}">{x0}</text>',
        f'<text x="{w - pad}" y="{h - pad + 16}" text-anchor="end">step {x1}</text>',
        f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">{y0:.2f}</text>',
        f'<text x="{pad - 4}" y="{pad + 4}" text-anchor="end">{y1:.2f}</text>',
        line(train, "#1f77b4"),
    ]
    if val[0]:
        parts.append(line(val, "#ff7f0e"))
    parts.append(f'<text x="{w - pad}" y="{pad}" text-anchor="end" fill="#1f77b4">train</text>')
    if val[0]:
        parts.append(f'<text x="{w - pad}" y="{pad + 16}" text-anchor="end" fill="#ff7f0e">validation</text>')
    path.write_text("\n".join(parts + ["</svg>"]) + "\n")
    return path
