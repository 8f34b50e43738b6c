"""Write OUT_DIR/summary.json and OUT_DIR/summary.md from what the phases of scripts/gpu-check wrote.

    python scripts/gpu_check_summary.py OUT_DIR

Every phase of the check appears, with its status (ok, failed, timed out, skipped, interrupted,
not run) and exit code, beside the figures it measured (gpu_check_read.py reads them back); a
phase that did not finish shows what it measured before it stopped, marked as such, and never a
figure it did not measure. The summary is then read back and checked: it must parse, name every
phase, and hold figures for every phase that exited 0 (none means its output changed shape and
the reader no longer follows it). Exit status 1 when that check fails.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import gpu_check_read as read

SCHEMA = "gpudl-gpu-check/1"

# Every phase of scripts/gpu-check, in its order: (name, what it measures, reader).
PHASES = [
    ("info-json", "`gpudl info --json`", read.info_json),
    ("auto", "precision and compile \"auto\" on gpt-tiny against eager fp32 (benchmarks/auto_tune.py)",
     read.auto_tune),
    ("gpt2-compiled", "GPT-2 124M, bf16-mixed, eager and compiled", read.bench),
    ("resnet50-compiled", "ResNet-50, bf16-mixed, channels-last, 224 px, eager and compiled", read.bench),
    ("gpt-1b", "GPT 1B (gpt-1b), bf16-mixed, eager and compiled", read.bench),
    ("fp8", "fp8 against bf16-mixed on gpt-1b: tokens/s and the loss after 300 steps (benchmarks/fp8_training.py)",
     read.fp8),
    ("input-pipeline", "ResNet-50 from a folder of JPEGs against generated batches, and the loader alone per decode "
                       "path (benchmarks/input_pipeline.py)", read.input_pipeline),
    ("tests-unit", "the accelerator tier of tests/unit (`pytest -m accelerator`)", read.tests),
    ("tests-other", "the accelerator tier of the distributed, accelerator, golden and serve tests", read.tests),
    ("peers-identical", "gpudl, raw PyTorch, Fabric, Accelerate at identical settings (benchmarks/peers.py)",
     read.peers),
    ("peers-defaults", "the same, each with its own defaults (benchmarks/peers.py)", read.peers),
    ("train", "the default training run, `gpudl train`", read.train),
    ("bench-suite", "the default bench suite (gpt-tiny, resnet18) on the GPU and the CPU, eager: the speed-up",
     read.bench),
    ("info", "`gpudl info`: the device tree and its measured peaks", read.info_tree),
    ("gpt2-eager", "GPT-2 124M at every precision, eager", read.bench),
    ("resnet50", "ResNet-50, bf16-mixed, channels-last, 224 px", read.bench),
    ("memory-accuracy", "memory estimate against measured peaks (benchmarks/memory_accuracy.py)",
     read.memory_accuracy),
    ("overhead", "gpudl's loop against a raw PyTorch loop (benchmarks/overhead.py)", read.overhead),
    ("overhead-tiny", "the same on gpt-tiny, whose steps are short enough for the loop's own work to show",
     read.overhead),
    ("serve-load", "serving with batching against batch-1 and plain (benchmarks/serve_load.py; on the GPU in a real run)",
     read.serve_load),
    ("checkpoint-stall", "how long a save blocks the loop, checkpoint.async off and on (benchmarks/checkpoint_stall.py)",
     read.checkpoint_stall),
]


def collect(out: Path) -> dict:
    header, ran = read.read_phases(out / "phases.txt")
    known = {name: (what, reader) for name, what, reader in PHASES}
    phases = []
    for name in list(known) + [n for n in ran if n not in known]:
        what, reader = known.get(name, ("(a phase this summary does not know)", None))
        rec = ran.get(name, {"status": "not run", "exit": None, "seconds": None, "limit_s": None, "command": None})
        figures = reader(out, name) if reader and rec["status"] not in ("not run", "skipped") else {}
        phases.append({"name": name, "what": what, **rec, "log": f"{name}.log", "figures": figures,
                       "partial": rec["status"] != "ok" and bool(figures)})
    info = next((p["figures"] for p in phases if p["name"] == "info-json"), {})
    return {"schema": SCHEMA, "mode": header.get("mode", "unknown"), "date": header.get("started"),
            "gpu": read.gpu_name(info), "devices": info.get("devices", []), "git": header.get("git"),
            "python": header.get("python"), "seconds": header.get("seconds"),
            "all_ok": all(p["status"] == "ok" for p in phases), "phases": phases,
            "written": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# --- summary.md -----------------------------------------------------------------------------------------

def fmt(x, spec: str = ".1f", unit: str = "") -> str:
    if x is None:
        return "—"
    return f"{x:{spec}}{unit}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def pct(x, spec: str = ".1f") -> str:
    return fmt(None if x is None else 100 * x, spec, "%")


def table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]


def status_text(p: dict) -> str:
    if p["status"] in ("ok", "not run"):
        return p["status"]
    exit_ = f", exit {p['exit']}" if p["exit"] is not None else ""
    return f"**{p['status']}**{exit_}" + (f" ({p['reason']})" if p.get("reason") else "")


def seconds_text(p: dict) -> str:
    """Seconds taken / seconds allowed (its own limit, and the seconds earlier phases left unused)."""
    own = p.get("own_limit_s")
    extra = f" (own {own})" if own is not None and own != p["limit_s"] else ""
    return f"{fmt(p['seconds'], 'd')} / {fmt(p['limit_s'], 'd')}{extra}"


def render(doc: dict) -> str:
    dry = doc["mode"] == "dry-run"
    title = doc["gpu"] or ("no GPU (dry run on the CPU)" if dry else "no GPU found")
    lines = [f"# gpu-check · {title} · {(doc['date'] or '')[:10]}", ""]
    if dry:
        lines += ["**Dry run**: the phases on the CPU at tiny sizes, to check the script and this summary; "
                  "these figures are not measurements to quote.", ""]
    lines += [f"Started {doc['date']} · {fmt(doc['seconds'], 'd')} s in all · git {doc['git']} · "
              f"every phase ok: {'yes' if doc['all_ok'] else '**no**'}", "", "## Phases", ""]
    lines += table(["phase", "what", "status", "seconds / limit"],
                   [[p["name"], p["what"], status_text(p), seconds_text(p)] for p in doc["phases"]])
    for p in doc["phases"]:
        section = RENDER.get(READER.get(p["name"]), render_nothing)
        lines += [f"## {p['name']}: {p['what']}", ""]
        if p["status"] in ("skipped", "not run"):
            lines += [f"Status: {status_text(p)}.", ""]
        elif p["status"] != "ok":
            lines += [f"Status: {status_text(p)}. Log: `{p['log']}`"
                      + (". What it wrote before it stopped:" if p["partial"] else "."), ""]
        if p["figures"]:
            lines += [f"Read from `{p['figures'].get('source', p['log'])}`.", ""]
            lines += section(p["figures"])
    return "\n".join(lines) + "\n"


def render_info_tree(f: dict) -> list[str]:
    return ["```", *f["tree"], "```", ""]


def render_info_json(f: dict) -> list[str]:
    rows = [[d["name"], d["kind"], fmt(d["memory_gib"], ".1f", " GiB"), f"{fmt(d['compute_units'], 'd')} {d['unit_name']}s",
             ", ".join(f"{p} {fmt(v['measured'], '.3g')} / {fmt(v['datasheet'], '.3g')}"
                       for p, v in d["peak_tflops"].items())] for d in f["devices"]]
    return table(["device", "kind", "memory", "units", "peak TFLOP/s measured / datasheet"], rows)


def render_tests(f: dict) -> list[str]:
    lines = [f"{f['tests']} tests: {f['passed']} passed, {f['failures']} failed, {f['errors']} errors, "
             f"{f['skipped']} skipped, {f['seconds']:.0f} s", ""]
    lines += [f"- failed: `{t}`" for t in f["failed_tests"]]
    lines += [f"- skipped ({n}): {reason}" for reason, n in f["skip_reasons"].items()]
    return lines + [""]


def render_bench(f: dict) -> list[str]:
    # MFU against the datasheet peak first, as the field quotes it, where any cell has one (no CPU does)
    sheet = any(c.get("mfu_datasheet") is not None for c in f["cells"])
    rows = [[c["model"], c["device"], c["precision"], "on" if c["compile"] else "off", c["data"],
             fmt(c["samples_per_s"], ",.1f"), fmt(c.get("units_per_s"), ",.0f"),
             *([pct(c.get("mfu_datasheet"))] if sheet else []), pct(c["mfu"]),
             fmt(c["step_ms"], ".1f"), fmt(c.get("peak_mem_gib"), ".2f"), fmt(c.get("speedup_vs_cpu"), ".2f", "×"),
             fmt(c["compile_s"], ".1f"), c["status"] if c["status"] == "ok" else f"**failed**: {c['reason']}"]
            for c in f["cells"]]
    lines = table(["model", "device", "precision", "compile", "data", "samples/s", "tokens or images/s",
                   *(["MFU (datasheet)"] if sheet else []), "MFU (measured)",
                   "step ms", "peak GiB", "× CPU", "compile s", "status"], rows)
    for model, s in f.get("speedups", {}).items():
        lines.append(f"- {model}: {s['accelerator']} {s['accelerator_samples_per_s']:,.1f} samples/s over "
                     f"{s['cpu']} {s['cpu_samples_per_s']:,.1f}: **{s['speedup']:.1f}×**")
    lines += [f"- {m}: no FLOP count, so no MFU ({e})" for m, e in f.get("model_errors", {}).items()]
    lines += [f"- data loading, {d['model']} on {d['device']}: waits for data {pct(d['wait_frac'])} of each step"
              for d in f.get("loader", [])]
    return lines + [""]


def render_overhead(f: dict) -> list[str]:
    interval = f"; the median's 95% interval {f['median_interval_pct'][0]:+.2f}% … {f['median_interval_pct'][1]:+.2f}%" \
        if "median_interval_pct" in f else ""
    verdict = (f"**{f['overhead_pct']:+.2f}%** (quartiles {f['quartiles_pct'][0]:+.2f}% … {f['quartiles_pct'][1]:+.2f}%"
               f"{interval})"
               if "overhead_pct" in f else
               f"median of the rounds done {fmt(f.get('overhead_pct_of_rounds_done'), '+.2f', '%')} (cut short)")
    return [f"{f['setup']}: gpudl's time over raw PyTorch's, {f['rounds']} rounds: {verdict}; "
            f"{fmt(f.get('gpudl_ms_per_step_median'), '.2f')} vs {fmt(f.get('raw_ms_per_step_median'), '.2f')} "
            f"ms a step", ""]


def render_peers(f: dict) -> list[str]:
    lines = [f"{f['setup']}" + (f"; not installed: {', '.join(f['not_installed'])}" if f["not_installed"] else ""),
             "", f.get("comparison", "(no comparison printed)"), ""]
    lines += [f"- {tool} defaults: {setup}" for tool, setup in f["defaults"].items()]
    rows = [[tool, fmt(t["samples_per_s"], ",.1f"), fmt(t.get("time_vs_raw_pct"), "+.2f", "%"),
             fmt(f["gpudl_over"].get(tool, {}).get("ratio"), ".2f", "×")] for tool, t in f["tools"].items()]
    return lines + [""] + table(["tool", "samples/s", "time vs raw PyTorch", "gpudl's samples/s over it"], rows)


def render_train(f: dict) -> list[str]:
    shown = {"mfu_datasheet": pct, "mfu": pct, "data_wait_frac": pct, "tokens_per_s": lambda v: fmt(v, ",.0f"),
             "samples_per_s": lambda v: fmt(v, ",.1f"), "step_s": lambda v: fmt(v and 1e3 * v, ".1f", " ms")}
    return table(["figure", "value"], [[k, shown.get(k, lambda v: fmt(v, ".4g"))(v)]
                                       for k, v in f.items() if k != "source"])


def render_memory(f: dict) -> list[str]:
    lines = [f"{f['cases']} cases: median absolute error **{f['median_abs_error_pct']:.2f}%**, worst "
             f"**{f['worst_abs_error_pct']:.2f}%** ({f['worst_case']}); goal: median ≤ 2%, worst ≤ 5%", ""]
    rows = [[r["case"], fmt(r.get("predicted_mib"), ",.2f"), fmt(r.get("measured_mib"), ",.2f"),
             fmt(r.get("measured_baseline_mib"), ",.2f"), f"{r['error_pct']:+.2f}%"] for r in f["rows"]]
    return lines + table(["case", "predicted MiB", "measured MiB", "measured before the step, MiB", "error"], rows)


def render_serve(f: dict) -> list[str]:
    rows = [[r["model"], r["concurrency"], fmt(r["throughput_vs_batch1"], ".2f", "×"), fmt(r["p99_vs_batch1"], ".2f", "×"),
             fmt(r["throughput_vs_plain"], ".2f", "×")] for r in f["ratios"]]
    points = [[p["model"], p["server"], p["concurrency"], fmt(p["throughput"], ",.1f"), fmt(p["p50_ms"], ".1f"),
               fmt(p["p99_ms"], ".1f"), p["errors"]] for p in f["points"]]
    alone = [[model, fmt(x, ".2f", "×")] for model, x in f.get("batch_of_32_vs_one", {}).items()]
    return table(["model", "clients", "batching: throughput vs batch-1", "p99 vs batch-1", "throughput vs plain"],
                 rows) + table(["model", "server", "clients", "img/s or tok/s", "p50 ms", "p99 ms", "errors"], points) \
        + (table(["model", "alone: a batch of 32 against one (the most batching can buy)"], alone) if alone else [])


def render_stall(f: dict) -> list[str]:
    words = {"stall_s": "blocked per save", "end_wait_s": "wait for the last write", "wall_s": "the whole loop"}
    rows = [[words[k], fmt(r["blocking_s"], ".2f", " s"), fmt(r["background_s"], ".2f", " s"),
             fmt(r.get("rounds_ratio"), ".2f", "×")] for k, r in f["rows"].items()]
    return [f["setup"] or "", ""] + table(["", "blocking", "background", "background / blocking"], rows)


def render_pipeline(f: dict) -> list[str]:
    if "lines" in f:
        return [f"    {ln}" for ln in f["lines"]]
    rows = [[r["decode"], r["workers"], r.get("parallel", "threads"), fmt(r["images_per_s"], ",.0f")]
            for r in f["loader"]]
    lines = table(["decode", "workers", "as", "loader alone, images/s"], rows)
    t = f.get("train")
    if t:
        lines += table(["", "images/s", "data wait"], [
            [f"{t['model']} from the folder", fmt(t["folder"]["images_per_s"], ",.1f"), pct(t["folder"]["data_wait_frac"], ".2f")],
            [f"{t['model']} on generated batches", fmt(t["generated"]["images_per_s"], ",.1f"),
             pct(t["generated"]["data_wait_frac"], ".2f")],
            ["folder / generated", fmt(t["ratio"], ".3f"), ""]])
    return lines


def render_fp8(f: dict) -> list[str]:
    if "lines" in f:
        return [f"    {ln}" for ln in f["lines"]]
    rows = [[r["run"], fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("final_loss"), ".4f"), fmt(r.get("val_loss"), ".4f")]
            for r in f["runs"]]
    signed = lambda x: "—" if x is None else f"{100 * x:+.2f}%"  # noqa: E731
    vs = [[f"{c['run']} / {c['vs']}", fmt(c["speedup"], ".2f", "×"), signed(c["final_loss_diff"]),
           signed(c["val_loss_diff"])] for c in f["comparisons"]]
    return table(["run", "tokens/s", "final loss", "val loss"], rows) + [""] + \
        table(["", "tokens/s", "final loss", "val loss"], vs)


def render_auto(f: dict) -> list[str]:
    if "lines" in f:
        return [f"    {ln}" for ln in f["lines"]]
    rows = [[r["run"], r["precision"], r["compile"], fmt(r["step_ms"], ".2f", " ms"), fmt(r["steps"], "d")]
            for r in f["runs"]]
    return table(["run", "precision", "compile", "a step", "steps"], rows) + [
        "", f"auto against eager fp32: {fmt(f['speedup'], '.2f', 'x')}; goal {f['goal_ms']} ms a step: "
            f"{'met' if f['goal_met'] else 'not met'}", ""]


def render_nothing(f: dict) -> list[str]:
    return []


READER = {name: reader for name, _, reader in PHASES}
RENDER = {read.info_tree: render_info_tree, read.info_json: render_info_json, read.tests: render_tests,
          read.bench: render_bench, read.overhead: render_overhead, read.peers: render_peers, read.train: render_train,
          read.memory_accuracy: render_memory, read.serve_load: render_serve, read.checkpoint_stall: render_stall,
          read.input_pipeline: render_pipeline, read.fp8: render_fp8, read.auto_tune: render_auto}


def check(out: Path) -> list[str]:
    """What is wrong with the summary as written: it must parse, name every phase, and hold figures
    for every phase that exited 0."""
    try:
        doc = json.loads((out / "summary.json").read_text(encoding="utf8"))
    except (OSError, ValueError) as e:
        return [f"summary.json does not parse: {e}"]
    named = {p["name"] for p in doc["phases"]}
    header, ran = read.read_phases(out / "phases.txt")
    problems = [f"summary.json does not name phase {n!r}" for n in [n for n, _, _ in PHASES] + list(ran)
                if n not in named]
    problems += [f"phase {p['name']!r} exited 0 but the summary found no figures in what it wrote: has its output "
                 f"changed shape? (see {p['log']})" for p in doc["phases"] if p["status"] == "ok" and not p["figures"]]
    problems += [f"phase {p['name']!r} is not one this summary knows" for p in doc["phases"]
                 if p["what"].startswith("(a phase")]
    asked = set(header["only"].split(",")) if "only" in header else None  # `--only`: the phases asked for
    if "seconds" in header:  # the script got to its end: a phase it never started is one it does not have
        problems += [f"phase {p['name']!r} is in this summary's list but the script did not run it"
                     for p in doc["phases"] if p["status"] == "not run" and (asked is None or p["name"] in asked)]
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    doc = collect(out)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf8")
    (out / "summary.md").write_text(render(doc), encoding="utf8")
    problems = check(out)
    for p in problems:
        print(f"gpu-check summary: {p}", file=sys.stderr)
    print(f"Summary: {out / 'summary.md'} · {out / 'summary.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
