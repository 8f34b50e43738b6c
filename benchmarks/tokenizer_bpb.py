"""BPE tokens against bytes at equal training FLOPs: validation bits per byte of the same text.

Each arm is a real `gpudl train` of the same model (default gpt2-124m) on the same corpus (default:
the standard-library source), with the same steps, batch, context and schedule, followed by
`gpudl evaluate` on the run's own held-out text. The arms differ only in how text becomes tokens:

  bpe         data.tokenizer=bpe: the recipe's default, a byte-level BPE of model.vocab_size tokens
  bytes       data.tokenizer=bytes with the recipe's vocabulary (50,304 rows, 256 of them used):
              the same model, so the same FLOPs per token and per step
  bytes-256   data.tokenizer=bytes with model.vocab_size=256: a smaller head, so cheaper tokens;
              it trains for more steps, as many as bring its FLOPs to the bpe arm's

Bits per byte (loss / ln 2 / UTF-8 bytes per token of the validation text) is what makes the arms
comparable: a BPE token stands for about four bytes of this corpus, a byte token for one.
The losses are not timed, so a busy machine changes only how long they take. `--only tokenise`
times what the first run of a BPE recipe costs instead, in an empty cache: training the recipe's
BPE on the corpus, then tokenising it (in one process per core).

    python benchmarks/tokenizer_bpb.py                          # about 30 min on 2 CPU cores
    python benchmarks/tokenizer_bpb.py --steps 20 --arms bpe,bytes --json out.json
    python benchmarks/tokenizer_bpb.py --only tokenise          # a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"bpe": ["data.tokenizer=bpe"],
        "bytes": ["data.tokenizer=bytes"],
        "bytes-256": ["data.tokenizer=bytes", "model.vocab_size=256"]}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt2-124m")
    p.add_argument("--only", choices=["bpb", "tokenise"], default="bpb")
    p.add_argument("--data", default=None, help="data.path (default: the standard-library corpus)")
    p.add_argument("--arms", default="bpe,bytes,bytes-256", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, default=100, help="the bpe and bytes arms' optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--set", action="append", default=[], dest="sets", help="more --set for every arm")
    p.add_argument("--json", default=None, help="write the figures here too")
    return p.parse_args()


def gpudl(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gpudl", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"gpudl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def flops_per_step(args, arm: str, root: Path) -> float:
    """Training FLOPs of one step of this arm, as `gpudl train` counts them (from a 1-step run)."""
    run = train(args, arm, 1, root, f"{arm}-probe")
    summary = json.loads((run / "summary.json").read_text())
    return summary["flops_per_sample"] * args.batch_size


def train(args, arm: str, steps: int, root: Path, name: str) -> Path:
    sets = [f"train.max_steps={steps}", f"train.batch_size={args.batch_size}", "train.grad_accum=1",
            f"model.block_size={args.block_size}", f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}",
            f"train.eval_batches={args.eval_batches}", f"train.eval_every={steps}", "train.time_budget_s=0",
            "checkpoint.every=0", "sample.tokens=0", "log.progress=false", f"run.dir={root}", f"run.name={name}",
            f"run.device={args.device}", *ARMS[arm], *([f"data.path={args.data}"] if args.data else []), *args.sets]
    gpudl("train", "--config", args.config, *[f"--set={s}" for s in sets])
    return root / name


def arm_steps(args, arms: list[str], root: Path) -> dict[str, int]:
    """bytes-256 trains until its FLOPs reach the bpe arm's (its steps cost less)."""
    steps = {arm: args.steps for arm in arms}
    if "bytes-256" in arms:
        ratio = flops_per_step(args, "bpe", root) / flops_per_step(args, "bytes-256", root)
        steps["bytes-256"] = round(args.steps * ratio)
    return steps


def tokenise(args) -> list[dict]:
    """Seconds to train the recipe's BPE and to tokenise the corpus with it, from an empty cache."""
    with tempfile.TemporaryDirectory(prefix="gpudl-cache-") as cache:
        os.environ["GPUDL_CACHE_DIR"] = cache
        from gpudl.config import load_config
        from gpudl.data.text.bpe import bpe_tokenizer
        from gpudl.data.text.sources import find_corpus
        from gpudl.data.text.token_file import token_file
        from gpudl.models import from_config

        cfg = load_config(args.config, [f"data.path={args.data}"] if args.data else [])
        vocab = from_config(cfg).config.vocab_size
        t0 = time.perf_counter()
        tok = bpe_tokenizer(find_corpus(cfg.data.path, cfg.data.text_field), vocab, cfg.data.val_fraction)
        t1 = time.perf_counter()
        made = token_file(find_corpus(cfg.data.path, cfg.data.text_field), tok, cfg.data.val_fraction)
        t2 = time.perf_counter()
        again = time.perf_counter()
        token_file(find_corpus(cfg.data.path, cfg.data.text_field), tok, cfg.data.val_fraction, show=False)
        cached = time.perf_counter() - again
    row = {"vocab_size": tok.vocab_size, "train_bpe_s": t1 - t0, "tokenise_s": t2 - t1, "cached_s": cached,
           "tokens": made.tokens, "bytes_per_token": made.bytes_per_token}
    print(f"BPE of {tok.vocab_size:,} tokens trained in {row['train_bpe_s']:.1f} s; {made.tokens:,} tokens "
          f"({made.bytes_per_token:.2f} bytes each) written in {row['tokenise_s']:.1f} s; read from the cache "
          f"in {cached:.2f} s")
    return [row]


def main() -> None:
    args = parse()
    if args.only == "tokenise":
        rows = tokenise(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        sys.exit(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpudl-bpb-") as tmp:
        root = Path(tmp)
        for arm, steps in arm_steps(args, arms, root).items():
            run = train(args, arm, steps, root, arm)
            summary = json.loads((run / "summary.json").read_text())
            ev = json.loads(gpudl("evaluate", str(run), "--json", f"--batches={args.eval_batches}",
                                  f"--device={args.device}"))
            rows.append({"arm": arm, "steps": steps, "tokens_seen": steps * args.batch_size * args.block_size,
                         "train_flops": summary["flops_per_sample"] * args.batch_size * steps,
                         "val_loss": ev["loss"], "bits_per_byte": ev["bits_per_byte"],
                         "bytes_per_token": ev["loss"] / ev["bits_per_byte"] / 0.6931471805599453})
            print(f"{arm:>9}: {steps} steps, {rows[-1]['train_flops'] / 1e15:.2f} PFLOP, val loss "
                  f"{ev['loss']:.3f} per token = {ev['bits_per_byte']:.3f} bits per byte "
                  f"({rows[-1]['bytes_per_token']:.2f} bytes/token)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
