"""Traces (and FLOP counts) kept between runs, so that the same question asked again (another target GPU, another
memory limit, `gpudl train --plan auto` after `gpudl plan`) costs no trace it has run before.

A trace's answer depends only on the job's config (its model, data, training, optimizer and
parallel sections; not where the run writes, how it logs or how long it trains), the number of
processes, and the
code that traces it: gpudl's own source and torch's version are in the key, so an edit or an
upgrade never reads an old answer. Answers are JSON files under the cache folder
(`cache.cache_dir()/traces`), written atomically and read as data only; an unreadable file is a
miss. `GPUDL_TRACE_CACHE=0` turns it off (the accuracy benchmark does, to time real traces).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..cache import cache_dir
from ..config import Config
from ..config.settings import to_dict

IRRELEVANT = ("run", "checkpoint", "log", "sample")  # config sections a trace does not read
# training settings that shape the run, not a step (a plan asked by `gpudl plan` and by
# `gpudl train --plan auto --memory-limit ...` is the same trace)
RUN_ONLY = ("max_steps", "time_budget_s", "plan", "memory_limit", "eval_every", "eval_batches", "log_every",
            "max_nonfinite", "spike_factor", "spike_window", "on_spike")


def cached(cfg: Config, world: int, trace: Callable[[], dict], what: str = "trace") -> dict:
    """`trace()`'s answer for `cfg` on `world` processes: from the cache, else traced and kept
    (an answer holding an "error" is not kept). `what` names the kind of answer ("trace", "flops")."""
    if os.environ.get("GPUDL_TRACE_CACHE", "1") == "0":
        return trace()
    path = cache_dir() / "traces" / f"{_key(cfg, world, what)}.json"
    try:
        return json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError):
        pass
    answer = trace()
    if "error" not in answer:
        _write(path, answer)
    return answer


def _key(cfg: Config, world: int, what: str = "trace") -> str:
    job = {k: v for k, v in to_dict(cfg).items() if k not in IRRELEVANT}
    job["train"] = {k: v for k, v in job["train"].items() if k not in RUN_ONLY}
    if cfg.parallel.fsdp_cpu_offload:  # where the shards live depends on the device (trace.offloads_to_host)
        from .offload import offloads_to_host

        job["offloaded"] = offloads_to_host(cfg)
    text = json.dumps({"job": job, "world": world, "what": what, "code": _code_version()}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _code_version() -> str:
    """gpudl's source, byte for byte, with torch's and Python's versions."""
    digest = hashlib.sha256(f"{torch.__version__}|{sys.version}".encode())
    package = Path(__file__).resolve().parents[1]
    for file in sorted(package.rglob("*.py")):
        digest.update(str(file.relative_to(package)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _write(path: Path, answer: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trace-")
        with os.fdopen(fd, "w", encoding="utf8") as f:
            json.dump(answer, f)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError:
        pass  # a cache that cannot be written costs time, never the answer
