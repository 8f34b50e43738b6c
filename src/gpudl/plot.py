"""The loss curve of a run: a PNG through matplotlib (`gpudl[plot]`), else a plain SVG.

The SVG fallback keeps the core install free of plotting libraries while every run still
leaves a picture of its loss.
"""

from __future__ import annotations

from pathlib import Path


def _series(records: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in records if r.get("kind") == kind and r.get(key) is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def plot_loss(records: list[dict], out_base: Path, title: str) -> Path | None:
    """Write out_base.png (or .svg without matplotlib); None when there is nothing to draw."""
    train = _series(records, "train", "loss")
    val = _series(records, "eval", "loss")
    if not train[0]:
        return None
    try:
        import matplotlib
    except ImportError:
        return _svg(train, val, out_base.with_suffix(".svg"), title)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*train, label="train", linewidth=1.2)
    if val[0]:
        ax.plot(*val, "o-", label="validation", linewidth=1.2)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_base.with_suffix(".png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _svg(train, val, path: Path, title: str) -> Path:
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
