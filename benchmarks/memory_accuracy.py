"""How right is `gpudl plan`? The estimator's peak per rank against a real training step's, case by case.

For each case of a reference suite (GPT and ResNet presets, several micro-batches, activation
checkpointing off and on, fp32 and bf16-mixed, one process and two-rank DDP, FSDP2 and tensor
parallelism, pipelines of two and four ranks under each schedule, alone and beside FSDP,
replication or tensor parallelism, on the CPU): the peak of live tensor bytes per rank that
`gpudl.memory` predicts (fake tensors, nothing allocated; a pipeline's rank with the largest peak),
beside the peak a real second training step reaches on its busiest rank, seen by c10's own
allocation log (`memory_measure.py`: no code shared with the estimator), and the error. The last line: the number of cases, the median and the worst absolute error.

    python benchmarks/memory_accuracy.py                 # the whole suite (about 17 minutes on 2 cores)
    python benchmarks/memory_accuracy.py --quick         # the cases the tests also hold
    python benchmarks/memory_accuracy.py --only pp       # one strategy's cases (repeat for more)
    python benchmarks/memory_accuracy.py --match x4      # the cases whose title has "x4" (repeat for more)
    python benchmarks/memory_accuracy.py --json out.json
    python benchmarks/memory_accuracy.py --markdown      # the table as the README shows it
    python benchmarks/memory_accuracy.py --device cuda   # on the GPU: measured by torch.cuda.max_memory_allocated

On an accelerator the estimate traces the job for that device and the measurement is the
allocator's own peak over the real step (cases needing more processes than devices are skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from memory_measure import STRATEGIES, Case, measure

from gpudl.config import load_config
from gpudl.memory.fake_jobs import estimate

MiB = 2**20
TINY, GPT2, SMALL = (), (("block_size", 256),), (("data.image_size", 32),)
ACCUM4 = (("train.grad_accum", 4),)
# Pipeline schedules (the harness's default: 1f1b, 2 micro-batches)
GPIPE, MICRO4 = (("parallel.pp_schedule", "gpipe"),), (("parallel.pp_microbatches", 4),)
INTERLEAVED = (("parallel.pp_schedule", "interleaved-1f1b"), ("parallel.pp_stages_per_rank", 2), *MICRO4)
PP2 = (("parallel.pp", 2),)  # of a case of 4 processes: the rest is data or tensor parallelism

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
    Case("gpt-tiny", 32, strategy="pp", world=2), Case("gpt-tiny", 32, "bf16-mixed", strategy="pp", world=2,
                                                        overrides=GPIPE),
    Case("gpt-tiny", 32, activation_checkpointing=True, strategy="pp", world=2, overrides=MICRO4),
    Case("gpt-tiny", 32, "bf16-mixed", True, strategy="pp", world=2, overrides=INTERLEAVED),
    Case("gpt-tiny", 32, strategy="pp", world=2, overrides=INTERLEAVED),
    Case("gpt-tiny", 32, strategy="pp", world=4, overrides=MICRO4),
    Case("gpt-tiny", 32, "bf16-mixed", strategy="pp", world=4, overrides=GPIPE + (("parallel.pp_microbatches", 8),)),
    Case("gpt2-124m", 4, strategy="pp", world=2, overrides=GPT2),
    Case("gpt2-124m", 4, "bf16-mixed", strategy="pp", world=2, overrides=GPT2 + GPIPE),
    Case("gpt2-124m", 8, "bf16-mixed", True, strategy="pp", world=2, overrides=GPT2 + MICRO4),
    # accumulation: from the second micro-batch on, each runs beside the gradients of those before it
    Case("gpt-tiny", 8, overrides=ACCUM4), Case("gpt-tiny", 8, strategy="ddp", world=2, overrides=ACCUM4),
    Case("gpt-tiny", 8, strategy="fsdp", world=2, overrides=ACCUM4),
    Case("resnet18", 8, overrides=SMALL + (("train.grad_accum", 2),)),
    # the other layouts gpudl runs: FSDP keeping the weights gathered, sequence parallelism, HSDP, TP x FSDP
    Case("gpt-tiny", 32, strategy="fsdp", world=2, overrides=(("parallel.fsdp_reshard_after_forward", False),)),
    Case("gpt-tiny", 16, strategy="tp", world=2, overrides=(("parallel.tp_sequence_parallel", True),)),
    Case("gpt-tiny", 16, strategy="fsdp", world=4, overrides=(("parallel.dp_replicate", 2), ("parallel.dp_shard", 2))),
    Case("gpt-tiny", 16, strategy="tp", world=4, overrides=(("parallel.dp_shard", 2), ("parallel.tp", 2))),
    # selective checkpointing: matmul, attention and convolution outputs kept, the rest recomputed
    Case("gpt-tiny", 32, activation_checkpointing="selective"),
    Case("gpt-tiny", 32, "bf16-mixed", "selective"),
    Case("resnet18", 16, activation_checkpointing="selective", overrides=SMALL),
    Case("gpt-tiny", 32, activation_checkpointing="selective", strategy="fsdp", world=2),
    # a deep model estimated from traces of 4 and 5 blocks (memory/depth.py), checkpointed and accumulating
    Case("gpt2-124m", 4, "bf16-mixed", True, strategy="fsdp", world=2, overrides=GPT2 + (("train.grad_accum", 2),)),
    # beside a pipeline of two: FSDP (its weights gathered and gradients unsharded to the run's end), replication, TP
    Case("gpt-tiny", 32, strategy="pp", world=4, overrides=PP2 + (("parallel.dp_shard", 2),)),
    Case("gpt-tiny", 32, "bf16-mixed", strategy="pp", world=4, overrides=PP2 + (("parallel.dp_shard", 2),) + MICRO4),
    Case("gpt-tiny", 32, activation_checkpointing=True, strategy="pp", world=4,
         overrides=PP2 + (("parallel.dp_shard", 2), ("parallel.fsdp_reshard_after_forward", False))),
    Case("gpt-tiny", 16, strategy="pp", world=4, overrides=PP2 + (("parallel.dp_shard", 2), ("train.grad_accum", 2))),
    Case("gpt-tiny", 32, strategy="pp", world=4, overrides=PP2 + (("parallel.dp_replicate", 2),)),
    Case("gpt-tiny", 32, strategy="pp", world=4, overrides=PP2 + (("parallel.tp", 2),)),
    Case("gpt-tiny", 32, "bf16-mixed", strategy="pp", world=4, overrides=PP2 + (("parallel.tp", 2),) + GPIPE),
    Case("gpt2-124m", 4, strategy="pp", world=4, overrides=GPT2 + PP2 + (("parallel.dp_shard", 2),)),
    Case("gpt-tiny", 32, strategy="pp", world=4, overrides=PP2 + (("parallel.dp_shard", 2),) + INTERLEAVED),
    Case("gpt-tiny", 32, "bf16-mixed", strategy="pp", world=4,
         overrides=PP2 + (("parallel.dp_shard", 2),) + INTERLEAVED),
    # FSDP's CPU offload (on the CPU one memory: the whole; on an accelerator the host's part is apart)
    Case("gpt-tiny", 32, strategy="fsdp", world=2, overrides=(("parallel.fsdp_cpu_offload", True),)),
    Case("gpt-tiny", 32, strategy="pp", world=4,
         overrides=PP2 + (("parallel.dp_shard", 2), ("parallel.fsdp_cpu_offload", True))),
    # ... asked of one process: FSDP over a group of one, gradients summed in host memory each micro-batch
    Case("gpt-tiny", 32, overrides=(("parallel.fsdp_cpu_offload", True),)),
    Case("gpt2-124m", 4, "bf16-mixed", overrides=GPT2 + (("parallel.fsdp_cpu_offload", True), ("train.grad_accum", 2))),
]
QUICK = [c for c in SUITE if c.model in ("gpt-tiny", "resnet18") and c.batch_size <= 16]


def run_case(case: Case, workdir: Path) -> dict:
    cfg = load_config(None, case.config_sets())
    t0 = time.perf_counter()
    predicted = estimate(cfg, case.world)
    estimate_s = time.perf_counter() - t0
    busiest = max(measure(case, workdir), key=lambda r: r["peak_bytes"])  # ranks differ by padding at most
    measured = busiest["peak_bytes"]
    return {"case": case.title, "strategy": predicted.strategy, "predicted_bytes": predicted.peak,
            "measured_bytes": measured, "error": predicted.peak / measured - 1, "estimate_s": estimate_s,
            # where a gap comes from: the state before the step against the peak's parts
            "predicted_parts": dict(predicted.parts), "measured_baseline_bytes": busiest["baseline_bytes"]}


def readable(case: Case) -> str:
    """The case as the README's table names it: "gpt2-124m b4 fp32 PP 2 x FSDP 2 T=256"."""
    o = dict(case.overrides)
    ac = {True: " +AC", "selective": " +selective AC"}.get(case.activation_checkpointing, "")
    extras = [f"T={o['block_size']}" if "block_size" in o else "",
              f"{o['data.image_size']} px" if "data.image_size" in o else "",
              str(o.get("parallel.pp_schedule", "")),
              f"stages/rank={o['parallel.pp_stages_per_rank']}" if "parallel.pp_stages_per_rank" in o else "",
              f"micro={o['parallel.pp_microbatches']}" if "parallel.pp_microbatches" in o else "",
              f"accum {o['train.grad_accum']}" if "train.grad_accum" in o else "",
              "no resharding after forward" if o.get("parallel.fsdp_reshard_after_forward") is False else "",
              "sequence parallel" if o.get("parallel.tp_sequence_parallel") else "",
              "CPU offload" if o.get("parallel.fsdp_cpu_offload") else ""]
    return " ".join([f"{case.model} b{case.batch_size} {case.precision}{ac} {_layout(case, o)}", *filter(None, extras)])


def _layout(case: Case, o: dict) -> str:
    w = case.world
    if case.strategy == "single":
        return "1 process"
    if case.strategy == "pp" and "parallel.pp" in o:
        beside = next(f"{name} {o[key]}" for key, name in (("parallel.dp_shard", "FSDP"), ("parallel.tp", "TP"),
                                                          ("parallel.dp_replicate", "replicated")) if key in o)
        return f"PP {o['parallel.pp']} x {beside}"
    if case.strategy == "fsdp" and "parallel.dp_replicate" in o:
        return f"HSDP {o['parallel.dp_replicate']} x {o['parallel.dp_shard']}"
    if case.strategy == "tp" and "parallel.dp_shard" in o:
        return f"TP {o['parallel.tp']} x FSDP {o['parallel.dp_shard']}"
    return f"{case.strategy.upper()} x{w}"


def markdown(rows: list[dict]) -> str:
    """The README's table of `rows` (as --json writes them), cases named by `readable`."""
    cases = {c.title: c for c in SUITE}
    lines = ["| case | predicted MiB | measured MiB | error | estimate s |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {readable(cases[r['case']]) if r['case'] in cases else r['case']} | {r['predicted_bytes'] / MiB:.2f} | "
              f"{r['measured_bytes'] / MiB:.2f} | {100 * r['error']:+.2f}% | {r['estimate_s']:.1f} |" for r in rows]
    return "\n".join(lines)


def _fitting(cases: list[Case], device: str) -> list[Case]:
    """The cases with no more processes than the device has units (every case on the CPU)."""
    if device == "cpu":
        return cases
    import torch

    units = torch.get_device_module(device).device_count()
    kept = [c for c in cases if c.world <= units]
    if len(kept) < len(cases):
        print(f"({len(cases) - len(kept)} cases skipped: they need more processes than the {units} {device} devices here)")
    return kept


def main() -> None:
    os.environ["GPUDL_TRACE_CACHE"] = "0"  # every estimate traced now: its time is in the table
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the small cases")
    ap.add_argument("--only", action="append", choices=STRATEGIES, help="only this strategy's cases")
    ap.add_argument("--match", action="append", metavar="TEXT", help="only the cases whose title has TEXT")
    ap.add_argument("--json", type=Path, help="also write every row here")
    ap.add_argument("--device", default="cpu", help="cpu (default), or cuda")
    ap.add_argument("--markdown", action="store_true", help="also print the table as the README shows it")
    args = ap.parse_args()
    rows = []
    cases = [dataclasses.replace(c, device=args.device) for c in (QUICK if args.quick else SUITE)
             if (not args.only or c.strategy in args.only) and (not args.match or any(m in c.title for m in args.match))]
    cases = _fitting(cases, args.device)
    if not cases:
        raise SystemExit("no case to run: widen --only/--match, or use a machine with the devices they need")
    width = max(48, *(len(c.title) for c in cases))
    print(f"{'case':<{width}} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8} {'estimate s':>11}")
    with tempfile.TemporaryDirectory(prefix="gpudl-memory-accuracy-") as tmp:
        for i, case in enumerate(cases):
            row = run_case(case, Path(tmp) / str(i))
            rows.append(row)
            print(f"{row['case']:<{width}} {row['predicted_bytes'] / MiB:>14.2f} {row['measured_bytes'] / MiB:>13.2f} "
                  f"{100 * row['error']:>+7.2f}% {row['estimate_s']:>11.1f}", flush=True)
            if args.json:  # after every case: a run stopped at a time limit keeps the rows it measured
                args.json.write_text(json.dumps(rows, indent=1))
    errors = [abs(r["error"]) for r in rows]
    if args.markdown:
        print(markdown(rows))
    print(f"{len(rows)} cases: median absolute error {100 * statistics.median(errors):.2f}%, "
          f"worst {100 * max(errors):.2f}% (goal: median <= 2%, worst <= 5%)")


if __name__ == "__main__":
    main()
