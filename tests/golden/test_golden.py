"""The first 20 losses of the default recipe at its fixed seed must not move.

A refactor that changes initialisation, data order, the schedule or the loop's arithmetic
shows here. Pinned to fp32 (`auto` would pick bf16 on some CPUs and not others). The
tolerance covers float summation order across thread counts and CPU instruction sets
(about 5e-7 measured between 1 and 2 threads); real changes move the losses by 1e-2 or more.
The curve belongs to one corpus: on a Python whose standard library differs, the test skips.

On an accelerator the same recipe (eager, true fp32: gpudl never turns TF32 on) runs other
kernels, with other summation orders, whose differences Adam carries forward from step to step;
there the curve must stay within 5e-3 of the CPU's, still below what a real change moves it.

Regenerate (only for an intended change, and say why in the commit):
    python tests/golden/test_golden.py
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from gpudl.config import load_config
from gpudl.data.text.streams import TokenStream, byte_corpus
from gpudl.run.recipe import train

STORED = Path(__file__).with_name("gpt_tiny_fp32.json")
SETS = ["train.max_steps=20", "train.precision=fp32", "train.log_every=1", "train.eval_every=0", "sample.tokens=0",
        "checkpoint.export=false", "log.plot=false", "log.progress=false"]


# The golden curve is the CPU's; on an accelerator, within this of it (see above).
ACCELERATOR_TOLERANCE = 5e-3


def run_losses(run_dir: Path, device: str = "cpu") -> list[float]:
    # Eager everywhere: compile's "auto" turns it on for GPUs, and the curve is of the eager step.
    cfg = load_config(None, [*SETS, f"run.dir={run_dir}", f"run.device={device}", "train.compile=false"])
    result = train(cfg, console=Console(quiet=True))
    return [r["loss"] for r in result.records if r["kind"] == "train"]


def corpus_sha() -> str:
    return TokenStream(byte_corpus(None)).fingerprint()


def test_default_recipe_reproduces_its_golden_losses(tmp_path, device):
    golden = json.loads(STORED.read_text())
    if corpus_sha() != golden["corpus_sha256"]:
        pytest.skip(f"golden curve was recorded on Python {golden['python']}'s standard library; "
                    f"this Python's corpus differs")
    losses = run_losses(tmp_path, device)
    assert len(losses) == 20
    assert losses == pytest.approx(golden["losses"], abs=1e-4 if device == "cpu" else ACCELERATOR_TOLERANCE)


if __name__ == "__main__":
    import tempfile

    data = {"python": platform.python_version(), "torch": torch.__version__, "corpus_sha256": corpus_sha(),
            "losses": run_losses(Path(tempfile.mkdtemp()))}
    STORED.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {STORED}", file=sys.stderr)
