"""fp8 against bf16-mixed: one GPT trained the same steps from the same start on the same batches at each
precision; tokens/s of each and the losses at the end. scripts/gpu-check's `fp8` phase runs it on gpt-1b.

The goal (the issue that brought fp8): after 300 steps of gpt-1b the loss within 1% of bf16-mixed's, and
fp8 at least 1.2x bf16-mixed's tokens/s.

Each precision trains in a process of its own (its own compile, memory and caches), through gpudl's own
assembly and loop: the recipe's model and data (`model_and_data`: text through its BPE, cached after the
first run; batch k the same in every run at one seed), `recipe_job` (the `parallelize` order, float8 step
and compile included), `train_loop`. Without checkpoints, which for a 1B model would be most of the time.
tokens/s counts the steps after `--warmup` (compilation and the first allocations are in those); the losses
are the last step's, the mean of the last 10 steps' (the same batches in every run) and, with
`--eval-batches N`, the recipe's validation loss over N batches at the end (in eval mode, which compile
compiles again: not in the timing, but in the phase's minutes).

    python benchmarks/fp8_training.py --config gpt-1b --steps 300 --batch-size 8 --block-size 1024
    python benchmarks/fp8_training.py --runs bf16-mixed,fp32 --config gpt-tiny --steps 20 --device cpu  # plumbing

A run is `PRECISION` or `fp8:RECIPE` (train.fp8_recipe). With `--budget-s`, a run is skipped, with a line
saying so, where the time left is less than the longest run so far took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt-1b", help="a shipped recipe or a .toml")
    p.add_argument("--runs", default="bf16-mixed,fp8:tensorwise,fp8:rowwise",
                   help="comma-separated: the first is the reference the others are compared with")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of tokens/s (compilation)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=0, help="context length (0: the model's)")
    p.add_argument("--eval-batches", type=int, default=0, help="validation batches at the end (0: none)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--budget-s", type=float, default=0.0, help="skip runs that would not end within it (0: none)")
    p.add_argument("--json", help="write the runs and the comparison here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: train this one run and print its JSON line
    return p.parse_args(argv)


def settings(args: argparse.Namespace, run: str) -> list[str]:
    precision, _, recipe = run.partition(":")
    sets = [f"train.precision={precision}", f"train.batch_size={args.batch_size}", "train.grad_accum=1",
            f"train.max_steps={args.steps}", f"optim.warmup_steps={max(1, args.steps // 10)}",
            "train.time_budget_s=0", f"run.device={args.device}", "train.eval_every=0",
            f"train.eval_batches={max(1, args.eval_batches)}"]
    sets += [f"train.fp8_recipe={recipe}"] if recipe else []
    sets += [f"model.block_size={args.block_size}"] if args.block_size else []
    return sets + args.sets


def train_one(args: argparse.Namespace) -> dict:
    """One run in this process: gpudl's job and loop, timed after the warm-up steps."""
    import torch

    from gpudl.config import load_config
    from gpudl.data import DeviceLoader
    from gpudl.device import detect, synchronize
    from gpudl.training.job import model_and_data
    from gpudl.training.loop import NoEvents, TrainState, train_loop
    from gpudl.training.precision import make_precision
    from gpudl.run.recipe import recipe_job
    from gpudl.distributed.session import Session

    cfg = load_config(args.config, settings(args, args.one))
    info = detect(cfg.run.device)
    torch.manual_seed(cfg.run.seed)
    precision = make_precision(cfg.train.precision, info)
    spec, data = model_and_data(cfg)
    job, work = recipe_job(cfg, spec, data, Session(info), precision)
    loader = DeviceLoader(data.train, info.torch_device)
    job.batches = loader
    if not args.eval_batches:
        job.eval_batches = None
    losses, marks, evals = [], {}, []

    class Clock(NoEvents):
        def on_step(self, state, loss, grad_norm, lr):
            losses.append(loss)  # a tensor: read once at the end, no host sync per step
            if state.step in (args.warmup, cfg.train.max_steps):
                synchronize(info.torch_device)
                marks[state.step] = time.perf_counter()

        def on_eval(self, state, metrics):
            evals.append(metrics)
    try:
        train_loop(job, cfg.train, TrainState(), Clock())  # train.eval_every=0: evaluated once, at the end
    finally:
        loader.close()
    val = evals[-1]["loss"] if evals else None
    timed = cfg.train.max_steps - args.warmup
    tokens = timed * cfg.train.batch_size * work.units_per_sample
    return {"run": args.one, "precision": precision.describe(), "model": spec.name, "steps": cfg.train.max_steps,
            "tokens_per_step": cfg.train.batch_size * work.units_per_sample,
            "tokens_per_s": tokens / (marks[cfg.train.max_steps] - marks[args.warmup]),
            "final_loss": float(losses[-1]), "last10_loss": float(torch.stack(losses[-10:]).float().mean()),
            "val_loss": val, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
            if info.type == "cuda" else None}


def spawn(run: str, argv: list[str]) -> dict:
    """`run` in a fresh process; its JSON line, or what went wrong."""
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run([sys.executable, __file__, *argv, "--one", run], stdout=out, text=True)
        out.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"run": run, "error": f"exit status {done.returncode} (its output is above)"}
    return json.loads(lines[-1])


def said(r: dict) -> str:
    if "error" in r:
        return r["error"]
    val = "" if r["val_loss"] is None else f", validation {r['val_loss']:.4f}"
    mem = "" if r["peak_mem_gib"] is None else f" · peak {r['peak_mem_gib']:.1f} GiB"
    return (f"{r['tokens_per_s']:,.0f} tokens/s · loss {r['final_loss']:.4f} (last 10 steps {r['last10_loss']:.4f}"
            f"{val}){mem} · {r['precision']}")


def compare(ref: dict, other: dict) -> dict:
    """`other` against the reference run: speed ratio and relative loss differences."""
    def rel(key):
        a, b = ref.get(key), other.get(key)
        return None if a is None or b is None else (b - a) / a
    return {"run": other["run"], "vs": ref["run"], "speedup": other["tokens_per_s"] / ref["tokens_per_s"],
            "final_loss_diff": rel("final_loss"), "last10_loss_diff": rel("last10_loss"),
            "val_loss_diff": rel("val_loss")}


def describe(c: dict) -> str:
    """One line per comparison; an fp8 run's with the issue's goals (validation loss where measured)."""
    pct = lambda x: "—" if x is None else f"{100 * x:+.2f}%"  # noqa: E731
    judged = c["val_loss_diff"] if c["val_loss_diff"] is not None else c["last10_loss_diff"]
    goal = c["run"].startswith("fp8")
    speed = f" (goal >= 1.2x: {'met' if c['speedup'] >= 1.2 else 'not met'})" if goal else ""
    loss = f" (goal within 1%: {'met' if abs(judged) <= 0.01 else 'not met'})" if goal else ""
    return (f"{c['run']} vs {c['vs']}: {c['speedup']:.2f}x tokens/s{speed}; loss: last step "
            f"{pct(c['final_loss_diff'])}, last 10 steps {pct(c['last10_loss_diff'])}, validation "
            f"{pct(c['val_loss_diff'])}{loss}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.one:
        from gpudl.errors import UserError

        try:
            print(json.dumps(train_one(args)))
        except UserError as e:  # a refusal (no fp8 here, torchao missing): its one line, as gpudl says it
            print(f"{args.one}: {e}", file=sys.stderr)
            return 2
        return 0
    runs, results, t0, longest = args.runs.split(","), [], time.monotonic(), 0.0
    for run in runs:
        left = args.budget_s - (time.monotonic() - t0)
        if args.budget_s and results and left < longest:
            print(f"skipped {run}: {left:.0f} s of the budget left, and a run took {longest:.0f} s", flush=True)
            continue
        began = time.monotonic()
        results.append(spawn(run, argv))  # the child ignores --json and --budget-s
        longest = max(longest, time.monotonic() - began)
        print(f"{run}: {said(results[-1])}", flush=True)
    good = [r for r in results if "error" not in r]
    ref = good[0] if good and good[0]["run"] == runs[0] else None
    comparisons = [compare(ref, r) for r in good[1:]] if ref else []
    for c in comparisons:
        print(describe(c))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "comparisons": comparisons}, indent=1) + "\n")
    return 1 if len(good) < len(results) or not results else 0


if __name__ == "__main__":
    sys.exit(main())
