"""Serving that holds under overload, on the engines with real threads and event loops: a request
is admitted only if it can start within max_wait_s (refused at once otherwise, with a retry time);
a request whose deadline passes, or whose caller leaves, while it waits is out of the queue before
it costs model time; waiting clients share the decode slots and batch rows fairly (a round robin
among them for requests that cost alike, the independent reference here), and `priority` orders a
client's own share.

Which request the model ran, and when, is read from the model itself: its prefill (GPT) or forward
(classifier) records what it was given, then runs unchanged. The worker is held at a known step
by the engine's batch hook (test_engine.Gate), so no assertion depends on this machine's speed
and none on how long anything took.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch
from torch import nn

from gpudl import models
from gpudl.serve.admission import Rate
from gpudl.serve.batching import BatchingEngine
from gpudl.serve.engine import DeadlineExceeded, Overloaded, QueueFull
from gpudl.serve.fair import FairQueue
from gpudl.serve.generation import GenerationEngine, Sampling
from test_engine import BLOCK, Gate, collect, run

CPU = torch.device("cpu")
GREEDY = Sampling(max_tokens=6, temperature=0)


def gpt_recording_prompts():
    """A small GPT whose prefill records each prompt (as bytes, in call order; the rows of a call in
    their order) before it runs them."""
    spec = models.resolve("gpt-tiny", {"n_layer": 1, "d_model": 16, "n_head": 2, "block_size": BLOCK})
    model = models.build(spec, CPU, seed=5).eval()
    prompts: list[bytes] = []
    prefill = model.prefill

    def recording(ids, cache, slot):  # ids: (B, P), prompts of one length prefilled together
        prompts.extend(bytes(row.tolist()) for row in ids)
        return prefill(ids, cache, slot)
    model.prefill = recording
    return model, prompts


def held_one_slot_engine():
    """A started one-slot engine over gpt_recording_prompts' GPT whose worker a Gate holds after each step:
    the engine, the gate and the prompts the model has seen."""
    model, prompts = gpt_recording_prompts()
    engine = GenerationEngine(model, CPU, max_batch_size=1)
    gate = Gate(1)
    engine.observe_batch = gate
    engine.start()
    return engine, gate, prompts


class RecordingRows(nn.Module):
    """A classifier stand-in: returns its input's rows, records each call's first values, and holds
    its first call until `go` is set."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.entered, self.go, self.calls = threading.Event(), threading.Event(), []

    def forward(self, x):  # (N, 1, 1, 1)
        self.entered.set()
        assert self.go.wait(30)
        self.calls.append([int(v) for v in x.flatten()])
        return x.flatten(1) * self.scale


def row(tag: int) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), float(tag))


def round_robin(*queues: list) -> list:
    """The reference order for clients whose requests cost alike: one of each waiting client in turn."""
    order, queues = [], [list(q) for q in queues]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order


# ------------------------------------------------------------------------------------- admission

def test_a_burst_is_refused_at_once_and_admitted_again_when_load_drops():
    model, _ = gpt_recording_prompts()
    engine = GenerationEngine(model, CPU, max_batch_size=1, max_wait_s=0.5)
    engine.start()
    long = Sampling(max_tokens=30, temperature=0)

    async def held(body):
        """Run `body` while the worker is held after the first decoding step of a 30-token request."""
        gate = Gate(1)
        engine.observe_batch = gate
        filler = asyncio.ensure_future(collect(engine.stream(list(b"filler"), long)))
        await gate.wait(1)
        try:
            return await body()
        finally:
            gate.release(1)
            await filler

    async def cold():
        assert engine._per_s() is None  # nothing measured yet: one batch (1 request) may wait
        admitted = engine.stream(list(b"one"), long)
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as refused:
            engine.stream(list(b"two"), long)
        return admitted, refused.value, time.monotonic() - t0

    async def measured():
        per_s = engine._per_s()  # requests per second, measured while the one slot was taken:
        # tokens per second over the tokens a request gets (30 each here)
        assert engine._tokens_per_request.value == 30 and per_s == pytest.approx(engine.rate.per_s / 30)
        engine.max_wait_s = 5.5 / per_s  # room for 5.5 requests' worth of waiting
        admitted = []
        with pytest.raises(Overloaded) as refused:
            while len(admitted) < 50:
                admitted.append(engine.stream(list(b"q%02d" % len(admitted)), long))
        engine.precheck("another")  # another client would wait for one of these, not all: admitted
        with pytest.raises(Overloaded):
            engine.precheck("")  # what a route asks before it parses a body: refused as the stream was
        return per_s, admitted, refused.value

    async def body():
        admitted, refused, took = await held(cold)
        assert refused.retry_after_s == 1.0 and not isinstance(refused, QueueFull) and took < 1.0
        await collect(admitted)
        # Measured afresh, without the held step: the gate's hold would count as the model's time.
        engine.rate = Rate()
        for i in range(2):
            await collect(engine.stream(list(b"warm%d" % i), long))
        per_s, queued, refused = await held(measured)
        await asyncio.gather(*(collect(q) for q in queued))
        while engine._free_units() == 0:  # the last answer is out; its slot is freed just after
            await asyncio.sleep(0.001)
        engine.max_wait_s = 0.5
        again = await collect(engine.stream(list(b"again"), GREEDY))  # nothing waits: admitted at once
        await engine.stop()
        return per_s, queued, refused, again

    per_s, queued, refused, again = run(body())
    # 5 fit in 5.5 requests' worth of waiting, the 6th would wait 6 / per_s: 0.5 / per_s past the target.
    assert len(queued) == 5 and refused.retry_after_s == pytest.approx(0.5 / per_s)
    assert engine.stats.rejected == 3 and len(again[0]) == 6


def test_the_rate_is_units_over_a_decaying_window_of_time():
    rate = Rate(tau_s=1.0)
    rate.record(10, 0.5)
    assert rate.per_s is None  # one stretch is not enough to trust
    for _ in range(9):
        rate.record(10, 0.5)
    assert rate.per_s == pytest.approx(20)  # a steady 20/s reads 20/s, however it was cut
    for _ in range(6):  # 3 time constants at 40/s
        rate.record(20, 0.5)
    weight = [math.exp(-0.5 * j) for j in range(16)]  # of the sample j records before the newest
    units = sum(20 * weight[j] for j in range(6)) + sum(10 * weight[j] for j in range(6, 16))
    assert rate.per_s == pytest.approx(units / (0.5 * sum(weight)))
    assert 38 < rate.per_s < 40


def test_a_classifier_burst_is_refused_past_one_batch_of_rows_at_a_cold_start():
    model = RecordingRows()
    engine = BatchingEngine(model, CPU, max_batch_size=2, max_queue_delay_ms=0, max_wait_s=0.5)
    engine.start()

    async def body():
        first = asyncio.ensure_future(engine.infer(row(0)))
        assert await asyncio.to_thread(model.entered.wait, 30)  # a batch runs: no row can start at once
        waiting = [asyncio.ensure_future(engine.infer(row(i))) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await engine.infer(row(3))
        model.go.set()
        await asyncio.gather(first, *waiting)
        await engine.stop()

    run(body())
    assert model.calls == [[0], [1, 2]] and engine.stats.rejected == 1


# ------------------------------------------------------------------- deadline and departure while queued

def test_a_request_whose_deadline_passes_in_the_queue_leaves_it_before_the_model_is_free():
    engine, gate, prompts = held_one_slot_engine()

    async def body():
        running = asyncio.ensure_future(collect(engine.stream(list(b"running"), GREEDY)))
        await gate.wait(1)  # the one slot is taken and the worker is held
        late = engine.stream(list(b"late"), GREEDY, deadline=time.monotonic() + 0.05)
        with pytest.raises(DeadlineExceeded):
            await collect(late)  # answered while the worker is still held: the queue let it go
        depth = engine.queue_depth()
        gate.release(1)
        await running
        await engine.stop()
        return depth

    assert run(body()) == 0
    assert prompts == [b"running"] and engine.stats.expired == 1  # the late one never reached the model


def test_a_caller_that_leaves_takes_its_request_out_of_the_queue():
    engine, gate, prompts = held_one_slot_engine()

    async def body():
        running = asyncio.ensure_future(collect(engine.stream(list(b"running"), GREEDY)))
        await gate.wait(1)
        waiting = asyncio.ensure_future(engine.complete(list(b"gone"), GREEDY))
        await asyncio.sleep(0.01)
        assert engine.queue_depth() == 1
        waiting.cancel()  # what a disconnected client's handler gets
        await asyncio.gather(waiting, return_exceptions=True)
        depth = engine.queue_depth()
        gate.release(1)
        await running
        await engine.stop()
        return depth

    assert run(body()) == 0
    assert prompts == [b"running"] and engine.stats.cancelled == 1


# --------------------------------------------------------------------------------- fairness, priority

def test_a_light_client_gets_every_other_decode_slot_however_many_the_heavy_one_queued():
    engine, gate, prompts = held_one_slot_engine()
    heavy = [b"heavy %02d" % i for i in range(9)]
    light = [b"light %02d" % i for i in range(3)]

    async def body():
        streams = [engine.stream(list(heavy[0]), GREEDY, client="heavy")]
        await gate.wait(1)  # heavy's first runs; the rest of heavy's queue first, then light's
        streams += [engine.stream(list(p), GREEDY, client="heavy") for p in heavy[1:]]
        streams += [engine.stream(list(p), GREEDY, client="light") for p in light]
        gate.release(1)
        await asyncio.gather(*(collect(s) for s in streams))
        await engine.stop()

    run(body())
    assert prompts == [heavy[0]] + round_robin(light, heavy[1:])
    assert prompts != heavy + light  # what one first-come queue gives


def test_a_batch_shares_its_rows_among_the_waiting_clients():
    model = RecordingRows()
    engine = BatchingEngine(model, CPU, max_batch_size=4, max_queue_delay_ms=0)
    engine.start()
    heavy, light = list(range(1, 13)), [101, 102, 103]

    async def body():
        first = asyncio.ensure_future(engine.infer(row(0), client="heavy"))
        assert await asyncio.to_thread(model.entered.wait, 30)
        tasks = [asyncio.ensure_future(engine.infer(row(t), client="heavy")) for t in heavy]
        tasks += [asyncio.ensure_future(engine.infer(row(t), client="light")) for t in light]
        await asyncio.sleep(0.01)  # all queued while the first batch runs
        model.go.set()
        await asyncio.gather(first, *tasks)
        await engine.stop()

    run(body())
    served = round_robin(heavy, light)
    assert model.calls == [[0]] + [served[i:i + 4] for i in range(0, len(served), 4)]
    assert model.calls[1] == [1, 101, 2, 102]  # first-come would fill it with heavy's 1..4
    # The service rate was measured over the three batches that left requests waiting (saturated),
    # not the first (taken after waiting for work) nor the last (3 rows, nothing left behind).
    assert engine.rate.samples == 3 and engine.rate.per_s > 0


def test_priority_orders_a_clients_own_share_and_not_anothers():
    engine, gate, prompts = held_one_slot_engine()
    # (prompt, priority) in arrival order; lower is served earlier. Prompts of one length: requests that cost alike
    mine = [(b"a-late-5", 5), (b"b-first1", -1), (b"c-later5", 5), (b"d-second", 0)]
    other = [(b"x-other0", 0), (b"y-other0", 0)]

    async def body():
        streams = [engine.stream(list(b"running0"), GREEDY, client="other")]
        await gate.wait(1)
        streams += [engine.stream(list(p), GREEDY, client="mine", priority=k) for p, k in mine]
        streams += [engine.stream(list(p), GREEDY, client="other", priority=k) for p, k in other]
        gate.release(1)
        await asyncio.gather(*(collect(s) for s in streams))
        await engine.stop()

    run(body())
    by_priority = [p for p, _ in sorted(mine, key=lambda pk: pk[1])]  # a stable sort: arrival breaks ties
    assert by_priority == [b"b-first1", b"d-second", b"a-late-5", b"c-later5"]
    assert prompts == [b"running0"] + round_robin(by_priority, [p for p, _ in other])


def test_the_fair_queue_counts_what_waits_and_estimates_what_is_ahead():
    class R:
        def __init__(self, client, units=1, priority=0):
            self.client, self.units, self.priority = client, units, priority

    q = FairQueue()
    heavy = [R("heavy") for _ in range(10)]
    for r in heavy:
        q.push(r)
    light = R("light")
    assert q.ahead("light", 1) == 1 and q.ahead("heavy", 1) == 10  # light waits for one of heavy's
    assert q.ahead("light", 3) == 3  # a larger request of light's waits for as many units of heavy's
    q.push(light)
    assert q.ahead("heavy", 1) == 11 and q.ahead("light", 1) == 3
    assert q.remove(heavy[3]) and not q.remove(heavy[3]) and (len(q), q.units) == (10, 10)
    assert q.remove(light) and q.ahead("light", 1) == 1
    while q:
        q.charge(q.pop().client, 1)
    assert (len(q), q.units, q.head()) == (0, 0, None)
