"""precision and compile "auto" decided by timing the job's own step (run/autotune.py).

The decision rules are pure functions over measured step times and are checked on made-up figures;
the probe itself runs for real on the CPU through `train(..., probe_on_cpu=True)`, the internal
switch no config key reaches (the CPU is otherwise never probed). What only a GPU can show (CUDA
graphs, the compile candidates) is in the accelerator tests at the end, skipped here with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import gpudl.run.autotune as autotune
import gpudl.training.job as job_module
import gpudl.run.recipe as recipe
import gpudl.run.stages as stages
from conftest import TINY, run_cli
from gpudl.config import Config, ParallelConfig, TrainConfig
from gpudl.device import cpu_info
from gpudl.distributed.parallelize import check_compile
from gpudl.distributed.parts import Parallelized
from gpudl.errors import UserError
from gpudl.run.autotune import CUDA_GRAPHS, Probe, choose_compile, choose_precision, compile_skip, fastest
from gpudl.training.job import Task, build_job
from gpudl.training.loop import NoEvents, TrainState, train_loop
from gpudl.training.precision import make_precision
from gpudl.distributed.session import Session

ORDER = ["eager", "compiled", CUDA_GRAPHS]


# --- the decision: a pure function of the measured times ------------------------------------------------

def test_the_fastest_candidate_wins():
    assert fastest({"eager": 7.4e-3, "compiled": 4.0e-3, CUDA_GRAPHS: 1.5e-3}, ORDER) == CUDA_GRAPHS
    assert fastest({"eager": 1.0, "compiled": 0.5, CUDA_GRAPHS: 0.9}, ORDER) == "compiled"
    assert fastest({"fp32": 5.0e-3, "bf16-mixed": 1.0e-3}, ["fp32", "bf16-mixed"]) == "bf16-mixed"
    assert fastest({"fp32": 1.42e-3, "bf16-mixed": 2.01e-3}, ["fp32", "bf16-mixed"]) == "fp32"


def test_a_tie_within_noise_keeps_the_simpler_candidate():
    assert fastest({"eager": 1.0, "compiled": 0.97}, ORDER) == "eager"            # 3% faster: noise
    assert fastest({"fp32": 1.0, "bf16-mixed": 0.96}, ["fp32", "bf16-mixed"]) == "fp32"
    assert fastest({"fp32": 1.0, "bf16-mixed": 0.94}, ["fp32", "bf16-mixed"]) == "bf16-mixed"
    # CUDA graphs must beat the compiled step taken, not only eager
    assert fastest({"eager": 1.0, "compiled": 0.8, CUDA_GRAPHS: 0.78}, ORDER) == "compiled"


def test_a_failed_or_untried_candidate_never_wins():
    times = {"eager": 1.0, "compiled": "failed (OutOfMemoryError: ...)", CUDA_GRAPHS: "not tried: ..."}
    assert fastest(times, ORDER) == "eager"
    assert fastest({"eager": "failed (x)"}, ORDER) is None


class FakeClock:
    """A clock the fake measurements advance: probing costs what the test says, in no real time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_probe(figures: dict[str, tuple[float, float]], clock: FakeClock | None = None, **kw) -> tuple[Probe, list]:
    """A probe whose candidates take `figures[label] = (seconds a step, seconds spent measuring)`."""
    clock, calls = clock or FakeClock(), []

    def measure(precision: str, mode: str) -> tuple[float, float]:
        label = f"{precision}|{mode}"
        calls.append(label)
        step_s, cost = figures[label]
        clock.now += cost
        if step_s is None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step_s, cost
    return Probe(measure, clock=clock, **kw), calls


def test_the_start_block_says_what_was_measured():
    probe, _ = fake_probe({"fp32|eager": (1.42e-3, 1), "bf16-mixed|eager": (2.01e-3, 1),
                           "fp32|compiled": (0.95e-3, 20), f"fp32|{CUDA_GRAPHS}": (0.61e-3, 20)})
    assert choose_precision(probe, ["fp32", "bf16-mixed"]) == \
        ("fp32", "auto: 1.42 ms a step against bf16-mixed's 2.01 ms, measured")
    mode, why = choose_compile(probe, "fp32", ORDER, lambda step_s: 100_000)
    assert mode == CUDA_GRAPHS
    assert why == "auto: 0.61 ms a step against 1.42 ms eager, 0.95 ms compiled; CUDA graphs, measured"


def test_a_failed_candidate_is_named_with_its_reason():
    probe, _ = fake_probe({"fp32|eager": (5e-3, 1), "bf16-mixed|eager": (None, 1)})
    name, why = choose_precision(probe, ["fp32", "bf16-mixed"])
    assert name == "fp32" and "bf16-mixed failed (OutOfMemoryError: CUDA out of memory" in why


# --- when compiling is tried, and for how long ----------------------------------------------------------

def test_a_run_too_short_to_win_back_a_compile_is_not_probed():
    # the default recipe on an H200: 600 steps of about 6 ms, 3.6 s in all, against two compiles
    assert "600 steps of 6.00 ms eager (about 4 s)" in compile_skip(600, 6e-3, 2)
    assert compile_skip(20_000, 6e-3, 2) is None
    probe, calls = fake_probe({"fp32|eager": (6e-3, 1), "fp32|compiled": (3e-3, 20)})
    mode, why = choose_compile(probe, "fp32", ["eager", "compiled"], lambda step_s: 600)
    assert (mode, calls) == ("eager", ["fp32|eager"]) and "is shorter than compiling would take" in why
    mode, _ = choose_compile(probe, "fp32", ["eager", "compiled"], lambda step_s: 20_000)
    assert (mode, calls) == ("compiled", ["fp32|eager", "fp32|compiled"])


def test_no_candidate_starts_past_the_cap_and_the_best_so_far_wins():
    clock = FakeClock()
    probe, calls = fake_probe({"fp32|eager": (6e-3, 5), "bf16-mixed|eager": (7e-3, 5), "fp32|compiled": (3e-3, 45),
                               f"fp32|{CUDA_GRAPHS}": (1e-3, 45)}, clock, cap_s=60)
    assert choose_precision(probe, ["fp32", "bf16-mixed"])[0] == "fp32"
    mode, why = choose_compile(probe, "fp32", ORDER, lambda step_s: 100_000)
    # 55 s spent after compiling once; the next compile is expected to take as long: not started
    assert calls == ["fp32|eager", "bf16-mixed|eager", "fp32|compiled"] and clock.now == 55
    assert mode == "compiled" and f"{CUDA_GRAPHS} not tried: the probe's 60 s were spent" in why


def test_before_any_compile_is_timed_its_cost_is_a_guess():
    probe, calls = fake_probe({"fp32|eager": (6e-3, 50), "fp32|compiled": (3e-3, 20)}, cap_s=60)
    mode, why = choose_compile(probe, "fp32", ["eager", "compiled"], lambda step_s: 100_000)
    assert calls == ["fp32|eager"]  # 50 s + the 15 s guess would pass the cap
    assert mode == "eager" and "compiled not tried" in why


def test_the_first_candidate_always_runs():
    probe, calls = fake_probe({"fp32|eager": (6e-3, 1)}, cap_s=0)
    assert probe.time("fp32", "eager") == 6e-3 and calls == ["fp32|eager"]


# --- the cache: a job measured once -------------------------------------------------------------------------

def linear_job(trial: Config, precision, calls: list, rows: int = 16) -> object:
    calls.append((trial.train.precision, trial.train.compile))
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4)
    x, y = torch.randn(rows, 8), torch.randint(0, 4, (rows,))
    task = Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), batches=itertools.repeat((x, y)))
    return build_job(model, trial, Session(cpu_info()), precision, task)


def prepare_linear(calls: list, rows: int = 16):
    def prepare():
        identity = autotune.job_identity({"name": "linear"}, [torch.zeros(rows, 8)], Config(), Session(cpu_info()))
        return (lambda trial, p: linear_job(trial, p, calls, rows)), identity
    return prepare


def test_a_second_run_of_the_same_job_does_not_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    session, calls = Session(dataclasses.replace(cpu_info(), bf16=True)), []
    cfg = Config(train=TrainConfig(max_steps=50, compile=False))
    first = autotune.tune(cfg, session, make_precision("fp32", session.device), prepare_linear(calls), on_cpu=True)
    assert sorted(calls) == [("bf16-mixed", False), ("fp32", False)]
    again = autotune.tune(cfg, session, make_precision("fp32", session.device), prepare_linear(calls), on_cpu=True)
    assert len(calls) == 2, "the second run probed again"
    assert again.cfg.train.precision == first.cfg.train.precision
    assert again.precision.reason.endswith("measured by an earlier run of this job, cached")
    (entry,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert set(entry) == {"fp32|eager", "bf16-mixed|eager"} and all(isinstance(t, float) for t in entry.values())
    autotune.tune(cfg, session, make_precision("fp32", session.device), prepare_linear(calls, rows=32), on_cpu=True)
    assert len(calls) == 4, "another batch shape is another job: it is probed"


def test_a_candidate_that_fails_to_build_is_excluded_and_remembered(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    session, calls = Session(dataclasses.replace(cpu_info(), bf16=True)), []

    def prepare():
        def make_job(trial, precision):
            if trial.train.precision == "bf16-mixed":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore")
            return linear_job(trial, precision, calls)
        return make_job, {"model": "failing"}
    cfg = Config(train=TrainConfig(compile=False))
    tuned = autotune.tune(cfg, session, make_precision("fp32", session.device), prepare, on_cpu=True)
    assert tuned.cfg.train.precision == "fp32"
    assert "bf16-mixed failed (OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB)" in \
        tuned.precision.reason
    (entry,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert entry["bf16-mixed|eager"].startswith("failed (OutOfMemoryError")


def test_explicit_settings_and_the_cpu_are_not_probed(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    session, prepared = Session(cpu_info()), []
    prepare = lambda: prepared.append(1)  # noqa: E731 -- would fail if called
    auto = Config(train=TrainConfig(precision="auto", compile="auto"))
    prec = make_precision("auto", session.device)
    kept = autotune.tune(auto, session, prec, prepare)  # the CPU: today's rule
    assert kept.cfg is auto and kept.precision is prec and not kept.probed
    assert kept.compile_note.startswith("eager (auto: off on the CPU")
    explicit = Config(train=TrainConfig(precision="fp32", compile=True))
    assert autotune.tune(explicit, session, prec, prepare, on_cpu=True).compile_note == "compiled (asked for)"
    assert prepared == []


# --- reduce-overhead: refused where CUDA graphs cannot work ---------------------------------------------

@pytest.mark.parametrize("device, world, parallel, checkpointing, says", [
    ("cpu", 1, ParallelConfig(), False, "needs a CUDA GPU, and this job runs on the cpu"),
    ("xpu", 1, ParallelConfig(), False, "needs a CUDA GPU, and this job runs on the xpu"),
    ("cuda", 2, ParallelConfig(), False, "runs in one process only, without DDP, FSDP, tensor or pipeline"),
    ("cuda", 1, ParallelConfig(fsdp_cpu_offload=True), False, "runs in one process only"),
    ("cuda", 1, ParallelConfig(), "selective", "cannot be combined with activation checkpointing"),
])
def test_reduce_overhead_is_refused_in_one_line(device, world, parallel, checkpointing, says):
    with pytest.raises(UserError, match=says) as e:
        check_compile(CUDA_GRAPHS, device, world, parallel, checkpointing)
    assert "\n" not in str(e.value) and "set --set train.compile=true" in str(e.value)
    check_compile(True, device, world, parallel, checkpointing)  # inductor alone is never refused here


def test_reduce_overhead_on_one_cuda_process_passes():
    check_compile(CUDA_GRAPHS, "cuda", 1, ParallelConfig(), False)


def test_reduce_overhead_on_the_cpu_through_the_cli(tmp_path):
    sets = [a for s in [*TINY, f"run.dir={tmp_path}", "train.compile=reduce-overhead"] for a in ("--set", s)]
    done = run_cli("train", *sets)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["gpudl train: error: train.compile='reduce-overhead' (CUDA graphs) needs a CUDA GPU, and this "
                     "job runs on the cpu: set --set train.compile=true (gpudl.fit: compile=True)"]
    assert not any(tmp_path.iterdir()), "refused before anything was written"


# --- the step CUDA graphs get: safe for accumulation, checked on the CPU -------------------------------------

def test_the_graph_safe_step_trains_as_the_plain_one(monkeypatch):
    """What build_job does for CUDA graphs (stable gradient buffers zeroed between steps, the loss copied
    out) must not change what a step computes: 4 steps of 3 accumulated micro-batches, both ways."""
    def run(graphs: bool) -> tuple[list[float], dict]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        data = [(torch.randn(12, 8), torch.randint(0, 4, (12,))) for _ in range(4)]
        real = job_module.parallelize
        monkeypatch.setattr(job_module, "parallelize",
                            lambda *a, **k: dataclasses.replace(real(*a, **k), cuda_graphs=graphs))
        cfg = Config(train=TrainConfig(max_steps=4, batch_size=4, grad_accum=3, compile=False))
        job = build_job(model, cfg, Session(cpu_info()), make_precision("fp32", cpu_info()),
                        Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), batches=iter(data), micro_batch=4))
        assert job.grads_to_none is not graphs
        assert all((p.grad is not None) == graphs for p in model.parameters())
        losses = []

        class Losses(NoEvents):
            def on_step(self, state, loss, grad_norm, lr):
                losses.append(loss)
        train_loop(job, cfg.train, TrainState(), Losses())
        return [float(x) for x in losses], {k: v.clone() for k, v in model.state_dict().items()}
    plain, graph_safe = run(False), run(True)
    assert plain[0] == graph_safe[0]
    assert all(torch.equal(plain[1][k], graph_safe[1][k]) for k in plain[1])


# --- the probe for real, on the CPU through the internal switch -----------------------------------------

def _train_recording(tiny, monkeypatch, *sets, probe: bool):
    """A tiny run; (its first job's initial weights, its training losses, its records, the start block)."""
    initial = []
    real = recipe.recipe_job

    def recorded(*args, **kwargs):
        job, work = real(*args, **kwargs)
        initial.append({k: v.detach().clone() for k, v in job.model.state_dict().items()})
        return job, work
    monkeypatch.setattr(recipe, "recipe_job", recorded)
    console = Console(record=True, width=300)
    result = recipe.train(tiny("train.eval_every=0", "sample.tokens=0", *sets), console=console, probe_on_cpu=probe)
    losses = [r["loss"] for r in result.records if r.get("kind") == "train"]
    assert len(initial) == 1, "the probe's jobs are not the run's"
    return initial[0], losses, result, console.export_text()


def test_the_probe_times_both_precisions_and_leaves_the_run_as_asked(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path / "cache"))
    cpu = dataclasses.replace(cpu_info(), bf16=True)  # bf16 autocast runs on any CPU, if slowly
    monkeypatch.setattr(stages, "start_session", lambda *a, **k: Session(cpu))
    probed_w, probed_losses, probed, said = _train_recording(tiny, monkeypatch, "train.precision=auto", probe=True)
    (times,) = json.loads((tmp_path / "cache" / "autotune.json").read_text()).values()
    assert set(times) == {"fp32|eager", "bf16-mixed|eager"} and all(t > 0 for t in times.values())
    chosen = fastest({k.split("|")[0]: v for k, v in times.items()}, ["fp32", "bf16-mixed"])
    assert probed.summary["precision"] == chosen
    assert f"Precision: {chosen} (auto: " in said and ", measured)" in said
    told_w, told_losses, _, _ = _train_recording(tiny, monkeypatch, f"train.precision={chosen}", probe=False)
    assert probed_w.keys() == told_w.keys() and all(torch.equal(probed_w[k], told_w[k]) for k in told_w)
    assert probed_losses == told_losses and len(told_losses) == 3  # logged every 2 of 6 steps


@pytest.mark.slow
def test_a_cnn_is_probed_like_any_model_and_stays_channels_last(monkeypatch, tmp_path):
    """Nothing keeps a ResNet out of the probe (on a GPU its compile candidates too), and its layout stays
    channels-last in the probe's jobs and in the run's."""
    from gpudl.config import load_config

    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path / "cache"))
    layouts = []
    real = autotune.time_steps

    def noted(job, *args, **kwargs):
        layouts.append(job.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last))
        return real(job, *args, **kwargs)
    monkeypatch.setattr(autotune, "time_steps", noted)
    cfg = load_config("resnet18", [
        "model.width=8", "train.batch_size=4", "train.max_steps=2", "train.eval_every=0", "train.time_budget_s=0",
        "train.precision=auto", "train.compile=auto", "run.device=cpu", "log.progress=false",
        "checkpoint.every=0", f"run.dir={tmp_path / 'runs'}"])
    console = Console(record=True, width=300)
    result = recipe.train(cfg, console=console, probe_on_cpu=True)
    said = console.export_text()
    assert "Precision: " in said and "(auto: " in said.split("Precision: ")[1].splitlines()[0]
    assert layouts and all(layouts), "a probe job lost channels-last"
    assert result.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_fit_probes_a_copy_of_the_module(monkeypatch, tmp_path):
    """gpudl.fit on a GPU probes copies of the user's module: made to probe here, it trains the module as
    a fit told the chosen precision does, from the same weights."""
    import gpudl

    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "PROBED_TYPES", ("cpu",))
    x, y = torch.randn(256, 8, generator=torch.Generator().manual_seed(0)), torch.arange(256) % 3

    def fitted(precision: str):
        torch.manual_seed(0)
        # dropout: the probe's steps draw from the RNG too, which must be as it was when the run starts
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                  torch.nn.Linear(32, 3))
        result = gpudl.fit(net, (x, y), loss=F.cross_entropy, max_steps=4, batch_size=32, log_every=1,
                           device="cpu", precision=precision, compile=False, progress=False, quiet=True)
        return result, [r["loss"] for r in result.records if r.get("kind") == "train"]
    probed, probed_losses = fitted("auto")
    (times,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert len(times) == len(autotune.precision_candidates(Session(cpu_info())))
    monkeypatch.setattr(autotune, "PROBED_TYPES", ())
    told, told_losses = fitted(probed.summary["precision"])
    assert probed_losses == told_losses


# --- on a GPU --------------------------------------------------------------------------------------------

@pytest.fixture
def cuda(accelerator) -> str:
    if accelerator != "cuda":
        pytest.skip(f"CUDA graphs need CUDA; this machine's accelerator is {accelerator}")
    return accelerator


def test_reduce_overhead_trains_as_eager_with_accumulation(tiny, cuda):
    """CUDA graphs with 2 micro-batches a step, clipping, the device's finiteness guard and the schedule:
    the same losses as eager fp32, up to the kernels' rounding."""
    sets = ("run.device=cuda", "train.grad_accum=2", "train.max_steps=8", "train.eval_every=0", "sample.tokens=0")
    eager = recipe.train(tiny(*sets), console=Console(quiet=True))
    graphs = recipe.train(tiny(*sets, "train.compile=reduce-overhead"), console=Console(quiet=True))
    a = [r["loss"] for r in eager.records if r.get("kind") == "train"]
    b = [r["loss"] for r in graphs.records if r.get("kind") == "train"]
    assert len(a) == len(b) == 4 and a == pytest.approx(b, rel=2e-3)


def test_the_probe_decides_on_the_gpu(tiny, cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    console = Console(record=True, width=300)
    recipe.train(tiny("run.device=cuda", "train.precision=auto", "train.compile=auto", "train.max_steps=40",
                      "train.eval_every=0", "sample.tokens=0"), console=console)
    said = console.export_text()
    assert "(auto: " in said.split("Precision: ")[1].splitlines()[0]
    assert "Compile: eager (auto: the run, 40 steps" in said  # too short to compile
