"""MFU against the datasheet peak first and the measured peak beside it; an unknown MFU is None, never 0%.

The expected figures are computed here by hand from the clock and the peaks, not by the code under test.
"""

import csv
import dataclasses
import io
import json

import pytest
import torch
from rich.console import Console

import gpudl
import gpudl.distributed.session as session_module
from gpudl.bench import Timing, run_plan, write_report
from gpudl.bench.suite import make_plan
from gpudl.device import cpu_info
from gpudl.device.peak import datasheet_peak_flops, measured_peak_flops
from gpudl.observe import metrics
from gpudl.observe.metrics import Throughput
from gpudl.observe.report import report_run
from gpudl.observe.sinks import ConsoleProgress, mfu_text, summary_table
from test_fit_ecosystem import Scale  # no matrix product anywhere: the FLOP counter counts nothing, so MFU is unknown


def _window(monkeypatch, throughput: Throughput, ticks: int, now: float, exclude_s: float = 0.0) -> dict:
    """`throughput.window` with the clock stopped at `now` after `ticks` steps."""
    for _ in range(ticks):
        throughput.tick()
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now)
    return throughput.window(exclude_s)


def test_window_gives_mfu_over_each_peak(monkeypatch):
    # 3 steps of 3 GFLOP on 2 devices in 2.5 s, 0.5 s of it excluded: 9e9 / 2.0 / 2 = 2.25 GFLOP/s a device
    t = Throughput(8, 4, 3e9, peak_flops=4.5e9, world=2, datasheet_flops=9e9, _t0=100.0)
    rates = _window(monkeypatch, t, ticks=3, now=102.5, exclude_s=0.5)
    assert rates["step_s"] == pytest.approx(2.0 / 3)
    assert rates["samples_per_s"] == pytest.approx(3 * 8 / 2.0)
    assert rates["mfu"] == pytest.approx(2.25e9 / 4.5e9) == 0.5
    assert rates["mfu_datasheet"] == pytest.approx(2.25e9 / 9e9) == 0.25


def test_window_leaves_an_unknown_mfu_none(monkeypatch):
    no_sheet = Throughput(8, 4, 3e9, peak_flops=4.5e9, _t0=0.0)  # a CPU: no datasheet figure
    rates = _window(monkeypatch, no_sheet, ticks=1, now=1.0)
    assert rates["mfu"] == pytest.approx(3e9 / 4.5e9) and rates["mfu_datasheet"] is None
    no_flops = Throughput(8, 4, 0, peak_flops=4.5e9, datasheet_flops=9e9, _t0=0.0)  # the counter failed
    rates = _window(monkeypatch, no_flops, ticks=1, now=1.0)
    assert rates["mfu"] is None and rates["mfu_datasheet"] is None


def test_datasheet_peak_is_the_tables_figure_for_that_key_only():
    cpu = cpu_info()
    assert datasheet_peak_flops(cpu, "fp32") is None  # no CPU has a datasheet figure
    sheet = dataclasses.replace(cpu, datasheet_tflops={"fp32": 19.5, "bf16": 312.0})
    assert datasheet_peak_flops(sheet, "fp32") == 19.5e12 and datasheet_peak_flops(sheet, "bf16") == 312e12
    assert datasheet_peak_flops(sheet, "fp16") is None  # not guessed from bf16's


def test_text_puts_the_datasheet_first_and_says_which_peak():
    assert mfu_text(0.525, 0.417) == "41.7% (52.5% of measured peak)"
    assert mfu_text(0.34, None) == "34.0% of measured peak"
    assert mfu_text(None, None) == "—"
    out = io.StringIO()
    progress = ConsoleProgress(Console(file=out, width=200), 10, 0, "tokens", enabled=False)
    record = {"step": 2, "loss": 1.0, "units_per_s": 1e3}
    progress.update({**record, "mfu": 0.34, "mfu_datasheet": None})
    progress.update({**record, "mfu": None, "mfu_datasheet": None})
    first, second = out.getvalue().splitlines()
    assert first.endswith("· MFU 34.0% of measured peak") and "MFU" not in second


def _console_text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(renderable)
    return out.getvalue()


def test_summary_table_shows_both_in_one_row_and_none_as_missing():
    both = _console_text(summary_table({"steps": 6, "mfu": 0.525, "mfu_datasheet": 0.417}))
    assert "41.7% (52.5% of measured peak)" in both and "mfu_datasheet" not in both
    missing = _console_text(summary_table({"steps": 6, "mfu": None}))
    assert "0.0" not in missing and "None" not in missing and "—" in missing


def test_a_run_on_a_device_with_a_datasheet_quotes_it_first(tiny, monkeypatch):
    real_detect = session_module.detect

    def with_sheet(*args, **kwargs):  # this CPU, as if its datasheet said 1 GFLOP/s in fp32 (a figure the
        # tiny model's FLOP/s is a readable share of, not 0.0%)
        return dataclasses.replace(real_detect(*args, **kwargs), datasheet_tflops={"fp32": 1e-3})

    monkeypatch.setattr(session_module, "detect", with_sheet)
    out = io.StringIO()
    result = gpudl.train(tiny("run.name=sheet"), console=Console(file=out, width=250))
    measured = measured_peak_flops(cpu_info(), "fp32")  # the cached figure the run used
    train = [r for r in result.records if r["kind"] == "train"]
    text = out.getvalue()
    for r in train:  # the same achieved FLOP/s over each peak
        assert r["mfu_datasheet"] == pytest.approx(r["mfu"] * measured / 1e9, rel=1e-9)
        assert f"step {r['step']:>6} · " in text
        assert f"MFU {100 * r['mfu_datasheet']:.1f}% ({100 * r['mfu']:.1f}% of measured peak)" in text
    s = result.summary
    steady = train[1:]
    assert s["mfu_datasheet"] == pytest.approx(sum(r["mfu_datasheet"] for r in steady) / len(steady))
    assert f"{100 * s['mfu_datasheet']:.1f}% ({100 * s['mfu']:.1f}% of measured peak)" in text
    run = result.run_dir
    assert json.loads((run / "summary.json").read_text())["mfu_datasheet"] == pytest.approx(s["mfu_datasheet"])
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [float(row["mfu_datasheet"]) for row in rows] == pytest.approx([r["mfu_datasheet"] for r in train])


def test_an_unknown_mfu_is_shown_missing_everywhere(tmp_path, capsys):
    x = torch.randn(64, 4)
    result = gpudl.fit(Scale(), (x, 2 * x), max_steps=4, batch_size=16, run_dir=tmp_path / "run", log_every=1,
                       lr=3e-3, precision="fp32", device="cpu", progress=False)
    printed = capsys.readouterr().out
    assert "MFU 0.0%" not in printed and " · MFU" not in printed
    train = [r for r in result.records if r["kind"] == "train"]
    assert len(train) == 4 and all(r["mfu"] is None and r["mfu_datasheet"] is None for r in train)
    assert result.metrics.mfu is None and result.metrics.mfu_datasheet is None
    assert result.summary["mfu"] is None and "mfu_datasheet" not in result.summary
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mfu"] is None
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [row["mfu"] for row in rows] == [""] * 4  # an empty cell, not 0
    report_run(tmp_path / "run")  # its plots leave the unknown MFU out
    assert "| mfu | — |" in (tmp_path / "run" / "report.md").read_text()


def test_bench_quotes_the_datasheet_first_where_the_device_has_one(tmp_path):
    plan = make_plan(model_names=["gpt-tiny"], sets=["model.n_layer=1", "model.d_model=32", "model.n_head=2",
                                                     "model.block_size=16", "train.batch_size=4"],
                     devices=["cpu"], precisions=["fp32"], compile=(False,),
                     timing=Timing(steps=3, warmup=1, max_seconds=1e-3))
    sheet = dataclasses.replace(plan.devices[0], datasheet_tflops={"fp32": 1e-3})  # 1 GFLOP/s, as if a datasheet
    plan.devices, plan.precisions = [sheet], {sheet.label: ["fp32"]}
    out = io.StringIO()
    doc = run_plan(plan, Console(file=out, width=250))
    cell = next(c for c in doc["cells"] if c["data"] == "synthetic")
    assert cell["mfu_datasheet"] == pytest.approx(cell["achieved_flops"] / 1e9)
    assert cell["mfu"] == pytest.approx(cell["achieved_flops"] / cell["peak_flops"])
    assert f"MFU {100 * cell['mfu_datasheet']:.1f}% ({100 * cell['mfu']:.1f}% of measured peak)" in out.getvalue()
    write_report(doc, tmp_path)
    header, _, row = [ln for ln in (tmp_path / "report.md").read_text().splitlines() if ln.startswith("|")][:3]
    columns, values = header.strip("|").split(" | "), row.strip("|").split(" | ")
    assert columns.index("MFU (datasheet)") + 1 == columns.index("MFU (measured)")
    assert values[columns.index("MFU (datasheet)")] == f"{100 * cell['mfu_datasheet']:.1f}%"
