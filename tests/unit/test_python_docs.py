"""docs/python.md's examples run as they are: each Python block in a fresh namespace of one process
(in a temporary folder, so their run folders land there), the torchrun one under a real torchrun on
two Gloo processes. Each block prints what it shows; the checks below read that output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
RUN_ALL = """
import contextlib, io, json, sys
outs = []
for body in json.load(sys.stdin):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(body, "docs/python.md", "exec"), {"__name__": "__main__"})
    outs.append(out.getvalue())
print(json.dumps(outs))
"""


def test_the_single_process_examples_run_and_show_what_they_say(tmp_path):
    bodies = [b for b in BLOCKS if not b.startswith("# train_ddp.py")]
    assert len(bodies) == 3
    done = subprocess.run([sys.executable, "-c", RUN_ALL], input=json.dumps(bodies), capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    fit_out, hf_out, recipe_out = json.loads(done.stdout.strip().splitlines()[-1])
    steps, accuracy = re.search(r"(\d+) steps, loss [\d.]+, .* val accuracy ([\d.]+)", fit_out).groups()
    assert steps == "80" and float(accuracy) > 0.75  # resumed to 80 steps, and it learned the rule
    assert (tmp_path / "runs" / "python-doc" / "checkpoints").is_dir()
    assert 5.5 < float(re.search(r"loss ([\d.]+)", hf_out).group(1)) < 6.5  # ~ln(512) after 10 steps from random
    assert "runs/python-recipe" in recipe_out and (tmp_path / "runs" / "python-recipe" / "config.toml").is_file()
    assert re.search(r"'parallel\.dp_(replicate|shard)=2'", recipe_out)  # the winner's sets: two processes


@pytest.mark.slow
def test_the_torchrun_example_trains_on_two_processes(tmp_path):
    (script,) = [b for b in BLOCKS if b.startswith("# train_ddp.py")]
    (tmp_path / "train_ddp.py").write_text(script)
    command = re.search(r"```bash\n(torchrun [^#\n]*)", DOC.read_text()).group(1).split()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    finals = re.findall(r"^20 ([\d.]+)$", done.stdout, re.M)
    assert len(finals) == 2 and finals[0] == finals[1]  # both processes end on the same averaged loss
