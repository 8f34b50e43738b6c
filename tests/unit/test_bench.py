"""`gpudl bench` and `gpudl report`: a tiny GPT on the CPU, the JSON schema, PNGs, Markdown, failing cells."""

import dataclasses
import json
import struct

import pytest
import torch
from rich.console import Console

from gpudl.bench import Timing, dataload, run_plan, write_report
from gpudl.observe import plots
from gpudl.bench.roofline import ByteCounter, attainable_flops
from gpudl.bench.suite import make_plan, speedups
from gpudl.cli import main

TINY_TOML = """[model]
name = "gpt-tiny"
n_layer = 1
d_model = 32
n_head = 2
block_size = 16

[train]
batch_size = 4
"""
QUICK = ["--device", "cpu", "--precision", "fp32", "--no-compile", "--steps", "2", "--warmup", "1"]

# The document's schema, checked key by key: name -> type (or a nested schema for a dict, [schema] for a list).
NUM = (int, float)
CELL = {"model": str, "device": str, "device_kind": str, "precision": str, "compile": bool, "data": str,
        "status": str, "reason": (str, type(None)), "batch_size": int, "grad_accum": int, "unit": str,
        "units_per_sample": int, "warmup_steps": int, "steps": (int, type(None)), "wall_s": NUM,
        "step_times_s": (list, type(None)),
        **{k: (*NUM, type(None)) for k in ("samples_per_s", "units_per_s", "samples_per_s_mean", "step_s_p50",
                                           "step_s_p90", "step_s_mean", "cv", "flops_per_step", "achieved_flops",
                                           "peak_flops", "mfu", "mfu_datasheet", "peak_mem_bytes", "compile_s",
                                           "warmup_s", "data_wait_frac", "loader_workers", "speedup_vs_cpu",
                                           "bytes_per_step", "intensity")}}
SCHEMA = {
    "schema": str, "created": str, "command": (str, type(None)), "duration_s": NUM,
    "machine": {"platform": str, "python": str, "cpu": str, "cpu_cores": int, "cpu_isa": str,
                "cpu_threads_torch": int, "versions": dict},
    "settings": {"steps": int, "warmup": int, "max_seconds": NUM, "min_steps": int, "compile": list,
                 "precisions": dict, "models": list, "timing": str},
    "devices": [{"label": str, "kind": str, "name": str, "memory_bytes": (int, type(None)),
                 "compute_units": (int, type(None)), "versions": dict, "peak_flops": dict,
                 "bandwidth_bytes_per_s": NUM}],
    "models": [{"name": str, "preset": str, "description": str, "params": int, "batch_size": int,
                "flops_per_sample": (int, type(None)), "bytes_per_step": dict, "error": (str, type(None))}],
    "cells": [CELL],
    "loader": [{"model": str, "device": str, "precision": str, "num_workers": int, "status": str,
                "reason": (str, type(None)), "wait_frac": (*NUM, type(None)), "step_s_p50": (*NUM, type(None)),
                "synthetic_step_s_p50": (*NUM, type(None)), "slowdown": (*NUM, type(None)),
                "bottleneck": (bool, type(None)), "advice": list}],
    "plots": list, "env": dict,
}


def check_schema(value, schema, where="doc"):
    if isinstance(schema, dict):
        assert isinstance(value, dict) and set(value) == set(schema), (where, set(value) ^ set(schema))
        for key, sub in schema.items():
            check_schema(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list) and value, where
        for i, item in enumerate(value):
            check_schema(item, schema[0], f"{where}[{i}]")
    else:
        assert isinstance(value, schema) and not (schema is int and isinstance(value, bool)), (where, value)


def png_size(path):
    """(width, height) from a PNG's signature and IHDR chunk; fails for anything else."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def md_tables(text):
    """Each Markdown table as a list of rows (cells split on |); every row as wide as its header."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip("|").split(" | ")])
        elif current:
            assert set(current[1][0].split("|")) <= {"---"}, current[1]
            assert all(len(row) == len(current[0]) for row in current[2:]), current
            tables.append(current)
            current = []
    return tables


@pytest.fixture(scope="module")
def cli_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    (root / "tiny.toml").write_text(TINY_TOML)
    return root


def test_cli_smoke_run_writes_json_markdown_and_plots(cli_bench, capsys):
    out = cli_bench / "out"
    assert main(["bench", "--config", str(cli_bench / "tiny.toml"), *QUICK, "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((out / "bench.json").read_text())
    check_schema(doc, SCHEMA)
    (grid,) = [c for c in doc["cells"] if c["data"] == "synthetic"]
    assert grid["status"] == "ok" and grid["steps"] == len(grid["step_times_s"]) == 2 and grid["speedup_vs_cpu"] == 1.0
    assert 0 < grid["mfu"] < 1 and grid["samples_per_s"] > 0 and grid["peak_mem_bytes"] > 0
    assert grid["step_s_p50"] <= grid["step_s_p90"] and grid["intensity"] > 0
    assert doc["loader"][0]["status"] == "ok" and 0 <= doc["loader"][0]["wait_frac"] <= 1
    assert sorted(doc["plots"]) == ["roofline.png", "throughput.png"]
    for name in doc["plots"]:
        w, h = png_size(out / name)
        assert w > 100 and h > 100
    md = (out / "report.md").read_text()
    tables = md_tables(md)
    assert tables[0][0][:4] == ["device", "precision", "compile", "samples/s"] and len(tables[0]) == 3
    assert ["device", "measured peak", "memory bandwidth", "ridge (FLOP/byte)"] in [t[0] for t in tables]
    assert "![throughput.png](throughput.png)" in md and "upper bound" in md


def test_a_failing_cell_is_reported_and_the_rest_runs_within_its_time(tmp_path):
    plan = make_plan(model_names=["gpt-tiny"], sets=["model.n_layer=1", "model.d_model=32", "model.n_head=2",
                                                     "model.block_size=16", "train.batch_size=4"],
                     devices=["cpu"], precisions=["fp32"], compile=(False,),
                     timing=Timing(steps=50, warmup=1, max_seconds=1e-3))  # so: the 3 steps timed at least
    # A device that cannot run bf16, with bf16-mixed forced into its grid (first, so the run must go on after it).
    no_bf16 = dataclasses.replace(plan.devices[0], bf16=False, fp16=False)
    plan.devices = [no_bf16]
    plan.precisions = {no_bf16.label: ["bf16-mixed", "fp32"]}
    doc = run_plan(plan, Console(quiet=True))
    write_report(doc, tmp_path)
    check_schema(json.loads((tmp_path / "bench.json").read_text()), SCHEMA)
    failed, ok = [c for c in doc["cells"] if c["data"] == "synthetic"]
    assert failed["status"] == "failed" and "needs bf16 support" in failed["reason"] and failed["mfu"] is None
    assert ok["status"] == "ok" and ok["samples_per_s"] > 0 and ok["steps"] == 3
    md = (tmp_path / "report.md").read_text()
    assert "failed: UserError: precision 'bf16-mixed' needs bf16 support" in md
    assert png_size(tmp_path / "throughput.png")[0] > 100


def test_without_matplotlib_json_and_markdown_are_still_written(cli_bench, capsys, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    out = cli_bench / "noplot"
    assert main(["bench", "--config", str(cli_bench / "tiny.toml"), *QUICK, "--out", str(out)]) == 0
    assert "pip install 'gpudl[plot]'" in capsys.readouterr().out
    assert (out / "bench.json").is_file() and (out / "report.md").is_file() and not list(out.glob("*.png"))


@pytest.mark.parametrize("argv, words", [
    (["--device", "tpu9"], "device 'tpu9' is not present on this machine; present:"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--precision", "fp64"], "unknown precision 'fp64'"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--max-seconds", "0"], "--max-seconds > 0"),
])
def test_bad_input_stops_before_anything_runs(capsys, tmp_path, argv, words):
    code = main(["bench", *argv, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_a_precision_the_device_cannot_run_names_what_it_can(capsys, tmp_path, monkeypatch):
    import gpudl.device.discovery

    monkeypatch.setattr(gpudl.device.discovery, "_mkldnn_supports", lambda dtype: False)  # a CPU without bf16/fp16
    code = main(["bench", "--device", "cpu", "--precision", "bf16-mixed", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "needs bf16 support" in err and "use one of fp32" in err
    assert not (tmp_path / "b").exists()


def test_report_of_a_training_run(tiny, capsys):
    from gpudl.run.recipe import train

    run_dir = train(tiny("log.plot=false"), console=Console(quiet=True)).run_dir
    assert main(["report", str(run_dir)]) == 0
    for name in ("loss.png", "throughput.png", "memory.png"):
        w, h = png_size(run_dir / name)
        assert w > 100 and h > 100, name
    md = (run_dir / "report.md").read_text()
    assert md_tables(md)[0][0] == ["figure", "value"] and "![memory](memory.png)" in md
    assert "Wrote" in capsys.readouterr().out


def test_report_needs_metrics(capsys, tmp_path):
    (tmp_path / "config.toml").write_text("")
    assert main(["report", str(tmp_path)]) == 2
    assert "has no training metrics" in capsys.readouterr().err


def test_loader_advice_names_workers_pinning_and_prefetch():
    assert dataload.advice(0.01, num_workers=0, device_kind="cuda", cores=16) == []
    tips = dataload.advice(0.3, num_workers=0, device_kind="cuda", cores=16)
    assert "data.num_workers=4" in tips[0] and "pinned" in tips[1] and "prefetch" in tips[2]
    assert "data.num_workers=1" in dataload.advice(0.3, num_workers=0, device_kind="cpu", cores=2)[0]
    assert not any("num_workers" in t for t in dataload.advice(0.3, num_workers=8, device_kind="cuda", cores=16))


def test_bytes_counted_per_operator_and_the_roof():
    a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 4, device="meta")
    with ByteCounter() as counter:
        a.t()  # a view moves nothing
        a @ b
    assert counter.bytes == 4 * (8 * 16 + 16 * 4 + 8 * 4)
    assert attainable_flops(1.0, peak_flops=100.0, bandwidth=10.0) == 10.0
    assert attainable_flops(50.0, peak_flops=100.0, bandwidth=10.0) == 100.0


def test_speedup_is_over_the_fastest_cpu_cell_of_the_same_model():
    rows = [("a", "cpu", "ok", 10.0), ("a", "cpu", "ok", 20.0), ("a", "cuda", "ok", 300.0),
            ("a", "cuda", "failed", None), ("b", "cuda", "ok", 5.0)]
    cells = [{"model": m, "device_kind": k, "status": s, "data": "synthetic", "samples_per_s": v,
              "speedup_vs_cpu": None} for m, k, s, v in rows]
    speedups(cells)
    assert [c["speedup_vs_cpu"] for c in cells] == [0.5, 1.0, 15.0, None, None]
