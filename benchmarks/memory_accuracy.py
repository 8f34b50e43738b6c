"""How right is `gpudl plan`? The estimator's peak per rank against a real training step's, case by case.

For each case of a reference suite (GPT and ResNet presets, several micro-batches, activation
checkpointing off and on, fp32 and bf16-mixed, one process and two-rank DDP, FSDP2 and tensor
parallelism on the CPU): the peak of live tensor bytes per rank that `gpudl.memory` predicts
(fake tensors, nothing allocated), beside the peak a real second training step reaches, seen
by c10's own allocation log (`memory_measure.py`: no code shared with the estimator), and the
error. The last line: the number of cases, the median and the worst absolute error.

    python benchmarks/memory_accuracy.py                 # the whole suite (about 10 minutes on 2 cores)
    python benchmarks/memory_accuracy.py --quick         # the cases the tests also hold
    python benchmarks/memory_accuracy.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from memory_measure import Case, measure

from gpudl.config import load_config
from gpudl.memory.estimate import estimate

MiB = 2**20
TINY, GPT2, SMALL = (), (("block_size", 256),), (("data.image_size", 32),)

SUITE = [
    Case("gpt-tiny", 8), Case("gpt-tiny", 32), Case("gpt-tiny", 32, "bf16-mixed"),
    Case("gpt-tiny", 32, activation_checkpointing=True), Case("gpt-tiny", 32, "bf16-mixed", True),
    Case("gpt-tiny", 16, strategy="ddp", world=2), Case("gpt-tiny", 16, "bf16-mixed", strategy="ddp", world=2),
    Case("gpt-tiny", 32, strategy="fsdp", world=2), Case("gpt-tiny", 32, activation_checkpointing=True,
                                                          strategy="fsdp", world=2),
    Case("gpt-tiny", 32, strategy="tp", world=2), Case("gpt-tiny", 16, "bf16-mixed", strategy="tp", world=2),
    Case("gpt2-124m", 2, overrides=GPT2), Case("gpt2-124m", 4, activation_checkpointing=True, overrides=GPT2),
    Case("gpt2-124m", 2, "bf16-mixed", overrides=GPT2),
    Case("gpt2-124m", 2, strategy="ddp", world=2, overrides=GPT2),
    Case("gpt2-124m", 2, strategy="fsdp", world=2, overrides=GPT2),
    Case("gpt2-124m", 2, strategy="tp", world=2, overrides=GPT2),
    Case("resnet18", 8, overrides=SMALL), Case("resnet18", 32, overrides=SMALL),
    Case("resnet18", 32, "bf16-mixed", overrides=SMALL), Case("resnet18", 16, activation_checkpointing=True,
                                                                overrides=SMALL),
    Case("resnet18", 8, strategy="ddp", world=2, overrides=SMALL),
    Case("resnet18", 8, strategy="fsdp", world=2, overrides=SMALL),
    Case("resnet50", 8, overrides=SMALL), Case("resnet50", 8, "bf16-mixed", overrides=SMALL),
    Case("resnet50", 16, activation_checkpointing=True, overrides=SMALL),
    Case("resnet50", 8, "bf16-mixed", strategy="ddp", world=2, overrides=SMALL),
]
QUICK = [c for c in SUITE if c.model in ("gpt-tiny", "resnet18") and c.batch_size <= 16]


def run_case(case: Case, workdir: Path) -> dict:
    cfg = load_config(None, case.config_sets())
    t0 = time.perf_counter()
    predicted = estimate(cfg, case.world)
    estimate_s = time.perf_counter() - t0
    measured = max(r["peak_bytes"] for r in measure(case, workdir))  # ranks differ by padding at most
    return {"case": case.title, "strategy": predicted.strategy, "predicted_bytes": predicted.peak,
            "measured_bytes": measured, "error": predicted.peak / measured - 1, "estimate_s": estimate_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the small cases")
    ap.add_argument("--json", type=Path, help="also write every row here")
    args = ap.parse_args()
    rows = []
    print(f"{'case':<48} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8} {'estimate s':>11}")
    with tempfile.TemporaryDirectory(prefix="gpudl-memory-accuracy-") as tmp:
        for i, case in enumerate(QUICK if args.quick else SUITE):
            row = run_case(case, Path(tmp) / str(i))
            rows.append(row)
            print(f"{row['case']:<48} {row['predicted_bytes'] / MiB:>14.2f} {row['measured_bytes'] / MiB:>13.2f} "
                  f"{100 * row['error']:>+7.2f}% {row['estimate_s']:>11.1f}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} cases: median absolute error {100 * statistics.median(errors):.2f}%, "
          f"worst {100 * max(errors):.2f}% (goal: median <= 2%, worst <= 5%)")


if __name__ == "__main__":
    main()
