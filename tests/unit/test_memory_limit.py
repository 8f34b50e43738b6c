"""The enforced memory limit (gpudl.memory.limit): the CPU count checked against the
allocator's own record of the same training step (torch.profiler's memory events), the limit
enforced at exactly that peak, frees, subclasses, bad limits; the CUDA branch on a GPU only."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from gpudl import models
from gpudl.device import cpu_info, detect
from gpudl.memory.limit import LiveBytesLimit, check_compatible, limit_memory
from gpudl.errors import UserError

_PATH = Path(__file__).parents[2] / "benchmarks" / "memory_measure.py"
_spec = importlib.util.spec_from_file_location("memory_measure", _PATH)
mm = sys.modules.setdefault("memory_measure", importlib.util.module_from_spec(_spec))
if not hasattr(mm, "measure"):
    _spec.loader.exec_module(mm)

CPU = cpu_info()
MARK = "memory_measure/step"
# The foreach AdamW kernels wrap Python scalars in 0-dim tensors inside the kernel (8 bytes each,
# a few per step); no operator returns them, so the count cannot see them. Fused AdamW has none.
SCALARS = {"fused": 0, "foreach": 64}


def small_job(optim: str, seed: int = 0):
    """gpudl's GPT (one block), AdamW, a batch, and one step already taken so optimizer state exists."""
    spec = models.resolve("gpt-tiny", {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16})
    model = models.build(spec, torch.device("cpu"), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{optim: True})
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.config.vocab_size, (4, 17), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    step(model, opt, batch)
    return model, opt, batch


def step(model, opt, batch) -> None:
    x, y = batch
    logits = model(x)  # (B, T, vocab)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def held_bytes(model, opt, batch) -> int:
    """Live between steps, counted independently of the mode: distinct storages of what the job holds."""
    return mm.storage_bytes([*mm.held_tensors(model, opt), *batch])


def profiled(run) -> dict:
    """The allocator's record of `run()` (no dispatch mode active): step_peak_bytes, end_bytes, ..."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(MARK):
            run()
    deltas, marks = mm.profiler_deltas(prof)
    return mm.live_bytes(deltas, *marks[MARK])


@pytest.mark.parametrize("optim", ["fused", "foreach"])
def test_peak_equals_the_allocators_record_of_the_same_step(optim):
    model, opt, batch = small_job(optim)
    ref = profiled(lambda: step(model, opt, batch))  # step 2: the reference, without the mode
    with LiveBytesLimit(2**40, hold=(model, opt, batch)) as limit:
        start = limit.live_bytes
        step(model, opt, batch)  # step 3: allocates exactly as step 2 did
    assert start == held_bytes(model, opt, batch)
    assert ref["step_peak_bytes"] > 100_000  # activations, gradients and the step's temporaries
    assert 0 <= ref["step_peak_bytes"] - (limit.peak_bytes - start) <= SCALARS[optim]
    assert limit.live_bytes - start == ref["end_bytes"] - ref["baseline_bytes"] == 0


def test_a_no_grad_forward_equals_the_allocators_record():
    model, opt, (x, y) = small_job("fused")
    with torch.no_grad():  # nothing is saved for a backward: each activation dies at its next op
        ref = profiled(lambda: model(x).sum())
        with LiveBytesLimit(2**40, hold=model) as limit:
            start = limit.live_bytes
            model(x).sum()
    assert ref["step_peak_bytes"] > 10_000 and limit.peak_bytes - start == ref["step_peak_bytes"]
    assert limit.live_bytes == start


@pytest.mark.parametrize("optim", ["fused", "foreach"])
def test_a_limit_at_the_peak_runs_and_one_byte_less_is_out_of_memory(optim):
    model, opt, batch = small_job(optim)
    with LiveBytesLimit(2**40, hold=(model, opt, batch)) as probe:
        step(model, opt, batch)
    peak = probe.peak_bytes
    with LiveBytesLimit(peak, hold=(model, opt, batch)) as limit:
        step(model, opt, batch)
    assert limit.peak_bytes == peak
    with LiveBytesLimit(peak - 1, hold=(model, opt, batch)) as limit:
        with pytest.raises(torch.OutOfMemoryError, match=r"^CPU out of memory \(gpudl memory limit .*\): tried "
                           r"to allocate .* with .* already live \(aten\."):
            step(model, opt, batch)
        # The failed step's tensors are gone with the exception: the count is what the job holds
        # (gradients of the failed step included, wherever it stopped).
        assert limit.live_bytes == held_bytes(model, opt, batch)
        opt.zero_grad(set_to_none=True)
        assert limit.live_bytes == held_bytes(model, opt, batch)
    assert limit.peak_bytes <= peak - 1


def test_out_of_memory_raised_in_the_backward_keeps_its_type():
    model, opt, batch = small_job("fused")
    with LiveBytesLimit(2**40, hold=(model, opt, batch)) as probe:
        x, y = batch
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        after_forward = probe.peak_bytes
        loss.backward()
        assert probe.peak_bytes > after_forward  # the backward's own ops are counted
    opt.zero_grad(set_to_none=True)
    del loss
    with LiveBytesLimit(after_forward, hold=(model, opt, batch)):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()


def test_frees_are_seen():
    n = 1 << 20  # 4 MiB of float32 per tensor
    with LiveBytesLimit(3 * 4 * n) as limit:
        for _ in range(50):  # 200 MiB allocated in all, at most three tensors live at once
            x = torch.ones(n)
            y = x * 2
        del x, y
        assert limit.live_bytes == 0 and limit.peak_bytes == 3 * 4 * n  # a new x is made while the old x, y live
        kept = []
        with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 4.00 MiB with 12.00 MiB already live"):
            for _ in range(50):
                kept.append(torch.ones(n))
        assert len(kept) == 3 and limit.live_bytes == 3 * 4 * n


def test_views_in_place_and_no_grad_add_nothing():
    with limit_memory(CPU, 2**30) as limit:
        a = torch.zeros(256, 256)
        assert limit.live_bytes == 256 * 256 * 4
        with torch.no_grad():
            b = a[3:].view(-1, 2).t()  # views share a's storage
            a.add_(1).mul_(3)           # in place: no new storage
            torch.add(a, 1, out=a)
        assert limit.live_bytes == 256 * 256 * 4
        c = a.clone()
        assert limit.live_bytes == 2 * 256 * 256 * 4
        del a, c  # a's storage lives on in b
        assert limit.live_bytes == 256 * 256 * 4
        del b
        assert limit.live_bytes == 0


def test_tensors_made_before_entry_count_only_when_held():
    outside = torch.zeros(1000)
    with LiveBytesLimit(10_000) as limit:
        view = outside[10:]  # a view of an uncounted storage allocates nothing
        assert limit.live_bytes == 0
        limit.hold(outside, view)
        assert limit.live_bytes == 4000
        del outside, view
        assert limit.live_bytes == 0
    with pytest.raises(torch.OutOfMemoryError, match="holding existing tensors"):
        LiveBytesLimit(100, hold=(torch.zeros(1000),))


def test_a_storage_resized_in_place_is_counted():
    # FSDP2 frees and regrows its unsharded parameters this way.
    t = torch.zeros(1000)
    with LiveBytesLimit(8000) as limit:
        t.untyped_storage().resize_(0)
        assert limit.live_bytes == 0
        t.untyped_storage().resize_(4000)
        assert limit.live_bytes == 4000
        with pytest.raises(torch.OutOfMemoryError, match="UntypedStorage.resize_"):
            t.untyped_storage().resize_(9000)
        assert t.untyped_storage().nbytes() == 4000 and limit.live_bytes == 4000
    assert torch.UntypedStorage.resize_ is not None and "tracked" not in torch.UntypedStorage.resize_.__name__


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            from torch.distributed.device_mesh import init_device_mesh

            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_dtensor_steps_count_their_local_tensors(one_process_group, layout):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    if layout == "fsdp":
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=one_process_group)
    else:
        parallelize_module(model, one_process_group, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert isinstance(model[0].weight, DTensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def dstep():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dstep()
    ref = profiled(dstep)
    with LiveBytesLimit(2**40, hold=(model, opt, x, y)) as limit:
        start = limit.live_bytes
        dstep()
    assert start == held_bytes(model, opt, (x, y))  # DTensors by their local tensors
    # FSDP's unsharded parameters (UntypedStorage.resize_) and TP's local ops are all seen.
    assert 0 <= ref["step_peak_bytes"] - (limit.peak_bytes - start) <= SCALARS["fused"]
    assert limit.live_bytes == start


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_bad_limit_is_a_user_error(bad):
    with pytest.raises(UserError, match="memory limit must be a positive number of bytes"):
        with limit_memory(CPU, bad):
            pass
    with pytest.raises(UserError, match="memory limit must be a positive number of bytes"):
        LiveBytesLimit(bad)


def test_a_device_torch_cannot_limit_is_a_one_line_user_error():
    xla = dataclasses.replace(CPU, kind="xla", type="xla", index=0, name="TPU v5", memory_bytes=16 * 2**30)
    with pytest.raises(UserError, match=r"^xla:0 \(TPU v5\) has no way to enforce a memory limit") as e:
        with limit_memory(xla, 2**30):
            pass
    assert "\n" not in str(e.value)


def test_compile_with_a_cpu_limit_is_refused():
    # Under any Python dispatch mode Dynamo skips the frame (eager runs, and the frame stays
    # skipped for the process), so the count would be of eager code, not the compiled program.
    with pytest.raises(UserError, match="cannot be combined with torch.compile"):
        check_compatible(True, CPU)
    check_compatible(False, CPU)


@pytest.mark.accelerator
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA branch needs a CUDA device")
def test_cuda_limit_is_the_allocators_and_is_restored():
    info = detect("cuda")
    dev = info.torch_device
    torch.cuda.empty_cache()
    before = torch.cuda.get_per_process_memory_fraction(dev.index)
    limit = 512 * 2**20
    with limit_memory(info, limit) as nothing:
        assert nothing is None
        assert torch.cuda.get_per_process_memory_fraction(dev.index) == pytest.approx(limit / info.memory_bytes)
        small = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(limit, dtype=torch.uint8, device=dev)
        del small
    assert torch.cuda.get_per_process_memory_fraction(dev.index) == before
    big = torch.empty(limit, dtype=torch.uint8, device=dev)  # the limit is gone
    del big
