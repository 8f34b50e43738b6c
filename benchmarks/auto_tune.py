"""What precision and compile "auto" decide for a recipe on this machine, and the step time they give,
against the same recipe forced to eager fp32.

Runs `gpudl train` twice, each in a fresh process (so each compiles from its own start, as a user's
run does): eager fp32 first (the comparison: short, its step time is what matters), then everything
"auto". Prints each run's Precision and Compile lines from its start block and its milliseconds a step
(summary.json's `step_s`: the log windows after the first), and writes the figures as JSON.

The auto run's default length matters: `run/autotune.py` tries compiling only where the run, at
the eager step time, is longer than the compiles would take (two of about 15 s each), so gpt-tiny
(about 6 ms a step eager on an H200) needs some 5,000 steps before compile and CUDA graphs are timed.

    python benchmarks/auto_tune.py --device cuda --json auto.json           # gpt-tiny, 8000 auto steps
    python benchmarks/auto_tune.py --device cpu --steps 4 --baseline-steps 4 --set model.n_layer=1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--config", default=None, help="a recipe (default: gpt-tiny, the default recipe)")
    p.add_argument("--steps", type=int, default=8000, help="steps of the auto run")
    p.add_argument("--baseline-steps", type=int, default=300, help="steps of the eager fp32 run")
    p.add_argument("--goal-ms", type=float, default=2.0, help="the step time the auto run should reach")
    p.add_argument("--set", action="append", default=[], dest="sets", help="more --set section.key=value (both runs)")
    p.add_argument("--out", type=Path, default=None, help="where the runs' folders go (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def run(name: str, args: argparse.Namespace, out: Path, steps: int, forced: list[str]) -> dict:
    """One `gpudl train`: its start block's decisions (printed as they come, so a run cut short by a time
    limit still shows them), its step time and how long the process took."""
    sets = [f"run.dir={out / name}", f"train.max_steps={steps}", "train.time_budget_s=0", "train.eval_every=0",
            "sample.tokens=0", *args.sets, *forced]
    recipe = ["--config", args.config] if args.config else []
    argv = [sys.executable, "-m", "gpudl", "train", "--device", args.device, *recipe,
            *[a for s in sets for a in ("--set", s)]]
    t0, said, lines = time.perf_counter(), {}, []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(("Precision:", "Compile:")):
                key, value = line.split(":", 1)
                said[key] = value.strip()
                print(f"{name} · {key}: {said[key]}", flush=True)
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stdout.writelines(lines[-30:])
        raise SystemExit(f"auto_tune: the {name} run failed (exit {proc.returncode})")
    summary = json.loads(next((out / name).glob("*/summary.json")).read_text())
    r = {"run": name, "precision": said.get("Precision"), "compile": said.get("Compile"), "steps": summary["steps"],
         "step_ms": summary["step_s"] * 1e3, "loop_s": summary["wall_s"], "process_s": process_s,
         "final_loss": summary["final_loss"]}
    print(f"{name} · {r['step_ms']:.2f} ms a step · {r['steps']} steps · loop {r['loop_s']:.1f} s · "
          f"process {r['process_s']:.1f} s (start-up, probe and compiling included)", flush=True)
    return r


def main() -> int:
    args = parse()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpudl-auto-"))
    runs = [run("eager-fp32", args, out, args.baseline_steps, ["train.precision=fp32", "train.compile=false"]),
            run("auto", args, out, args.steps, ["train.precision=auto", "train.compile=auto"])]
    base, auto = runs
    speedup = base["step_ms"] / auto["step_ms"]
    met = auto["step_ms"] <= args.goal_ms
    print(f"auto vs eager-fp32 · {speedup:.2f}x the steps a second · goal {args.goal_ms:g} ms a step: "
          f"{'met' if met else 'not met'} ({auto['step_ms']:.2f} ms)")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "runs": runs, "speedup": speedup,
                                         "goal_ms": args.goal_ms, "goal_met": met}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
