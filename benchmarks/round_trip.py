"""Does the way out and back in pay? Pretrain here, export to Hugging Face, fine-tune from that folder.

The standard library's source is cut in two by top-level module name (A: the first half of the
bytes in sorted order, B: the rest), so that the text fine-tuned on was never seen in pretraining.

  pretrain     `gpudl train` on A for --pretrain-steps, then `gpudl export RUN --format hf`
  fine-tune    `gpudl train --set model.init_from=HF-FOLDER` on B for --steps
  scratch      the same command on B without model.init_from: random initialisation

The two arms on B differ in model.init_from alone (same recipe, steps, batch, schedule, seed and
tokenizer: bytes, or the one the export carries, which encodes as the run did). Each is scored by
`gpudl evaluate` on B's held-out part, the same text for both. Losses are not timed, so a busy
machine changes only how long this takes; the export's and init_from's seconds are reported too.

    python benchmarks/round_trip.py                      # gpt-tiny: about 5 min on 2 CPU cores
    python benchmarks/round_trip.py --seeds 1,2,3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt-tiny")
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--steps", type=int, default=200, help="fine-tune and scratch steps")
    p.add_argument("--seeds", default="1", help="comma-separated run.seed of the B arms")
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--set", action="append", default=[], dest="sets", help="more --set for every run")
    p.add_argument("--json", default=None, help="write the figures here too")
    return p.parse_args()


def gpudl(*args: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpudl", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"gpudl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, time.perf_counter() - t0


def halves(root: Path) -> tuple[Path, Path]:
    """The standard library's source in two folders, cut between top-level modules at half its bytes."""
    import sysconfig

    from gpudl.data.text.sources import stdlib_sources

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()  # sorted by path, so by top-level name first
    total, seen, boundary = sum(f.stat().st_size for f in files), 0, None
    for f in files:
        if boundary is None and seen >= total / 2:
            boundary = f.relative_to(lib).parts[0]
        seen += f.stat().st_size
    for f in files:
        rel = f.relative_to(lib)
        dest = root / ("A" if rel.parts[0] < boundary else "B") / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    return root / "A", root / "B"


def train(args, data: Path, steps: int, root: Path, name: str, seed: int, *sets: str) -> tuple[Path, float]:
    common = [f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.eval_batches={args.eval_batches}",
              "train.time_budget_s=0", "checkpoint.every=0", "sample.tokens=0", "log.progress=false",
              f"run.dir={root}", f"run.name={name}", f"run.seed={seed}", f"run.device={args.device}",
              f"data.path={data}", *sets, *args.sets]
    _, seconds = gpudl("train", "--config", args.config, *[f"--set={s}" for s in common])
    return root / name, seconds


def score(args, run: Path) -> dict:
    ev = json.loads(gpudl("evaluate", str(run), "--json", f"--batches={args.eval_batches}",
                          f"--device={args.device}")[0])
    return {"val_loss": ev["loss"], "bits_per_byte": ev["bits_per_byte"]}


def main() -> None:
    args = parse()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpudl-round-trip-") as tmp:
        root = Path(tmp)
        a, b = halves(root)
        pre, pre_s = train(args, a, args.pretrain_steps, root, "pretrain", 0)
        hf = root / "hf"
        _, export_s = gpudl("export", str(pre), "--format", "hf", "--out", str(hf))
        print(f"pretrained {args.pretrain_steps} steps on A in {pre_s:.0f} s; exported to Hugging Face in "
              f"{export_s:.1f} s", flush=True)
        for seed in map(int, args.seeds.split(",")):
            for arm, sets in (("fine-tune", [f"model.init_from={hf}"]), ("scratch", [])):
                run, seconds = train(args, b, args.steps, root, f"{arm}-{seed}", seed, *sets)
                rows.append({"arm": arm, "seed": seed, "steps": args.steps, "train_s": seconds, **score(args, run)})
                print(f"{arm:>9} seed {seed}: {args.steps} steps on B, val loss {rows[-1]['val_loss']:.4f} "
                      f"({rows[-1]['bits_per_byte']:.3f} bits per byte), {seconds:.0f} s", flush=True)
    for seed in map(int, args.seeds.split(",")):
        tuned, scratch = (next(r for r in rows if r["arm"] == arm and r["seed"] == seed) for arm in ("fine-tune", "scratch"))
        print(f"seed {seed}: fine-tuned from the export {tuned['val_loss']:.4f} vs from random {scratch['val_loss']:.4f} "
              f"({tuned['val_loss'] / scratch['val_loss'] - 1:+.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps({"export_s": export_s, "pretrain_s": pre_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
