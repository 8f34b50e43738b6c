"""What each phase of scripts/gpu-check left in its folder, read back as figures.

Machine-readable outputs first (the bench's bench.json, pytest's JUnit XML, a training run's
summary.json, the benchmarks' --json rows); a log only where a benchmark writes nothing else,
or where the phase was cut short before it wrote its file (the rows it printed are still
measurements; the result says which source it read). Nothing here estimates or fills in a
figure: what a phase did not measure is absent. Standard library only, so that a summary is
written even when torch or gpudl cannot be imported.
"""

from __future__ import annotations

import json
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

GiB = 2**30

# --- phases.txt, as scripts/gpu-check writes it ------------------------------------------------------

HEADER = re.compile(r"^(\S+) gpu-check mode=(\S+) (.*)$")
START = re.compile(r"^(\S+) start (\S+) limit=(\d+)s own=(\d+)s: (.*)$")
END = re.compile(r"^(\S+) end (\S+) exit=(\d+) seconds=(\d+)$")
SKIP = re.compile(r"^(\S+) skip (\S+): (.*)$")
DONE = re.compile(r"^(\S+) done seconds=(\d+)$")
TIMED_OUT = (124, 137)  # timeout's status after SIGTERM, and after the SIGKILL that follows it


def read_phases(path: Path) -> tuple[dict, dict[str, dict]]:
    """(the run's header fields, {phase name: its record}) in the order the phases ran."""
    header, phases = {}, {}
    for line in path.read_text(encoding="utf8").splitlines() if path.exists() else []:
        if m := HEADER.match(line):
            header = {"started": m[1], "mode": m[2], **dict(kv.split("=", 1) for kv in m[3].split() if "=" in kv)}
        elif m := START.match(line):
            phases[m[2]] = {"started": m[1], "limit_s": int(m[3]), "own_limit_s": int(m[4]), "command": m[5], "exit": None,
                            "seconds": None, "status": "interrupted"}  # no end line: the script itself was stopped
        elif m := END.match(line):
            rec = phases.setdefault(m[2], {"command": None, "limit_s": None})
            rec.update(exit=int(m[3]), seconds=int(m[4]), status=status_of(int(m[3])))
        elif m := DONE.match(line):
            header.update(ended=m[1], seconds=int(m[2]))
        elif m := SKIP.match(line):
            phases[m[2]] = {"started": m[1], "limit_s": 0, "command": None, "exit": None, "seconds": 0,
                            "status": "skipped", "reason": m[3]}
    return header, phases


def status_of(code: int) -> str:
    return "ok" if code == 0 else "timed out" if code in TIMED_OUT else "failed"


def _num(text: str | None) -> float | None:
    return None if text is None else float(text.replace(",", ""))


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError):
        return None


def _log(out: Path, name: str) -> list[str]:
    path = out / f"{name}.log"
    return path.read_text(encoding="utf8", errors="replace").splitlines() if path.exists() else []


# --- gpudl info --------------------------------------------------------------------------------------

def info_tree(out: Path, name: str) -> dict:
    """The device tree as `gpudl info` drew it (the README shows it as text)."""
    lines = [ln.rstrip() for ln in _log(out, name) if ln.strip()]
    return {"source": f"{name}.log", "tree": lines[:40]} if lines else {}


def info_json(out: Path, name: str) -> dict:
    """Each device: name, memory, compute units, measured and datasheet peak TFLOP/s per precision."""
    doc = _json(out / "info.json")
    if not isinstance(doc, dict) or not doc.get("devices"):
        return {}
    devices = []
    for d in doc["devices"]:
        peaks = {p: {"measured": v.get("measured"), "datasheet": v.get("datasheet")}
                 for p, v in (d.get("peak_tflops") or {}).items()}
        devices.append({"kind": d.get("kind"), "name": d.get("name"), "count": d.get("count"),
                        "memory_gib": d.get("memory_bytes") and d["memory_bytes"] / GiB,
                        "compute_units": d.get("compute_units"), "unit_name": d.get("unit_name"),
                        "capability": d.get("capability"), "versions": d.get("versions"), "peak_tflops": peaks})
    return {"source": "info.json", "devices": devices}


def gpu_name(info: dict) -> str | None:
    """The first device that is not the CPU, as `gpudl info --json` names it."""
    return next((d["name"] for d in info.get("devices", []) if d.get("kind") != "cpu"), None)


# --- pytest's JUnit XML --------------------------------------------------------------------------------

def tests(out: Path, name: str) -> dict:
    path = out / f"{name}.xml"
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, skips = [], {}
    for case in root.iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(test)
        elif (skip := case.find("skipped")) is not None:
            reason = (skip.get("message") or "").strip()
            skips[reason] = skips.get(reason, 0) + 1
    return {"source": path.name, **count, "passed": count["tests"] - count["failures"] - count["errors"]
            - count["skipped"], "seconds": sum(float(s.get("time", 0)) for s in suites),
            "failed_tests": failed[:30], "skip_reasons": dict(sorted(skips.items(), key=lambda kv: -kv[1])[:8])}


# --- gpudl bench ---------------------------------------------------------------------------------------

# MFU: "41.7% (52.5% of measured peak)" (datasheet, measured) or "34.0% of measured peak" (no datasheet
# figure); "MFU 34.0%" alone is the measured one, as gpudl printed it before it knew the datasheet's.
CELL = re.compile(r"^([✓✗]) (.+?): (?:failed \((.*)\)|([\d,.]+) samples/s · step ([\d.]+) ms"
                  r"(?: · MFU (?:([\d.]+)% \(([\d.]+)% of measured peak\)|([\d.]+)%(?: of measured peak)?))?"
                  r"(?: · compile ([\d.]+) s \(not timed\))?"
                  r"(?: · waits for data ([\d.]+)% of each step)?)\s*$")


def bench(out: Path, name: str) -> dict:
    """Every cell of a `gpudl bench --out OUT_DIR/NAME`: from bench.json, else the lines it printed."""
    doc = _json(out / name / "bench.json")
    if isinstance(doc, dict) and "cells" in doc:
        res = {"source": f"{name}/bench.json", "cells": [_cell(c) for c in doc["cells"]],
               "model_errors": {m["name"]: m["error"] for m in doc.get("models", []) if m.get("error")},
               "loader": [{k: f.get(k) for k in ("model", "device", "precision", "wait_frac", "bottleneck", "advice")}
                          for f in doc.get("loader", [])],
               "peak_tflops": {d["label"]: {k: v / 1e12 for k, v in d.get("peak_flops", {}).items()}
                               for d in doc.get("devices", [])},
               "seconds": doc.get("duration_s")}
    else:
        cells = [_logged_cell(m) for line in _log(out, name) if (m := CELL.match(line.strip()))]
        if not cells:
            return {}
        res = {"source": f"{name}.log (no bench.json: the phase ended before writing it)", "cells": cells}
    res["speedups"] = _speedups(res["cells"])
    return res


def _cell(c: dict) -> dict:
    return {"model": c["model"], "device": c["device_kind"], "precision": c["precision"], "compile": c["compile"],
            "data": c["data"], "status": c["status"], "reason": c.get("reason"), "batch": c.get("batch_size"),
            "grad_accum": c.get("grad_accum"), "samples_per_s": c.get("samples_per_s"),
            "units_per_s": c.get("units_per_s"), "unit": c.get("unit"), "mfu_datasheet": c.get("mfu_datasheet"),
            "mfu": c.get("mfu"),
            "step_ms": c.get("step_s_p50") and 1e3 * c["step_s_p50"], "steps": c.get("steps"), "cv": c.get("cv"),
            "peak_mem_gib": c.get("peak_mem_bytes") and c["peak_mem_bytes"] / GiB,
            "speedup_vs_cpu": c.get("speedup_vs_cpu"), "compile_s": c.get("compile_s"),
            "data_wait": c.get("data_wait_frac")}


def _logged_cell(m: re.Match) -> dict:
    parts = m[2].split(" · ")
    model, device, precision, mode = (parts + [None] * 4)[:4]
    ok = m[1] == "✓"
    sheet, mfu = _num(m[6]), _num(m[7] or m[8])
    return {"model": model, "device": device, "precision": precision, "compile": mode == "compiled",
            "data": "real" if "real data" in parts[4:] else "synthetic", "status": "ok" if ok else "failed",
            "reason": m[3], "samples_per_s": _num(m[4]), "mfu_datasheet": sheet and sheet / 100,
            "mfu": mfu and mfu / 100, "step_ms": _num(m[5]), "compile_s": _num(m[9]),
            "data_wait": _num(m[10]) and _num(m[10]) / 100}


def _speedups(cells: list[dict]) -> dict:
    """Per model: the fastest accelerator cell's samples/s over the fastest CPU cell's (synthetic data)."""
    out = {}
    for model in dict.fromkeys(c["model"] for c in cells):
        ok = [c for c in cells if c["model"] == model and c["status"] == "ok" and c["data"] == "synthetic"]
        cpu = max((c for c in ok if c["device"] == "cpu"), key=lambda c: c["samples_per_s"], default=None)
        acc = max((c for c in ok if c["device"] != "cpu"), key=lambda c: c["samples_per_s"], default=None)
        if cpu and acc:
            out[model] = {"accelerator": _cell_name(acc), "accelerator_samples_per_s": acc["samples_per_s"],
                          "cpu": _cell_name(cpu), "cpu_samples_per_s": cpu["samples_per_s"],
                          "speedup": acc["samples_per_s"] / cpu["samples_per_s"]}
    return out


def _cell_name(c: dict) -> str:
    return f"{c['device']} {c['precision']} {'compiled' if c['compile'] else 'eager'}"


# --- benchmarks/overhead.py and benchmarks/peers.py (they print; no JSON) -------------------------------

OVERHEAD = re.compile(r"^overhead: ([+-][\d.]+)% \(median of (\d+) rounds; quartiles ([+-][\d.]+)% \.\. ([+-][\d.]+)%"
                      r"(?:; the median's 95% interval ([+-][\d.]+)% \.\. ([+-][\d.]+)%)?\)")
ROUND = re.compile(r"^round\s+\d+: gpudl\s+([\d.]+) ms/step · raw\s+([\d.]+) ms/step · ratio ([\d.]+)")


def overhead(out: Path, name: str) -> dict:
    lines = _log(out, name)
    setup = next((ln.split(": ", 1)[1] for ln in lines if ln.startswith("Using device: ")), None)
    rounds = [m for ln in lines if (m := ROUND.match(ln))]
    res = {"source": f"{name}.log", "setup": setup, "rounds": len(rounds)}
    if rounds:
        res["gpudl_ms_per_step_median"] = statistics.median(float(m[1]) for m in rounds)
        res["raw_ms_per_step_median"] = statistics.median(float(m[2]) for m in rounds)
    if m := next((OVERHEAD.match(ln) for ln in lines if OVERHEAD.match(ln)), None):
        res.update(overhead_pct=float(m[1]), quartiles_pct=[float(m[3]), float(m[4])],
                   **({"median_interval_pct": [float(m[5]), float(m[6])]} if m[5] else {}))
    elif rounds:  # cut short: the rounds it timed, without the benchmark's own verdict
        res["overhead_pct_of_rounds_done"] = 100 * (statistics.median(float(m[3]) for m in rounds) - 1)
    return res if setup or rounds else {}


PEER_SETUP = re.compile(r"^Using device: (.*?)(?: · skipped \(not installed\): (.*))?$")
PEER_TOOL = re.compile(r"^  (\S.*?)\s+([\d.]+) samples/s \(median of (\d+) rounds\)"
                       r"(?: · time vs raw PyTorch: ([+-][\d.]+)% \(quartiles ([+-][\d.]+)% \.\. ([+-][\d.]+)%\))?$")
PEER_OVER = re.compile(r"^    over (\S.*?)\s+([\d.]+)x \(quartiles ([\d.]+)x \.\. ([\d.]+)x\)$")
PEER_DEFAULTS = re.compile(r"^(raw PyTorch|gpudl|Lightning Fabric|HF Accelerate) defaults: (.*)$")


def peers(out: Path, name: str) -> dict:
    res = {"source": f"{name}.log", "tools": {}, "gpudl_over": {}, "defaults": {}}
    for ln in _log(out, name):
        if m := PEER_SETUP.match(ln):
            res.update(setup=m[1], not_installed=m[2].split(", ") if m[2] else [])
        elif ln.startswith(("1. ", "2. ")):
            res["comparison"] = ln
        elif m := PEER_TOOL.match(ln):
            res["tools"][m[1]] = {"samples_per_s": float(m[2]), "rounds": int(m[3]),
                                  **({"time_vs_raw_pct": float(m[4]), "quartiles_pct": [float(m[5]), float(m[6])]}
                                     if m[4] else {})}
        elif m := PEER_OVER.match(ln):
            res["gpudl_over"][m[1]] = {"ratio": float(m[2]), "quartiles": [float(m[3]), float(m[4])]}
        elif m := PEER_DEFAULTS.match(ln):
            res["defaults"][m[1]] = m[2]
    return res if "setup" in res else {}


# --- gpudl train ---------------------------------------------------------------------------------------

RUN_FIGURES = ("model", "device", "precision", "steps", "final_loss", "val_loss", "tokens_per_s", "samples_per_s",
               "mfu_datasheet", "mfu", "step_s", "peak_mem_gb", "data_wait_frac", "nonfinite_steps", "wall_s",
               "params_m", "torch")


def train(out: Path, name: str) -> dict:
    """The run's summary.json; without one (cut short), its last logged training and eval records."""
    runs = sorted((out / "runs").glob("*/"), key=lambda p: p.stat().st_mtime)
    if not runs:
        return {}
    run = runs[-1]
    summary = _json(run / "summary.json")
    if isinstance(summary, dict):
        # mfu_datasheet only where the run knew it (a CPU has no datasheet figure): not a "—" row on every CPU run
        return {"source": f"runs/{run.name}/summary.json",
                **{k: summary.get(k) for k in RUN_FIGURES if k in summary or k != "mfu_datasheet"}}
    records = [_json_line(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    last = {r.get("kind"): r for r in records if isinstance(r, dict)}
    if "train" not in last:
        return {}
    t = last["train"]
    return {"source": f"runs/{run.name}/metrics.jsonl (no summary.json: the run did not finish; its last records)",
            "steps": t.get("step"), "final_loss": t.get("loss"), "val_loss": last.get("eval", {}).get("loss"),
            "tokens_per_s": t.get("units_per_s"), "samples_per_s": t.get("samples_per_s"),
            **({"mfu_datasheet": t["mfu_datasheet"]} if t.get("mfu_datasheet") is not None else {}),
            "mfu": t.get("mfu"),
            "step_s": t.get("step_s"), "peak_mem_gb": t.get("peak_mem_gb"), "data_wait_frac": t.get("data_wait_frac")}


def _json_line(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


# --- benchmarks/memory_accuracy.py (CPU only) and benchmarks/serve_load.py ----------------------------

MEM_ROW = re.compile(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)%\s+([\d.]+)$")


def memory_accuracy(out: Path, name: str) -> dict:
    rows, source = _json(out / f"{name}.json"), f"{name}.json"
    if not isinstance(rows, list):
        source = f"{name}.log (no {name}.json: the phase ended before writing it)"
        rows = [{"case": m[1], "predicted_bytes": float(m[2]) * 2**20, "measured_bytes": float(m[3]) * 2**20,
                 "error": float(m[4]) / 100} for ln in _log(out, name)
                if (m := MEM_ROW.match(ln.strip())) and not ln.startswith("case")]
    if not rows:
        return {}
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {"source": source, "cases": len(rows), "median_abs_error_pct": 100 * statistics.median(errors),
            "worst_abs_error_pct": 100 * max(errors), "worst_case": worst["case"],
            "rows": [{"case": r["case"], "error_pct": 100 * r["error"], "predicted_mib": _mib(r.get("predicted_bytes")),
                      "measured_mib": _mib(r.get("measured_bytes")),
                      "measured_baseline_mib": _mib(r.get("measured_baseline_bytes"))} for r in rows]}


def _mib(nbytes: float | None) -> float | None:
    """MiB, for the summary: where a gap comes from is read off these (a constant one is a runtime buffer)."""
    return None if nbytes is None else nbytes / 2**20


SERVE_ALONE = re.compile(r"^(resnet|gpt)\s+the model alone: a batch of 32 gives ([\d.]+)x")
SERVE_ROW = re.compile(r"^(resnet|gpt)\s+(\S+)\s+c=(\d+)\s+([\d.]+) (?:img|tok)/s\s+p50\s+([\d.na]+) ms\s+"
                       r"p99\s+([\d.na]+) ms\s+errors (\d+)")


def serve_load(out: Path, name: str) -> dict:
    rows, source = _json(out / f"{name}.json"), f"{name}.json"
    if not isinstance(rows, list):
        source = f"{name}.log (no {name}.json: the phase ended before writing it)"
        rows = [{"model": m[1], "server": m[2], "concurrency": int(m[3]), "throughput": float(m[4]),
                 "p50_ms": float(m[5]), "p99_ms": float(m[6]), "errors": int(m[7])}
                for ln in _log(out, name) if (m := SERVE_ROW.match(ln))]
        rows += [{"model": m[1], "server": "model alone", "batch_over_one": float(m[2])}
                 for ln in _log(out, name) if (m := SERVE_ALONE.match(ln))]
    # the model alone, a call of 32 against a call of one: the most batching can buy on this device
    alone = {r["model"]: r["batch_over_one"] for r in rows if r.get("server") == "model alone"}
    rows = [r for r in rows if "concurrency" in r]
    if not rows:
        return {}
    at = {(r["model"], r["server"], r["concurrency"]): r for r in rows}
    ratios = []
    for (model, server, c), r in sorted(at.items()):
        one, plain = at.get((model, "batch-1", c)), at.get((model, "plain", c))
        if server == "batching" and (one or plain):
            ratios.append({"model": model, "concurrency": c,
                           "throughput_vs_batch1": _ratio(r, one, "throughput"), "p99_vs_batch1": _ratio(r, one, "p99_ms"),
                           "throughput_vs_plain": _ratio(r, plain, "throughput")})
    return {"source": source, "points": rows, "ratios": ratios, "batch_of_32_vs_one": alone}


def _ratio(a: dict, b: dict | None, key: str) -> float | None:
    return a[key] / b[key] if b and b.get(key) else None


# --- benchmarks/checkpoint_stall.py (it prints) -----------------------------------------------------------

STALL = re.compile(r"^  (stall_s|end_wait_s|wall_s)\s+blocking\s+([\d.]+) s\s+background\s+([\d.]+) s"
                   r"(?:\s+ratio of medians ([\d.]+), median of the rounds' ratios ([\d.]+))?")


def checkpoint_stall(out: Path, name: str) -> dict:
    lines = _log(out, name)
    setup = next((ln for ln in lines if " parameters) on " in ln), None)
    rows = {m[1]: {"blocking_s": float(m[2]), "background_s": float(m[3]),
                   **({"ratio": float(m[4]), "rounds_ratio": float(m[5])} if m[4] else {})}
            for ln in lines if (m := STALL.match(ln))}
    return {"source": f"{name}.log", "setup": setup, "rows": rows} if rows else {}


def input_pipeline(out: Path, name: str) -> dict:
    """benchmarks/input_pipeline.py's JSON; cut short, the loader and train lines its log has."""
    doc = _json(out / f"{name}.json")
    if isinstance(doc, dict):
        return {"source": f"{name}.json", "loader": doc.get("loader", []), "train": doc.get("train")}
    lines = [ln for ln in _log(out, name) if ln.startswith(("loader · ", "train · "))]
    return {"source": f"{name}.log (no JSON: the phase did not finish; its lines)", "lines": lines} if lines else {}


def fp8(out: Path, name: str) -> dict:
    """benchmarks/fp8_training.py's JSON (runs and comparisons); cut short, the comparison lines its log has."""
    doc = _json(out / f"{name}.json")
    if isinstance(doc, dict) and doc.get("runs"):
        return {"source": f"{name}.json", "runs": doc["runs"], "comparisons": doc.get("comparisons", [])}
    lines = [ln for ln in _log(out, name) if " vs " in ln and "tokens/s" in ln]
    return {"source": f"{name}.log (no JSON: the phase did not finish; its lines)", "lines": lines} if lines else {}


def auto_tune(out: Path, name: str) -> dict:
    """benchmarks/auto_tune.py's JSON (each run's decisions and ms a step); cut short, the lines its log has."""
    doc = _json(out / f"{name}.json")
    if isinstance(doc, dict) and doc.get("runs"):
        return {"source": f"{name}.json", **{k: doc.get(k) for k in ("runs", "speedup", "goal_ms", "goal_met")}}
    lines = [ln for ln in _log(out, name) if ln.startswith(("eager-fp32 · ", "auto · "))]
    return {"source": f"{name}.log (no JSON: the phase did not finish; its lines)", "lines": lines} if lines else {}
