"""An elastic job (`--nnodes 2:3`) on three hosts: it trains on all three, loses one, and goes on with two
from the newest checkpoint by itself."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from hosts import Hosts, why_not_here
from runs import ENV, PORT, losses, newest_checkpoint, train_alone, train_argv

pytestmark = pytest.mark.skipif(why_not_here() is not None, reason=why_not_here() or "")

STEPS = 60


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, filter(None, lines)) if r["kind"] == "train"]


def wait_until(done, deadline: float) -> float | None:
    """When `done()` first holds, polled every 0.1 s until `deadline` (None: it never did)."""
    while time.monotonic() < deadline:
        try:
            if done():
                return time.monotonic()
        except ValueError:  # a line caught half written
            pass
        time.sleep(0.1)
    return None


def test_an_elastic_job_loses_a_host_and_goes_on_with_the_others(tmp_path):
    """Three hosts join `--nnodes 2:3 --max-restarts 1` and train as one host with three processes does
    (within 1e-6); host2 is killed after the first checkpoint; host0 and host1 restart their workers,
    meet again as two nodes (world 2) and finish the run from the newest checkpoint, losing only the
    steps since it."""
    run_dir = tmp_path / "run"
    launch = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"host0:{PORT}", "--max-restarts", "1"]
    argv = train_argv(run_dir, *launch) + [f"--set=train.max_steps={STEPS}", "--set=parallel.timeout_s=10"]
    with Hosts(3) as hosts:
        logs = [tmp_path / f"{h.name}.log" for h in hosts]
        procs = [h.start(argv, log, ENV) for h, log in zip(hosts, logs)]
        # a step past the first checkpoint, so that the log's steps go back when the new group resumes
        past = wait_until(lambda: newest_checkpoint(run_dir) > 0 and max(train_steps(run_dir)) > newest_checkpoint(run_dir),
                          time.monotonic() + 180)
        assert past is not None, logs[0].read_text()[-3000:]
        killed = time.monotonic()
        hosts[2].kill()
        saved = newest_checkpoint(run_dir)
        # the restarted group's first step: a step line in host0's log after it says it resumed
        resumed = wait_until(lambda: re.search(rf"Resuming at step {saved}.*\n\s*step +{saved + 1} ",
                                                logs[0].read_text(), re.S), time.monotonic() + 120)
        codes = [p.wait(timeout=180) for p in procs[:2]]
    out = " ".join(logs[0].read_text().split())
    assert codes == [0, 0], out[-3000:]
    assert "Launching 1 process(es) per node x 2:3 node(s)" in out
    assert f"Resuming at step {saved}" in out, out[-3000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1)) and resumed is not None
    three = train_alone(tmp_path / "one" / "run", 3, (f"train.max_steps={STEPS}",))
    for step, loss in losses(three).items():
        if step <= saved:  # the steps the three hosts trained (the log is cut back to them on resuming)
            assert abs(losses(run_dir)[step] - loss) <= 1e-6, f"step {step}: {losses(run_dir)[step]} vs {loss}"
    print(f"three hosts, host2 killed after the step-{saved} checkpoint; host0 and host1 trained step {saved + 1} "
          f"{resumed - killed:.1f} s after the kill")

