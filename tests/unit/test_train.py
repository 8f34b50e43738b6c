"""The training loop on each device (the CPU; the accelerator where there is one): against a plain
PyTorch loop bit for bit, accumulation, non-finite steps, evaluation and the fp16 loss scaler."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from gpudl.config import OptimConfig, TrainConfig
from gpudl.device import detect
from gpudl.training.optim import make_optimizer, make_scheduler
from gpudl.training.precision import Precision, make_precision
from gpudl.training.loop import Job, NonFiniteError, TrainState, evaluate, train_loop


class Quiet:
    """Events that remember what the loop reported."""

    def __init__(self):
        self.losses, self.evals = [], []

    def on_step(self, state, loss, grad_norm, lr):
        self.losses.append(loss.item())

    def on_eval(self, state, metrics):
        self.evals.append(metrics)

    def after_step(self, state):
        pass

    def should_stop(self, state):
        return False


def make_net(seed=0, device="cpu"):
    torch.manual_seed(seed)  # initialised on the CPU, then moved: the same weights on every device
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)).to(device)


def data(n_batches, batch_size, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 8, generator=g).to(device),
             torch.randint(0, 3, (batch_size,), generator=g).to(device)) for _ in range(n_batches)]


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def gpudl_job(model, batches, steps, precision="fp32", device="cpu", **kw):
    opt = make_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=2), torch.device(device).type)
    return Job(model=model, loss_fn=kw.pop("loss", loss_fn), optimizer=opt,
               scheduler=make_scheduler(opt, OptimConfig(lr=1e-2, warmup_steps=2), steps),
               precision=make_precision(precision, detect(device)), batches=iter(batches),
               device=torch.device(device), **kw)


def test_a_step_drawn_whole_and_cut_equals_one_drawn_in_micro_batches(device):
    """A recipe draws a step's rows at once and the loop cuts them: the same as drawing each micro-batch."""
    steps, accum, rows = 4, 2, 4
    micro = data(steps * accum, rows, device=device)
    whole = [tuple(torch.cat(parts) for parts in zip(*micro[i:i + accum])) for i in range(0, len(micro), accum)]
    a, b = make_net(device=device), make_net(device=device)
    cfg = TrainConfig(max_steps=steps, grad_accum=accum)
    train_loop(gpudl_job(a, micro, steps, device=device, draws=accum), cfg, TrainState(), Quiet())
    train_loop(gpudl_job(b, whole, steps, device=device, micro_batch=rows), cfg, TrainState(), Quiet())
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


def torch_alone(model, steps, warmup):
    """The reference's optimizer and schedule from torch and a formula only, not gpudl's own helpers (a bug
    there would cancel out): AdamW with weight decay 0.1 on matrices and none on vectors, betas (0.9, 0.95),
    the peak lr 1e-2 after a linear warm-up, then a cosine down to a tenth of it."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    fused = next(model.parameters()).device.type in ("cpu", "cuda", "xpu", "mps")
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused or None, foreach=None if fused else True)

    def factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (steps - warmup))))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def test_loop_equals_a_plain_pytorch_loop_bit_for_bit(device):
    """The same kernels in the same order on the same device: equal to the bit, on an accelerator too."""
    steps, accum = 6, 2
    batches = data(steps * accum, 4, device=device)
    ours, theirs = make_net(device=device), make_net(device=device)
    job = gpudl_job(ours, batches, steps, device=device, draws=accum)
    train_loop(job, TrainConfig(max_steps=steps, grad_accum=accum, grad_clip=0.5), TrainState(), Quiet())

    opt, sched = torch_alone(theirs, steps, warmup=2)
    it = iter(batches)
    for _ in range(steps):
        for _ in range(accum):
            (loss_fn(theirs, next(it)) / accum).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_accumulating_two_halves_equals_one_full_batch(device):
    full = data(3, 8, device=device)
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in full for i in (0, 4)]
    a, b = make_net(device=device), make_net(device=device)
    train_loop(gpudl_job(a, full, 3, device=device), TrainConfig(max_steps=3), TrainState(), Quiet())
    train_loop(gpudl_job(b, halves, 3, device=device, draws=2), TrainConfig(max_steps=3, grad_accum=2),
               TrainState(), Quiet())
    # Sums over 8 rows and over 4 + 4 differ in the last bits; a GPU's GEMMs also tile a batch of 8
    # and one of 4 differently, so there the tolerance is 1e-5.
    atol = 1e-6 if device == "cpu" else 1e-5
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=atol)


def test_a_non_finite_step_is_skipped_and_counted(device):
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss = loss_fn(model, batch)
        return loss * float("nan") if calls["n"] == 3 else loss

    model = make_net(device=device)
    job = gpudl_job(model, data(5, 4, device=device), 5, device=device, loss=poisoned)
    state = TrainState()
    seen = []

    class Watch(Quiet):
        def on_step(self, state, loss, grad_norm, lr):
            seen.append(([p.clone() for p in model.parameters()], copy.deepcopy(job.optimizer.state_dict())))

    train_loop(job, TrainConfig(max_steps=5), state, Watch())
    assert state.nonfinite_total == 1 and state.nonfinite_in_a_row == 0 and state.step == 5
    (p2, o2), (p3, o3) = seen[1], seen[2]
    assert all(torch.equal(a, b) for a, b in zip(p2, p3))  # step 3 changed no weight...
    first = next(iter(o2["state"]))
    assert torch.equal(o2["state"][first]["exp_avg"], o3["state"][first]["exp_avg"])  # ...and no moment
    assert o2["state"][first]["step"] == o3["state"][first]["step"]
    assert not all(torch.equal(a, b) for a, b in zip(p3, seen[3][0]))  # step 4 trains again


def test_too_many_non_finite_steps_in_a_row_stop_the_run(device):
    job = gpudl_job(make_net(device=device), data(10, 4, device=device), 10, device=device,
                    loss=lambda m, b: loss_fn(m, b) * float("inf"))
    with pytest.raises(NonFiniteError, match="3 steps in a row had NaN/Inf gradients"):
        train_loop(job, TrainConfig(max_steps=10, max_nonfinite=3), TrainState(), Quiet())


def test_evaluate_averages_in_eval_mode_and_restores_train_mode(device):
    model = make_net(device=device)
    val = data(3, 4, seed=9, device=device)
    job = gpudl_job(model, [], 1, device=device, eval_batches=lambda: iter(val),
                    eval_fn=lambda m, b: {"loss": loss_fn(m, b), "training": torch.tensor(float(m.training))})
    out = evaluate(job)
    expected = sum(loss_fn(model, b).item() for b in val) / 3
    assert out["loss"] == pytest.approx(expected, rel=1e-6) and out["training"] == 0.0
    assert model.training


def test_loss_falls_on_learnable_data(device):
    model = make_net(device=device)
    events = Quiet()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)).to(device)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    train_loop(gpudl_job(model, [(x, y)] * 60, 60, device=device), TrainConfig(max_steps=60), TrainState(), events)
    assert events.losses[-1] < 0.5 * events.losses[0]


def test_grad_scaler_policy_skips_and_backs_off_on_overflow(device):
    model = make_net(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    kind = torch.device(device).type
    p = Precision("fp16-mixed", kind, None, torch.float32, torch.amp.GradScaler(kind, init_scale=2.0**16))
    before = [q.clone() for q in model.parameters()]
    p.backward(loss_fn(model, data(1, 4, device=device)[0][0:2]) * float("inf"))
    p.unscale(opt)
    p.step(opt, finite=False)
    assert p.scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert p.state_dict()["scale"] == 2.0**15
