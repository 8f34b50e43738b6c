"""Where metrics go: JSONL and CSV files in the run folder, TensorBoard, and the console."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

CSV_COLUMNS = ["step", "loss", "lr", "grad_norm", "step_s", "samples_per_s", "units_per_s", "mfu",
               "mfu_datasheet", "peak_mem_gb", "data_wait_frac", "nonfinite_total"]


def read_records(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl; a line that is not a JSON record (the half-written last line
    of a run that was killed, or an edit) is left out rather than failing a resume or a report."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


class FileSink:
    """metrics.jsonl (every record) and metrics.csv (training records), appended as they come.

    On resume, records after the resumed step are dropped first: they belong to the part of
    the interrupted run that is about to be redone.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.jsonl_path, self.csv_path = run_dir / "metrics.jsonl", run_dir / "metrics.csv"
        if resume_step is not None:
            self._truncate(resume_step)
        else:
            self.jsonl_path.unlink(missing_ok=True)
            self.csv_path.unlink(missing_ok=True)
        new_csv = not self.csv_path.exists()
        self._jsonl = open(self.jsonl_path, "a", encoding="utf8")
        self._csv_file = open(self.csv_path, "a", encoding="utf8", newline="")
        self._csv = csv.DictWriter(self._csv_file, CSV_COLUMNS, extrasaction="ignore")
        if new_csv:
            self._csv.writeheader()

    def _truncate(self, step: int) -> None:
        kept = [r for r in read_records(self.jsonl_path.parent) if r.get("step", 0) <= step]
        self.jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        with open(self.csv_path, "w", encoding="utf8", newline="") as f:
            w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(r for r in kept if r.get("kind") == "train")

    def write(self, record: dict) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if record.get("kind") == "train":
            self._csv.writerow(record)
            self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


class TensorBoardSink:
    """Scalars for TensorBoard under run_dir/tb (needs the tensorboard package)."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict) -> None:
        kind = record.get("kind", "train")
        for key, value in record.items():
            if key not in ("step", "kind") and isinstance(value, (int, float)):
                self._writer.add_scalar(f"{kind}/{key}", value, record["step"])

    def close(self) -> None:
        self._writer.close()


def tensorboard_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None


class ConsoleProgress:
    """A rich progress bar with loss, throughput, MFU and ETA; lines printed above it."""

    def __init__(self, console: Console, total: int, start: int, unit: str, enabled: bool = True,
                 quiet: bool = False):
        self.console, self.unit, self.enabled, self.quiet = console, unit, enabled, quiet
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(), console=console, disable=not enabled, transient=False)
        self._task = self._progress.add_task("train", total=total, completed=start, stats="")

    def __enter__(self) -> ConsoleProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def update(self, record: dict) -> None:
        stats = f"loss {record['loss']:.4f} · {si(record['units_per_s'])} {self.unit}/s"
        if record.get("mfu") is not None or record.get("mfu_datasheet") is not None:  # unknown: left out, not 0%
            stats += f" · MFU {mfu_text(record.get('mfu'), record.get('mfu_datasheet'))}"
        self._progress.update(self._task, completed=record["step"], stats=stats)
        if not self.enabled and not self.quiet:  # no live bar (a log file, a CI job): one line per log record instead
            self.console.print(f"step {record['step']:>6} · {stats}", highlight=False)

    def print(self, text: str) -> None:
        self._progress.console.print(text, markup=False, highlight=False)

    def set_total(self, total: int) -> None:
        self._progress.update(self._task, total=total)


def si(x: float | None, unit: str = "") -> str:
    """`x` with an SI prefix: si(25_000) == "25.00k", si(3.1e12, "FLOP/s") == "3.10 TFLOP/s"; None is "—"."""
    if x is None:
        return "—"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}" if unit else f"{x / scale:.2f}{prefix}"
    return f"{x:.1f} {unit}" if unit else f"{x:.1f}"


def mfu_text(mfu: float | None, datasheet: float | None) -> str:
    """MFU as the field quotes it, against the datasheet peak, with the measured peak's beside it:
    "41.7% (52.5% of measured peak)"; "34.0% of measured peak" with no datasheet figure (every CPU);
    "—" when neither is known (FLOPs that could not be counted)."""
    measured = None if mfu is None else f"{100 * mfu:.1f}% of measured peak"
    if datasheet is None:
        return measured or "—"
    return f"{100 * datasheet:.1f}%" + (f" ({measured})" if measured else "")


def summary_table(summary: dict) -> Table:
    """The end-of-run table: one row per figure; both MFUs in one row, the datasheet's first."""
    table = Table(title="Run summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in summary.items():
        if key == "mfu":
            table.add_row(key, mfu_text(value, summary.get("mfu_datasheet")))
        elif key != "mfu_datasheet":
            table.add_row(key, _fmt(value))
    return table


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)
