"""The device-side non-finite guard decides exactly as the host-side one.

The device guard is what accelerators use (no host read per step); it is device-generic, so it
runs here on the CPU against the host guard, which reads the gradient norm every step, as the
reference: the same steps skipped, the same weights, moments and step counts, the same counts.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from gpudl.config import OptimConfig, TrainConfig
from gpudl.device import cpu_info
from gpudl.training.finite import DeviceGuard, HostGuard, NonFiniteError, finite_guard
from gpudl.training.loop import Job, NoEvents, TrainState, train_loop
from gpudl.training.optim import make_optimizer, make_scheduler
from gpudl.training.precision import Precision, make_precision


def _job(guard, bad_steps, precision, steps, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]
    calls = iter(range(10**6))

    def loss_fn(model, batch):  # the loss of the listed steps is NaN, so are their gradients
        loss = F.cross_entropy(model(batch[0]), batch[1])
        return loss * math.nan if next(calls) + 1 in bad_steps else loss

    cfg = OptimConfig(lr=1e-2, warmup_steps=2)
    opt = make_optimizer(model, cfg, "cpu")  # fused on the CPU too
    return Job(model=model, loss_fn=loss_fn, optimizer=opt, scheduler=make_scheduler(opt, cfg, steps),
               precision=precision, batches=iter(batches), guard=guard)


def _fp16_with_scaler():
    return Precision("fp16-mixed", "cpu", torch.float16, torch.float32, torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_the_device_guard_skips_the_same_steps_as_the_host_guard(precision):
    steps, bad = 9, {2, 5, 6}
    runs = {}
    for guard in (HostGuard(), DeviceGuard()):
        prec = _fp16_with_scaler() if precision == "fp16-mixed" else make_precision(precision, cpu_info())
        job = _job(guard, bad, prec, steps)
        state = train_loop(job, TrainConfig(max_steps=steps, log_every=4, max_nonfinite=5), TrainState(), NoEvents())
        runs[type(guard).__name__] = (job, state)
    (host, host_state), (device, device_state) = runs["HostGuard"], runs["DeviceGuard"]
    assert (device_state.nonfinite_total, device_state.nonfinite_in_a_row) == (host_state.nonfinite_total, 0)
    assert host_state.nonfinite_total >= len(bad)  # fp16: the scaler's own overflow steps besides
    for a, b in zip(host.model.parameters(), device.model.parameters()):
        assert torch.equal(a, b)
        sa, sb = host.optimizer.state[a], device.optimizer.state[b]
        assert torch.equal(sa["step"], sb["step"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    if precision != "fp16-mixed":  # the scaler's skips also count its overflow steps; no fixed number
        assert float(host.optimizer.state[next(host.model.parameters())]["step"]) == steps - len(bad)


def test_the_device_guard_stops_the_run_at_the_log_interval_after_too_many_in_a_row():
    """Read once per log interval: 3 in a row from step 2 is seen at step 4, and the weights are those of step 1."""
    job = _job(DeviceGuard(), set(range(2, 100)), make_precision("fp32", cpu_info()), steps=20)
    after_one = _job(HostGuard(), set(), make_precision("fp32", cpu_info()), steps=1)
    train_loop(after_one, TrainConfig(max_steps=1), TrainState(), NoEvents())
    state = TrainState()
    with pytest.raises(NonFiniteError, match="3 steps in a row had NaN/Inf gradients"):
        train_loop(job, TrainConfig(max_steps=20, log_every=4, max_nonfinite=3), state, NoEvents())
    assert state.step == 4 and state.nonfinite_in_a_row == 3 and state.nonfinite_total == 3
    for a, b in zip(after_one.model.parameters(), job.model.parameters()):
        assert torch.equal(a, b)


def test_a_resumed_run_continues_the_counts_it_saved():
    job = _job(DeviceGuard(), {1, 2}, make_precision("fp32", cpu_info()), steps=4)
    state = TrainState(step=10, nonfinite_in_a_row=2, nonfinite_total=7)
    with pytest.raises(NonFiniteError):  # 2 saved + 2 now = 4 in a row
        train_loop(job, TrainConfig(max_steps=14, log_every=2, max_nonfinite=4), state, NoEvents())
    assert (state.step, state.nonfinite_in_a_row, state.nonfinite_total) == (12, 4, 9)


def test_the_device_guard_is_chosen_for_a_fused_optimizer_of_weights_off_the_cpu():
    on_cpu, off_cpu = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")  # meta: any device not the CPU
    fused = make_optimizer(off_cpu, OptimConfig(), "cpu")
    plain = torch.optim.SGD(off_cpu.parameters(), lr=0.1)
    assert isinstance(finite_guard(torch.device("cpu"), make_optimizer(on_cpu, OptimConfig(), "cpu")), HostGuard)
    assert isinstance(finite_guard(torch.device("meta"), fused), DeviceGuard)
    assert isinstance(finite_guard(torch.device("meta"), plain), HostGuard)    # no fused kernel to skip with
    # a job on an accelerator whose weights live on the host (FSDP's CPU offload): the host decides
    assert isinstance(finite_guard(torch.device("meta"), make_optimizer(on_cpu, OptimConfig(), "cpu")), HostGuard)
