"""`gpudl bench`: how fast a model trains on each device of this machine, at each precision, with and
without torch.compile, measured here; written to one folder as JSON, Markdown and PNG plots.

    suite.py     the grid, every input checked before anything runs
    cells.py     one timed cell; a failure is its result, not the end of the benchmark
    roofline.py  measured memory bandwidth; bytes moved and arithmetic intensity
    dataload.py  whether the data loader keeps up, and what to change when it does not
    runner.py    runs the grid with live progress; the benchmark document
    report.py    bench.json, report.md, terminal tables; plots.py the PNGs

>>> import tempfile
>>> from rich.console import Console
>>> tiny = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.block_size=16", "train.batch_size=2"]
>>> doc = run_bench(models=["gpt-tiny"], sets=tiny, devices=["cpu"], precisions=["fp32"], compile=(False,),
...                 timing=Timing(steps=2, warmup=1), out=tempfile.mkdtemp(), console=Console(quiet=True))
>>> [(c["precision"], c["status"]) for c in doc["cells"]]
[('fp32', 'ok'), ('fp32', 'ok')]
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rich.console import Console

from ..errors import UserError
from .cells import Timing
from .report import tables, write_report
from .runner import SCHEMA, run_plan
from .suite import DEFAULT_MODELS, Plan, make_plan


def out_folder(out: str | Path | None) -> Path:
    """The folder a benchmark writes to (default bench/<date>-<time>); never one that holds a benchmark."""
    path = Path(out) if out is not None else Path("bench") / f"{datetime.now():%Y%m%d-%H%M%S}"
    if (path / "bench.json").exists():
        raise UserError(f"{path} already holds a benchmark: choose another --out")
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {str(path)!r} is a file: pass a folder")
    return path


def run_bench(*, models: list[str] = (), config: str | None = None, sets: list[str] = (), devices: list[str] = (),
              precisions: list[str] = (), compile: tuple[bool, ...] = (False, True), timing: Timing = Timing(),
              batch_size: int | None = None, out: str | Path | None = None,
              console: Console | None = None, command: str | None = None) -> dict:
    """Benchmark `models` (default: gpt-tiny and resnet18) on `devices` (default: all present) at
    `precisions` (default: fp32 and the mixed precisions each device runs); returns the document
    written to `out`/bench.json next to report.md and the plots. Compiled cells reset
    torch.compile's state (`torch.compiler.reset()`) so that each compiles afresh.
    """
    console = console or Console()
    plan = make_plan(model_names=list(models), config=config, sets=list(sets), devices=list(devices),
                     precisions=list(precisions), compile=tuple(compile), timing=timing, batch_size=batch_size)
    folder = out_folder(out)
    doc = run_plan(plan, console, command)
    for note in write_report(doc, folder):
        console.print(note, markup=False, highlight=False)
    _print_wide(console, tables(doc))
    console.print(f"Report: {folder / 'report.md'} · data: {folder / 'bench.json'}"
                  + (f" · plots: {', '.join(doc['plots'])}" if doc["plots"] else ""), soft_wrap=True)
    return doc


def _print_wide(console: Console, renderables: list) -> None:
    """Print; into a log or a pipe at 120 columns at least, where rich would squeeze tables into 80."""
    width = console.width
    if not console.is_terminal:
        console.width = max(width, 120)
    try:
        for r in renderables:
            console.print(r)
    finally:
        console.width = width


__all__ = ["run_bench", "make_plan", "run_plan", "write_report", "Plan", "Timing", "SCHEMA", "DEFAULT_MODELS"]
