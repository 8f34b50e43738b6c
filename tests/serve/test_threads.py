"""How `gpudl serve` picks torch's CPU threads: the rule in serve/threads.py, driven by calls whose
cost per thread count is known, and the kernel count against operators counted by hand."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import run_cli
from gpudl import models
from gpudl.serve.load import Loaded
from gpudl.serve.threads import (SHORT_KERNEL_S, candidates, choose_threads, full_batch_call, kernels_per_call,
                                 seconds_per_call)


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _sleeps(seconds_at: dict[int, float]):
    """A call lasting seconds_at[current thread count]; it runs no aten operator (counted as one)."""
    return lambda: time.sleep(seconds_at[torch.get_num_threads()])


def test_candidates_double_up_to_the_cores():
    assert candidates(1) == [1] and candidates(2) == [1, 2] and candidates(6) == [1, 2, 4, 6]


def test_long_kernels_get_the_fewest_threads_within_ten_percent_of_the_fastest():
    # 2 threads are within 10% of 4's time (the gaps are milliseconds wide: a loaded machine's late
    # wake-ups do not close them, and each count keeps its fastest of three calls)
    call = _sleeps({1: 0.200, 2: 0.100, 4: 0.094})
    chosen, timings = choose_threads(call, cores=4)
    assert chosen == 2 and sorted(timings) == [1, 2, 4] and torch.get_num_threads() == 2


def test_a_thread_that_buys_more_than_ten_percent_is_taken():
    chosen, _ = choose_threads(_sleeps({1: 0.200, 2: 0.150}), cores=2)
    assert chosen == 2


def test_short_kernels_leave_a_core_to_the_event_loop():
    a = torch.ones(4)

    def many_small_kernels():  # 200 operators of well under a millisecond each
        for _ in range(200):
            a.add(1)
    assert seconds_per_call(many_small_kernels) / kernels_per_call(many_small_kernels) < SHORT_KERNEL_S
    chosen, timings = choose_threads(many_small_kernels, cores=2)
    assert chosen == 1 and list(timings) == [1]  # with 2 cores, the second is the event loop's: not even timed


def test_kernels_are_counted_per_operator():
    a, b = torch.ones(3), torch.ones(3)
    assert kernels_per_call(lambda: (a + b).mul(2).sum()) == 3


@pytest.mark.parametrize("name, kind, shape, out", [("gpt-tiny", "gpt", None, (4, 256)),
                                                     ("resnet18", "classifier", (3, 16, 16), (4, 10))])
def test_the_timed_call_is_the_engines_largest(name, kind, shape, out):
    spec = models.resolve(name, {"n_layer": 1} if kind == "gpt" else {})
    model = models.build(spec, torch.device("cpu")).eval()
    loaded = Loaded(model=model, spec=spec, device=torch.device("cpu"), device_label="cpu", dtype=torch.float32,
                    name=name, kind=kind, source="test", input_shape=shape)
    assert tuple(full_batch_call(loaded, max_batch_size=4)().shape) == out


def test_threads_below_one_is_one_line_and_exit_2():
    done = run_cli("serve", "--threads", "0", timeout=60)
    assert done.returncode == 2 and "--threads" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_gpt_is_timed_on_the_engines_own_cache():
    from gpudl.serve.generation import GenerationEngine

    spec = models.resolve("gpt-tiny", {"n_layer": 1})
    model = models.build(spec, torch.device("cpu")).eval()
    loaded = Loaded(model=model, spec=spec, device=torch.device("cpu"), device_label="cpu", dtype=torch.float32,
                    name="gpt-tiny", kind="gpt", source="test")
    engine = GenerationEngine(model, "cpu", max_batch_size=4)
    assert not engine.cache.k.any()
    full_batch_call(loaded, 4, engine.cache)()
    assert engine.cache.k.any()  # written where the engine reads, not in a second cache
