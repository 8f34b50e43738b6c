import copy

import pytest
import torch
import torch.nn.functional as F

from gpudl import models
from gpudl.config import ParallelConfig, TrainConfig
from gpudl.device import cpu_info
from gpudl.distributed.session import Session
from gpudl.distributed.parallelize import apply_activation_checkpointing, checkpoint_units, compile_wanted, parallelize
from gpudl.errors import UserError


def grads_of(model, x, y):
    model.zero_grad()
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_names_and_gradients(mode):
    spec = models.resolve("gpt-tiny", {"n_layer": 2})
    plain = models.build(spec, torch.device("cpu"), seed=0)
    ckpt = apply_activation_checkpointing(models.build(spec, torch.device("cpu"), seed=0), mode)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
    x = torch.randint(0, 256, (2, 32))
    la, ga = grads_of(plain, x, x)
    lb, gb = grads_of(ckpt, x, x)
    assert torch.equal(la, lb)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-7), name


def test_activation_checkpointing_really_recomputes():
    spec = models.resolve("gpt-tiny", {"n_layer": 2})
    model = apply_activation_checkpointing(models.build(spec, torch.device("cpu"), seed=0))
    calls = []
    model.blocks["0"].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    x = torch.randint(0, 256, (2, 16))
    model(x, x).backward()
    assert len(calls) == 2  # once in forward, once again during backward


def _matmuls_in_backward(model, x) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    counted = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func in counted
            return func(*args, **(kwargs or {}))
    loss = model(x, x)
    with Count():
        loss.backward()
    return Count.n


def test_selective_checkpointing_recomputes_no_matmul_and_full_recomputes_them_all():
    spec = models.resolve("gpt-tiny", {"n_layer": 2})
    x = torch.randint(0, 256, (2, 16))
    plain = _matmuls_in_backward(models.build(spec, torch.device("cpu"), seed=0), x)
    selective = _matmuls_in_backward(apply_activation_checkpointing(models.build(spec, "cpu", seed=0), "selective"), x)
    full = _matmuls_in_backward(apply_activation_checkpointing(models.build(spec, "cpu", seed=0), "full"), x)
    # Full checkpointing reruns a block's forward up to its last saved tensor: q, k, v, the attention's
    # output projection and the MLP's first (torch stops before the MLP's last, whose output is not saved).
    assert selective == plain and full == plain + 2 * 5


def test_checkpoint_units_fall_back_to_the_largest_module_list():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])

    net = Net()
    assert checkpoint_units(net) == list(net.layers)
    with pytest.raises(UserError, match="needs a model with a list of blocks"):
        checkpoint_units(torch.nn.Linear(2, 2))


def test_compile_auto_is_off_on_the_cpu():
    assert compile_wanted("auto", "cpu") is False
    assert compile_wanted(True, "cpu") is True and compile_wanted(False, "cuda") is False


@pytest.mark.slow
def test_compiled_model_trains_to_the_same_loss():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    compiled = parallelize(copy.deepcopy(eager), Session(cpu_info()), ParallelConfig(), "fp32",
                           TrainConfig(compile=True)).model
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    a = F.cross_entropy(eager(x), y)
    b = F.cross_entropy(compiled(x), y)
    assert torch.allclose(a, b, atol=1e-5)
    b.backward()
    assert all(p.grad is not None for p in compiled.parameters())
