"""The memory estimate against real steps, and `gpudl plan`: its table, its choice, and its refusals.

The measurements come from benchmarks/memory_measure.py (c10's own allocation log of a real
second training step, in fresh processes): nothing there shares code with the estimate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import measured_once
from gpudl.cli import main
from gpudl.config import load_config, with_sets
from gpudl.memory.fake_jobs import estimate
from gpudl.config.sizes import parse_size
from gpudl.memory.plan import layouts, local_machine, plan, target_machine

_PATH = Path(__file__).parents[2] / "benchmarks" / "memory_measure.py"
_spec = importlib.util.spec_from_file_location("memory_measure", _PATH)
mm = sys.modules.setdefault("memory_measure", importlib.util.module_from_spec(_spec))
if not hasattr(mm, "measure"):
    _spec.loader.exec_module(mm)

CASES = [mm.Case("gpt-tiny", 8), mm.Case("gpt-tiny", 32, "bf16-mixed", activation_checkpointing=True),
         mm.Case("gpt-tiny", 16, activation_checkpointing="selective"),
         mm.Case("gpt-tiny", 8, strategy="ddp", world=2, overrides=(("train.grad_accum", 4),)), mm.Case("gpt-tiny", 32, strategy="fsdp", world=2),
         mm.Case("gpt-tiny", 32, strategy="tp", world=2), mm.Case("resnet18", 8, overrides=(("data.image_size", 32),)),
         # FSDP's CPU offload asked of one process: FSDP over a group of one, gradients summed on the host
         mm.Case("gpt-tiny", 16, overrides=(("parallel.fsdp_cpu_offload", True), ("train.grad_accum", 2))),
         mm.Case("resnet18", 8, strategy="ddp", world=2, overrides=(("data.image_size", 32),)),
         # pipelines (1F1B, GPipe, interleaved): each rank's stages traced alone, combined in the schedule's order
         mm.Case("gpt-tiny", 16, strategy="pp", world=2),
         mm.Case("gpt-tiny", 16, "bf16-mixed", True, strategy="pp", world=2,
                 overrides=(("parallel.pp_schedule", "gpipe"),)),
         mm.Case("gpt-tiny", 16, strategy="pp", world=2, overrides=(
             ("parallel.pp_schedule", "interleaved-1f1b"), ("parallel.pp_stages_per_rank", 2),
             ("parallel.pp_microbatches", 4))),
         # beside the pipeline: FSDP (gradients and gathered weights held to the run's end), and TP
         mm.Case("gpt-tiny", 16, strategy="pp", world=4, overrides=(("parallel.pp", 2), ("parallel.dp_shard", 2))),
         mm.Case("gpt-tiny", 16, strategy="pp", world=4, overrides=(("parallel.pp", 2), ("parallel.tp", 2))),
         mm.Case("gpt-tiny", 16, strategy="pp", world=4, overrides=(
             ("parallel.pp", 2), ("parallel.dp_shard", 2), ("parallel.pp_schedule", "interleaved-1f1b"),
             ("parallel.pp_stages_per_rank", 2), ("parallel.pp_microbatches", 4)))]
SMALL_GPT = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.block_size=64", "train.batch_size=16",
             "train.precision=bf16-mixed", "train.attention=sdpa"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.title)
def test_the_estimate_is_within_10_percent_of_a_real_step(tmp_path, case):
    predicted = estimate(load_config(None, case.config_sets()), case.world).peak
    measured = max(r["peak_bytes"] for r in measured_once(mm, case, tmp_path))
    assert predicted == pytest.approx(measured, rel=0.10), (predicted / 2**20, measured / 2**20)


@pytest.mark.parametrize("case", [c for c in CASES if c.world == 1], ids=lambda c: c.title)
def test_on_a_gpu_the_estimate_is_within_10_percent_of_max_memory_allocated(tmp_path, accelerator, case):
    if accelerator != "cuda":
        pytest.skip(f"the measurement reads torch.cuda's allocator counters; this machine has {accelerator}")
    case = dataclasses.replace(case, device="cuda")
    predicted = estimate(load_config(None, case.config_sets()), case.world).peak
    measured = mm.measure(case, tmp_path)[0]
    assert measured["method"] == "allocator"
    assert predicted == pytest.approx(measured["peak_bytes"], rel=0.10), (predicted / 2**20, measured["peak_bytes"] / 2**20)


def test_a_plan_for_gpus_that_are_not_here_fits_and_says_why(capsys):
    code = main(["plan", *[a for s in SMALL_GPT for a in ("--set", s)], "--target", "a100-40gb",
                 "--nproc-per-node", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    layouts = {c["layout"] for c in doc["candidates"]}
    assert {"DDP", "FSDP", "TP 2"} <= layouts
    winner = [c for c in doc["candidates"] if c["winner"]]
    assert len(winner) == 1 and winner[0]["fits"] and winner[0]["step_s"] > 0
    for c in doc["candidates"]:
        # the global batch is kept: micro-batch x accumulation x data-parallel processes
        dp = 1 if c["layout"].startswith("TP") else 2
        assert c["micro_batch"] * c["grad_accum"] * dp == doc["global_batch"] == 16 * 2
        assert c["peak_bytes"] * 1.1 <= doc["machine"]["usable_bytes"] or not c["fits"]


def test_a_target_gives_the_breakdown_a_trace_gives_on_that_memory():
    """--target a100-40gb and --memory-limit of the memory it leaves: the same traces, the same figures."""
    cfg = load_config(None, SMALL_GPT)
    on_target = plan(cfg, target_machine("a100-40gb", 1))
    here = plan(cfg, local_machine("cpu", 1, limit=target_machine("a100-40gb", 1).usable))
    pairs = list(zip(on_target.candidates, here.candidates))
    assert pairs and all(a.estimate.parts == b.estimate.parts and a.sets == b.sets for a, b in pairs)


def test_a_small_memory_limit_shrinks_the_micro_batch_and_keeps_the_global_batch():
    cfg = load_config(None, [*SMALL_GPT, "train.batch_size=64"])
    roomy = plan(cfg, local_machine("cpu", 1, limit=parse_size("4GiB"))).winner
    tight_limit = int(roomy.estimate.peak * 1.1 * 0.6)
    tight = plan(cfg, local_machine("cpu", 1, limit=tight_limit)).winner
    assert roomy.micro_batch == 64 and tight is not None
    assert tight.micro_batch * tight.grad_accum == 64 and (tight.micro_batch < 64 or tight.activation_checkpointing)
    assert tight.estimate.peak * 1.1 <= tight_limit


def test_a_pipeline_is_planned_where_the_model_allows_it():
    """(The micro-batches tried for it are those its schedule splits: `_largest_that_fits` filters them.)"""
    machine = target_machine("a100-40gb", 2)
    untied = load_config(None, [*SMALL_GPT, "model.tie_embeddings=false", "train.batch_size=12",
                                "parallel.pp_microbatches=3"])
    assert ("PP 2", {"parallel.tp": 1, "parallel.pp": 2, "parallel.dp_replicate": 1, "parallel.dp_shard": 1}) \
        in layouts(untied, machine)
    four = target_machine("a100-40gb", 4)
    deeper = with_sets(untied, ["model.n_layer=4", "parallel.pp_microbatches=4", "train.batch_size=16"])
    assert [name for name, _ in layouts(untied, four) if name.startswith("PP")] == ["PP 2 x FSDP 2"]  # 2 layers
    assert [name for name, _ in layouts(deeper, four) if name.startswith("PP")] == ["PP 2 x FSDP 2", "PP 4"]
    assert ("PP 2 x FSDP 2", {"parallel.tp": 1, "parallel.pp": 2, "parallel.dp_replicate": 1, "parallel.dp_shard": 2}) \
        in layouts(deeper, four)
    tied = load_config(None, [*SMALL_GPT, "train.batch_size=12", "parallel.pp_microbatches=3"])
    assert not any(name.startswith("PP") for name, _ in layouts(tied, machine))


def test_cpu_offload_keeps_the_shards_and_moments_out_of_an_accelerators_peak():
    """FSDP's CPU offload: on the CPU host and device are one memory; on an accelerator the same trace
    is split, and what it keeps on the host at the device's peak is, by count, the weights' shard and
    AdamW's two moments (12 bytes a parameter over 2 shards); the device's peak is the CPU's less that.
    The host's own peak, in the update, holds the gradients' shard too (16 bytes a parameter)."""
    from gpudl import models

    sets = [*SMALL_GPT, "train.precision=fp32", "parallel.dp_replicate=1", "parallel.dp_shard=2",
            "parallel.fsdp_cpu_offload=true"]
    on_cpu = estimate(load_config(None, [*sets, "run.device=cpu"]), 2)
    on_gpu = estimate(load_config(None, [*sets, "run.device=cuda"]), 2)
    cfg = load_config(None, sets)
    n = sum(p.numel() for p in models.build_meta(models.resolve(cfg.model.name, cfg.model.overrides)).parameters())
    assert on_cpu.host == 0 and on_gpu.parts["host"] == pytest.approx(12 * n / 2, rel=0.01)
    assert on_gpu.host == pytest.approx(16 * n / 2, rel=0.01)
    assert on_gpu.peak + on_gpu.parts["host"] == on_cpu.peak and on_gpu.parts["optimizer"] == 0
    # the same beside a pipeline of two (each rank traced alone; the first stage also holds the embeddings)
    piped = [*sets, "model.tie_embeddings=false", "parallel.pp=2", "parallel.pp_microbatches=2"]
    on_cpu, on_gpu = (estimate(load_config(None, [*piped, f"run.device={d}"]), 4) for d in ("cpu", "cuda"))
    assert on_cpu.host == 0 and 12 * n / 4 <= on_gpu.host <= 12 * n / 2 and on_gpu.peak + on_gpu.host == on_cpu.peak


def test_when_nothing_fits_on_the_device_the_plan_offloads_to_the_host():
    """A GPU whose memory holds less than the weights, gradients and AdamW state: every plan on the device
    alone is rejected, and the winner keeps them in host memory (FSDP's CPU offload, over one process),
    with its predicted peak under the memory and the host's 16 bytes a parameter (fp32 weights,
    gradients and two moments) said beside it."""
    from gpudl import models
    from gpudl.memory.plan import WORKSPACE_BYTES

    sets = [*SMALL_GPT, "model.d_model=512", "model.n_head=8", "train.batch_size=4"]
    cfg = load_config(None, sets)
    n = sum(p.numel() for p in models.build_meta(models.resolve(cfg.model.name, cfg.model.overrides)).parameters())
    machine = target_machine("l4", 1, limit=WORKSPACE_BYTES + 12 * n)  # less than the 16 bytes a parameter
    result = plan(cfg, machine)
    on_device = [c for c in result.candidates if "parallel.fsdp_cpu_offload" not in c.settings]
    assert on_device and not any(c.fits for c in on_device)
    w = result.winner
    assert w is not None and "parallel.fsdp_cpu_offload=true" in w.sets and w.strategy == "one process · CPU offload"
    assert w.estimate.peak * 1.1 <= machine.usable and w.estimate.host == pytest.approx(16 * n, rel=0.02)


def test_no_plan_holds_the_weights_whole_where_they_do_not_fit_before_sharding():
    """Every layout but a pipeline makes the model's weights whole on each device before FSDP shards
    (or offloads) them: on 8 GPUs whose memory holds a quarter of the training state's 16 bytes a
    parameter (the shards' 2, and activations) but not the 4.4 of fp32 weights and the margin, none of
    them is offered, and none is traced."""
    from gpudl import models
    from gpudl.memory.plan import WORKSPACE_BYTES

    cfg = load_config(None, [*SMALL_GPT, "train.precision=fp32"])
    n = sum(p.numel() for p in models.build_meta(models.resolve(cfg.model.name, cfg.model.overrides)).parameters())
    result = plan(cfg, target_machine("h100-80gb", 8, limit=WORKSPACE_BYTES + 4 * n))
    assert result.candidates and result.winner is None
    assert all("made whole on each device before sharding" in c.rejected and c.traces == 0 and c.estimate is None
               for c in result.candidates)


def test_a_pipeline_beside_fsdp_is_estimated_as_a_pipeline_of_sharded_stages():
    """PP 2 x FSDP 2 against the same pipeline alone: half the optimizer state, and at the peak (in a
    backward) more weights than the shard: the units PipelineStage keeps gathered after their backward,
    up to the whole stage (1.5 times the pipeline's own weights with the shard)."""
    sets = [*SMALL_GPT, "model.tie_embeddings=false", "model.n_layer=4", "train.precision=fp32",
            "parallel.pp_microbatches=2"]
    both = estimate(load_config(None, [*sets, "parallel.pp=2", "parallel.dp_shard=2"]), 4)
    alone = estimate(load_config(None, [*sets, "parallel.pp=2", "parallel.dp_shard=1"]), 2)
    assert both.strategy == "PP" and both.parts["optimizer"] * 2 == pytest.approx(alone.parts["optimizer"], rel=0.02)
    assert alone.parts["params"] / 2 < both.parts["params"] <= 1.5 * alone.parts["params"]
    assert both.peak < alone.peak


@pytest.mark.parametrize("argv, words", [
    (["--memory-limit", "12XB"], "is not a size: write it like 12GiB"),
    (["--target", "a100"], "unknown target GPU 'a100'"),
    (["--memory-limit", "1MiB"], "is less than the parameters alone need"),
    (["--nproc-per-node", "2", "--set", "parallel.tp=2", "--set", "model.n_head=3", "--set", "model.d_model=96"],
     "n_head=3"),
    (["--nproc-per-node", "2", "--set", "parallel.pp=2"], "cannot share weights: set --set model.tie_embeddings=false"),
])
def test_bad_plan_requests_are_one_line(capsys, argv, words):
    code = main(["plan", "--set", "model.n_layer=2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


class _Formula:
    """In place of the trace workers: peak = weights + micro-batch x (activations per sample), a
    quarter of them with checkpointing; records each micro-batch asked for."""

    def __init__(self):
        self.asked: list[tuple[int, bool]] = []

    def estimate(self, cfg):
        from gpudl.memory.estimate import Estimate

        b, ac = cfg.train.batch_size, cfg.train.activation_checkpointing
        self.asked.append((b, ac))
        return Estimate("DDP", 2, {"params": 1000, "activations": b * (25 if ac else 100)})


@pytest.mark.parametrize("usable, plain, checkpointed", [(2000, 8, 32), (1250, 1, 4), (1150, 0, 1), (1e9, 64, None)])
def test_checkpointing_is_searched_only_above_the_plain_steps_micro_batch(usable, plain, checkpointed):
    from gpudl.memory.plan import Machine, _layout_candidates

    cfg = load_config(None, ["model.name=gpt-tiny", "train.batch_size=64"])
    machine = Machine("test", "cpu", int(usable), {"fp32": 1e12}, 1e9, nproc=2, limit=int(usable))
    formula = _Formula()
    flat = {"parallel.tp": 1, "parallel.pp": 1, "parallel.dp_replicate": 2, "parallel.dp_shard": 1}
    found = _layout_candidates(cfg, machine, formula, "DDP", flat, batch=128)
    # the brute-force answer: the largest power-of-two micro-batch whose peak x 1.1 is within the memory
    best = {ac: max((b for b in (1, 2, 4, 8, 16, 32, 64) if (1000 + b * (25 if ac else 100)) * 1.1 <= usable),
                    default=0) for ac in (False, True)}
    assert found[0].micro_batch == plain or (plain == 0 and not found[0].fits)
    assert best[False] == plain
    if checkpointed is None:
        assert len(found) == 1  # the plain step fits without accumulation: nothing to buy
    else:
        assert found[1].fits and found[1].micro_batch == checkpointed == best[True]
        assert all(b > plain for b, ac in formula.asked if ac)  # no checkpointed micro-batch at or below plain's


def test_a_question_asked_again_is_answered_from_the_trace_cache(monkeypatch, tmp_path, capsys):
    """The second `gpudl plan` for the same job traces nothing (tracing is made impossible) and answers
    the same; an unreadable cache file is a miss, traced again."""
    import gpudl.memory.estimate as estimate_module
    import gpudl.memory.fake_jobs as fake_jobs

    monkeypatch.setenv("GPUDL_CACHE_DIR", str(tmp_path))
    args = ["plan", *[a for s in SMALL_GPT for a in ("--set", s)], "--target", "a100-40gb", "--nproc-per-node", "2",
            "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    kept = sorted((tmp_path / "traces").glob("*.json"))
    assert kept

    def no_trace(*a, **k):
        raise AssertionError("traced although the cache holds the answer")
    with monkeypatch.context() as m:
        m.setattr(fake_jobs, "_start_worker", no_trace)
        m.setattr(estimate_module, "traced_here", no_trace)
        assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first
    kept[0].write_text("{not json")  # a damaged entry: traced again, and the answer is the same
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first


def test_the_trace_cache_key_follows_the_job_not_where_it_runs():
    from gpudl.memory.trace_cache import _key

    cfg = load_config(None, SMALL_GPT)
    assert _key(cfg, 2) == _key(load_config(None, [*SMALL_GPT, "run.dir=elsewhere", "log.progress=false",
                                                   "train.max_steps=3", "train.plan=auto",
                                                   "train.memory_limit=1GiB"]), 2)
    assert _key(cfg, 2) != _key(cfg, 4)
    assert _key(cfg, 2) != _key(load_config(None, [*SMALL_GPT, "train.batch_size=8"]), 2)
