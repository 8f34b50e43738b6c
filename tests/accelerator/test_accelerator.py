"""What only an accelerator can show (each test skipped, with the reason, on a machine without one):
bf16 and fp16 mixed precision (with the loss scaler) training as fp32 does, the loader's pinned,
prefetched copies keeping the default recipe from waiting for data, peak memory as torch's memory
API counts it, and a resumed run bit for bit equal to an uninterrupted one under deterministic
kernels. Every body the CPU also runs (the loop, models, precision, loader, checkpoints, golden
curve, distributed strategies) is parametrised by device in its own file and runs here as well.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from conftest import TINY
from gpudl.config import OptimConfig, TrainConfig
from gpudl.device import detect
from gpudl.training.loop import Job, TrainState, train_loop
from gpudl.training.optim import make_optimizer, make_scheduler
from gpudl.training.precision import make_precision
from gpudl.run.recipe import train

QUIET = Console(quiet=True)
MIXED = ["bf16-mixed", "fp16-mixed"]


def losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"}


def supported(accelerator: str, precision: str):
    """The accelerator's description; the test is skipped where it does not run `precision`'s format."""
    info = detect(accelerator)
    if not getattr(info, precision[:4]):
        pytest.skip(f"{info.label} does not run {precision[:4]}")
    return info


# ---------------------------------------------------------------- mixed precision with the loss scaler


class Steps:
    """The loop's events: every step's loss, kept on the device until the end (no host sync per step)."""

    def __init__(self):
        self.losses = []

    def on_step(self, state, loss, grad_norm, lr):
        self.losses.append(loss)

    def on_eval(self, *args): ...
    def on_oom(self, *args): ...
    def after_step(self, *args): ...

    def should_stop(self, *args):
        return False


def loop_run(accelerator: str, precision: str, steps: int = 80):
    """A small MLP learning a function of its input on the accelerator, in `precision`; (losses, policy)."""
    dev = torch.device(accelerator)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > x[:, 2]).long()  # 3 classes
    batches = [(x[i:i + 64].to(dev), y[i:i + 64].to(dev)) for i in range(0, 256, 64)] * (steps // 4 + 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 3)).to(dev)
    cfg = OptimConfig(lr=1e-2, warmup_steps=5)
    opt = make_optimizer(model, cfg, dev.type)
    policy = make_precision(precision, detect(accelerator))
    job = Job(model=model, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer=opt,
              scheduler=make_scheduler(opt, cfg, steps), precision=policy, batches=iter(batches), device=dev)
    events = Steps()
    state = train_loop(job, TrainConfig(max_steps=steps), TrainState(), events)
    return torch.stack(events.losses).float().cpu().tolist(), policy, state


@pytest.mark.parametrize("precision", MIXED)
def test_mixed_precision_loop_learns_as_fp32_does(accelerator, precision):
    """Finite losses that fall as fp32's do. bf16 keeps 8 bits of mantissa and fp16 11, so a run drifts
    from fp32's by about a percent; within 0.1 (absolute, on losses that start near 1.1) it is the same run.
    fp16 also has a loss scale, which must end finite and positive, the steps it skipped few."""
    supported(accelerator, precision)
    want, _, _ = loop_run(accelerator, "fp32")
    got, policy, state = loop_run(accelerator, precision)
    assert all(math.isfinite(v) for v in got)
    assert sum(got[-8:]) / 8 < 0.6 * sum(got[:8]) / 8  # it learned
    assert got == pytest.approx(want, abs=0.1)
    if precision == "fp16-mixed":
        scale = policy.scaler.get_scale()
        assert math.isfinite(scale) and scale > 0
        assert state.nonfinite_total <= 5  # overflows that backed the scale off, not a run that diverged
    else:
        assert policy.scaler is None and state.nonfinite_total == 0


@pytest.mark.parametrize("precision", MIXED)
def test_mixed_precision_recipe_trains_close_to_fp32(tiny, accelerator, precision):
    """The tiny GPT recipe, 40 steps, in `precision` and in fp32 on the accelerator: the mixed run's losses
    are finite, fall, and stay within 5% of fp32's at every step."""
    supported(accelerator, precision)
    sets = [f"run.device={accelerator}", "train.max_steps=40", "train.log_every=1", "train.eval_every=0",
            "sample.tokens=0", "checkpoint.export=false", "log.plot=false"]
    fp32 = losses(train(tiny(*sets, "run.name=fp32"), console=QUIET))
    mixed = train(tiny(*sets, f"train.precision={precision}", f"run.name={precision}"), console=QUIET)
    got = losses(mixed)
    assert mixed.summary["precision"] == precision and mixed.summary["steps"] == 40
    assert got.keys() == fp32.keys() and all(math.isfinite(v) for v in got.values())
    assert got[40] < 0.8 * got[1]
    for step, loss in fp32.items():
        assert got[step] == pytest.approx(loss, rel=0.05), f"loss at step {step}"


# ---------------------------------------------------------------- the loader keeps the step fed


def test_prefetched_batches_keep_the_default_recipe_from_waiting(tmp_path, accelerator):
    """`gpudl train`'s defaults (the default recipe, its batch, precision and compile left at auto) on the
    accelerator: host batches are pinned and copied on a side stream while the step before runs, so the
    loop waits for data under 2% of the time. The first log window (compilation) is not counted."""
    from gpudl.config import load_config

    cfg = load_config(None, [f"run.device={accelerator}", f"run.dir={tmp_path}", "run.name=default",
                             "train.max_steps=60", "train.time_budget_s=0", "train.log_every=10",
                             "train.eval_every=0", "sample.tokens=0", "log.progress=false", "log.plot=false",
                             "checkpoint.export=false"])
    summary = train(cfg, console=QUIET).summary
    assert summary["steps"] == 60 and not summary["device"].startswith("cpu")
    assert summary["data_wait_frac"] < 0.02, summary


# ---------------------------------------------------------------- peak memory


def test_peak_memory_is_the_allocators_peak(tiny, accelerator):
    """The run reports the peak torch.accelerator's memory API counts for its device: more than the
    weights, their gradients and AdamW's two moments (16 bytes a parameter in fp32), less than the device."""
    info = detect(accelerator)
    result = train(tiny(f"run.device={accelerator}", "run.name=peak", "train.max_steps=8", "train.batch_size=16",
                        "sample.tokens=0", "checkpoint.export=false", "log.plot=false"), console=QUIET)
    reported = result.summary["peak_mem_gb"] * 2**30
    allocator = torch.accelerator.max_memory_allocated(info.index)  # nothing has run on the device since
    assert reported == pytest.approx(allocator, rel=0.01)
    n = sum(p.numel() for p in result.model.parameters())
    assert 16 * n < reported < (info.memory_bytes or math.inf)
    logged = [r["peak_mem_gb"] for r in result.records if r["kind"] == "train"]
    assert logged and all(0 < a <= b for a, b in zip(logged, logged[1:]))  # a peak only grows within a run
    assert logged[-1] <= result.summary["peak_mem_gb"]


# ---------------------------------------------------------------- bit-exact resume


RESUME = textwrap.dedent("""
    import json, shutil, sys
    import torch
    torch.use_deterministic_algorithms(True)  # before anything runs: every kernel from here on is deterministic
    from rich.console import Console
    from gpudl.checkpoint import complete_checkpoints
    from gpudl.config import load_config
    from gpudl.run.recipe import train

    sets, root = json.loads(sys.argv[1]), sys.argv[2]

    def run(name, resume=None):
        cfg = load_config(None, [*sets, f"run.dir={root}", f"run.name={name}"])
        return train(cfg, resume=resume, console=Console(quiet=True))

    def losses(result):
        return {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"}

    full, cut = run("full"), run("cut")
    shutil.rmtree(complete_checkpoints(cut.run_dir / "checkpoints")[-1])  # as if it had died after step 6
    resumed = run("cut", resume=cut.run_dir)
    unequal = [n for (n, a), b in zip(full.model.named_parameters(), resumed.model.parameters())
               if not torch.equal(a, b)]
    print(json.dumps({"full": losses(full), "cut": losses(cut), "resumed": losses(resumed), "unequal": unequal,
                      "device": resumed.summary["device"]}))
""")


def test_resume_is_bit_identical_with_deterministic_kernels(tmp_path, accelerator):
    """12 steps at once, and 6 steps, a checkpoint, and 6 more from it: the same losses and weights to the
    bit, in a process that asked for deterministic kernels before any ran (cuBLAS needs its workspace
    configured for that before it starts: CUBLAS_WORKSPACE_CONFIG). Without them, tests/unit/test_checkpoint.py
    holds an accelerator's resumed run to 1e-4."""
    sets = [*TINY, f"run.device={accelerator}", "train.max_steps=12", "checkpoint.every=6", "train.log_every=1",
            "train.eval_every=0", "model.dropout=0.1", "sample.tokens=0", "checkpoint.export=false", "log.plot=false"]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run([sys.executable, "-c", RESUME, json.dumps(sets), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["device"].startswith("cpu"), out["device"]
    assert out["cut"] == out["full"]  # two runs of the same 12 steps: deterministic kernels indeed
    assert out["resumed"] == {s: v for s, v in out["full"].items() if int(s) > 6}
    assert out["unequal"] == []


def test_fp32_convolutions_are_fp32_not_tf32(accelerator):
    """Under the fp32 policy a convolution agrees with float64 as fp32 does. A 1x1 convolution is a
    matrix product (no Winograd or FFT algorithm, whose fp32 error could blur the line); in TF32,
    inputs keep 10 mantissa bits and its error is 2.9e-4 relative (emulated here), three times the bound."""
    info = detect(accelerator)
    before = torch.backends.cudnn.allow_tf32
    try:
        make_precision("fp32", info)
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 256, 16, 16, generator=gen), torch.randn(256, 256, 1, 1, generator=gen)
        exact = F.conv2d(x.double(), w.double())
        got = F.conv2d(x.to(info.torch_device), w.to(info.torch_device)).cpu().double()
        assert ((got - exact).norm() / exact.norm()).item() < 1e-4
    finally:
        torch.backends.cudnn.allow_tf32 = before
