"""The input pipeline from a folder of JPEGs, measured: can it keep the device busy?

A deterministic folder of JPEGs at ImageNet-like sizes is generated once in the cache (10,000 files
of 500x375 at quality 90 in 100 classes: `tests/jpeg_folder.py`). Then, each part on its own
(`--only`):

  loader  the loader alone (random-resized crop + flip at --size, the batches on --device, nothing
          trained): images/s per decode path (host: Pillow in threads; device: nvJPEG, where it
          runs) and worker count, rounds interleaved, the median
  train   a model (--model, default resnet50) trained from the folder and from generated batches
          already on the device (`gpudl bench`'s real-data and compute cells), rounds interleaved:
          the folder's throughput as a share of the generated batches', and the share of each
          step spent waiting for data
  index   a folder of --index-files empty files indexed in a fresh process: seconds, and the
          memory the index takes (peak RSS over the RSS before it) beside the process's whole peak
  rss     training (resnet18, 32 px, a few steps) from folders of 1,000 and 20,000 small JPEGs, each
          in a fresh process: the peak RSS of both, which must not grow with the folder

    python benchmarks/input_pipeline.py                              # all of it on the CPU
    python benchmarks/input_pipeline.py --device cuda --only loader,train --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# the generated JPEG folder is the tests' own (tests/jpeg_folder.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", default="loader,train,index,rss", help="comma-separated parts")
    p.add_argument("--images", type=int, default=10_000, help="files in the generated folder")
    p.add_argument("--size", type=int, default=224, help="image side fed to the model")
    p.add_argument("--batch-size", type=int, default=64, help="the loader part's batch")
    p.add_argument("--workers", default="", help="worker counts for the loader part (default: 1, 2, 4, ... cores)")
    p.add_argument("--batches", type=int, default=8, help="timed batches per loader measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=6)
    p.add_argument("--precision", default="auto")
    p.add_argument("--index-files", type=int, default=200_000)
    p.add_argument("--set", action="append", default=[], dest="sets", help="more --set for the train part")
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a part run in a fresh process
    return p.parse_args()


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def folder(args) -> Path:
    from jpeg_folder import sample_folder

    t0 = time.perf_counter()
    root = sample_folder(args.images, 100, processes=cores())
    print(f"folder: {root} ({args.images:,} JPEGs, ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    return root


def worker_counts(args) -> list[int]:
    if args.workers:
        return [int(w) for w in args.workers.split(",")]
    counts, n = [], 1
    while n < cores():
        counts.append(n)
        n *= 2
    return counts + [cores()]


def loader_rate(root: Path, args, decode: str, kind: str, workers: int) -> tuple[float, str]:
    """Images/s of the loader alone: batches made, on the device, normalised; nothing trained.
    `kind` "processes" makes the same batches in DataLoader worker processes instead of threads:
    the two side by side measure what the GIL costs the decoding threads."""
    from gpudl.data import DeviceLoader
    from gpudl.data.images.folder import FolderBatches
    from gpudl.data.images.index import index_folder

    device = torch.device(args.device)
    source = FolderBatches(index_folder(root), args.size, args.batch_size, seed=0, decode=decode)
    source.parallel = kind
    loader = DeviceLoader(source, device, num_workers=workers, cores=cores())
    try:
        for _ in range(2):
            next(loader)
        t0 = time.perf_counter()
        for _ in range(args.batches):
            x, _ = next(loader)
        if device.type != "cpu":
            torch.accelerator.synchronize()
        return args.batches * args.batch_size / (time.perf_counter() - t0), loader.description
    finally:
        loader.close()


def part_loader(root: Path, args) -> list[dict]:
    from gpudl.data.images.gpu_decode import nvjpeg

    paths = [("host", "threads"), ("host", "processes")]
    paths += [("device", "threads")] if nvjpeg(torch.device(args.device))[0] is not None else []
    rows = {(*p, w): [] for p in paths for w in worker_counts(args)}
    described = {}
    for _ in range(args.rounds):
        for key in rows:
            rate, described[key] = loader_rate(root, args, *key)
            rows[key].append(rate)
    out = [{"decode": p, "parallel": kind, "workers": w, "images_per_s": statistics.median(r), "rounds": r,
            "loader": described[(p, kind, w)]} for (p, kind, w), r in rows.items()]
    for row in out:
        print(f"loader · decode {row['decode']:<6} · {row['workers']:>2} {row['parallel']:<9} · "
              f"{row['images_per_s']:8,.0f} images/s  ({row['loader']})", flush=True)
    return out


def train_cells(root: Path, args):
    """`gpudl bench`'s two cells for the model: its real-data cell (the folder, through DeviceLoader as
    `gpudl train` feeds it) and its compute cell (generated batches placed on the device once)."""
    from gpudl import models
    from gpudl.bench.cells import Cell
    from gpudl.config import load_config
    from gpudl.device import detect
    from gpudl.training.precision import make_precision

    sets = [f"model.name={args.model}", f"data.path={root}", f"data.image_size={args.size}",
            f"train.batch_size={args.train_batch}", "model.channels_last=true", "model.num_classes=100",
            "train.compile=false", *args.sets]
    cfg = load_config(None, sets)
    spec = models.from_config(cfg)
    info = detect(args.device)
    precision = make_precision(args.precision, info).name
    return [Cell(args.model, spec, cfg, info, precision, False, real_data=real) for real in (True, False)]


def part_train(root: Path, args) -> dict:
    from gpudl.bench.cells import Timing, run_cell

    cells = train_cells(root, args)
    timing = Timing(steps=args.train_steps, warmup=2, max_seconds=60.0, min_steps=args.train_steps)
    runs = {"folder": [], "generated": []}
    for _ in range(args.rounds):  # interleaved: a round's two cells share the machine's load of the moment
        for name, cell in zip(runs, cells):
            rec = run_cell(cell, timing, None)
            if rec["status"] != "ok":
                raise SystemExit(f"train · {cell.title}: {rec['reason']}")
            runs[name].append({"images_per_s": rec["samples_per_s"], "data_wait_frac": rec["data_wait_frac"] or 0.0,
                               "step_s_p50": rec["step_s_p50"], "loader_workers": rec["loader_workers"]})
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("images_per_s", "data_wait_frac")}
           for name, rs in runs.items()}
    ratio = statistics.median(f["images_per_s"] / g["images_per_s"] for f, g in zip(runs["folder"], runs["generated"]))
    out = {"model": args.model, "batch_size": args.train_batch, "size": args.size, "precision": cells[0].precision,
           **med, "ratio": ratio, "rounds": runs}
    print(f"train · {args.model} · {cells[0].precision} · batch {args.train_batch} · {args.size} px: folder "
          f"{med['folder']['images_per_s']:,.1f} images/s (waits {100 * med['folder']['data_wait_frac']:.2f}% of each "
          f"step, {runs['folder'][0]['loader_workers']} loader workers), generated batches on the device "
          f"{med['generated']['images_per_s']:,.1f}: ratio {ratio:.3f}", flush=True)
    return out


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child_index(path: str) -> dict:
    from gpudl.data.images.index import index_folder

    before = rss_mb()
    t0 = time.perf_counter()
    idx = index_folder(Path(path))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"files": len(idx), "seconds": seconds, "rss_before_mb": before, "peak_rss_mb": peak,
            "index_mb": peak - before, "index_arrays_mb": (idx.packed.nbytes + idx.ends.nbytes + idx.labels.nbytes) / 2**20}


def in_child(args, what: str, arg: str) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{what}:{arg}", "--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def part_index(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        per_class = args.index_files // 1000
        for c in range(1000):
            d = Path(tmp) / f"n{c:08d}"
            d.mkdir()
            for i in range(per_class):
                os.close(os.open(d / f"n{c:08d}_{i:06d}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))
        out = in_child(args, "index", tmp)
    print(f"index · {out['files']:,} files in {out['seconds']:.2f} s · the index took {out['index_mb']:.1f} MB "
          f"(its arrays {out['index_arrays_mb']:.1f} MB; process peak {out['peak_rss_mb']:.0f} MB, "
          f"{out['rss_before_mb']:.0f} MB before)", flush=True)
    return out


def child_train_rss(path: str) -> dict:
    from rich.console import Console

    from gpudl.config import load_config
    from gpudl.run.recipe import train

    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"data.path={path}", "model.name=resnet18", "data.image_size=32", "train.batch_size=16",
                "train.max_steps=6", "train.eval_every=0", "train.eval_batches=2", "train.time_budget_s=0",
                "log.progress=false", "log.plot=false", "checkpoint.every=0", "checkpoint.export=false",
                "run.device=cpu", f"run.dir={tmp}", "model.num_classes=100"]
        train(load_config(None, sets), console=Console(quiet=True))
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def part_rss(args) -> dict:
    from jpeg_folder import sample_folder

    out = {}
    for n in (1_000, 20_000):
        root = sample_folder(n, 100, width=64, height=48, processes=cores())
        out[n] = in_child(args, "train", str(root))["peak_rss_mb"]
    growth = out[20_000] / out[1_000] - 1
    print(f"rss · training from 1,000 images: {out[1_000]:.0f} MB peak; from 20,000: {out[20_000]:.0f} MB "
          f"({100 * growth:+.1f}%)", flush=True)
    return {"peak_rss_mb": out, "growth": growth}


def main() -> None:
    args = parse()
    if args.child:
        what, arg = args.child.split(":", 1)
        print(json.dumps(child_index(arg) if what == "index" else child_train_rss(arg)))
        return
    from gpudl.device.discovery import cpu_info

    parts = set(args.only.split(","))
    cpu = cpu_info()
    doc = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "cpu": f"{cpu.name} ({cpu.capability})",
           "cores": cores(), "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    if args.device != "cpu":
        doc["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else args.device
    print(f"{doc['date']} · {doc['cpu']} · {doc['cores']} cores · {doc.get('gpu', 'no GPU')}", flush=True)
    root = folder(args) if parts & {"loader", "train"} else None
    if "loader" in parts:
        doc["loader"] = part_loader(root, args)
    if "train" in parts:
        doc["train"] = part_train(root, args)
    if "index" in parts:
        doc["index"] = part_index(args)
    if "rss" in parts:
        doc["rss"] = part_rss(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
