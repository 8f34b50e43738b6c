"""`gpudl report RUN_DIR`: a training run's loss, throughput and memory over its steps, as PNGs and
a Markdown page, from the metrics the run left in its folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from .sinks import read_records
from . import plots


def _unit(summary: dict) -> str:
    return next((k[:-len("_per_s")] for k in summary if k.endswith("_per_s") and k != "samples_per_s"), "samples")


def _summary_rows(summary: dict) -> list[str]:
    keys = ("model", "device", "precision", "steps", "final_loss", "val_loss", "samples_per_s", "mfu_datasheet", "mfu",
            "step_s", "data_wait_frac", "peak_mem_gb", "wall_s")
    rows = ["| figure | value |", "|---|---|"]
    for k in keys:
        if k in summary:
            v = summary[k]
            rows.append(f"| {k} | {'—' if v is None else f'{v:.4g}' if isinstance(v, float) else v} |")
    return rows


def _summary(path: Path) -> dict:
    """summary.json as a table of figures, or {} when there is none that reads as one."""
    try:
        summary = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def report_run(run_dir: Path) -> tuple[list[Path], list[str]]:
    """Write the plots and RUN_DIR/report.md; returns (files written, notes for the user)."""
    records = read_records(run_dir)
    if not any(r.get("kind") == "train" for r in records):
        raise UserError(f"{run_dir} has no training metrics (metrics.jsonl): train first, then report")
    summary = _summary(run_dir / "summary.json")
    unit = _unit(summary)
    notes, written = [], []
    if plots.available():
        written = plots.run_plots(records, run_dir, unit)
    else:
        notes.append(plots.MISSING)
    title = f"# {summary.get('model', run_dir.name)} · {run_dir.name}"
    lines = [title, "", *(_summary_rows(summary) if summary else ["(no summary.json: the run did not finish)"]), ""]
    lines += [f"![{p.stem}]({p.name})" for p in written]
    md = run_dir / "report.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf8")
    return [*written, md], notes
