"""The serving engine with real threads and real event loops: dynamic batching gives each caller
what the model gives its rows alone; continuous batching gives each request the tokens it gets
alone, and those equal a plain no-cache reference; limits (queue, deadlines, stop) hold.

Where a test must know which decoding step the worker is at, it holds the worker in the engine's
own batch-size hook (which the worker thread calls after each model call) until the test has
done its part: the engine runs unchanged, only its timing is pinned.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from torch import nn

from gpudl import models
from gpudl.serve.batching import BatchingEngine
from gpudl.serve.engine import BadInput, DeadlineExceeded, EngineStopped, QueueFull
from gpudl.serve.generation import GenerationEngine, Sampling, sample

CPU = torch.device("cpu")
BLOCK = 64


def run(coro, timeout: float = 60):
    """Run a test body on a fresh event loop; a hang fails the test instead of blocking the run."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def resnet():
    spec = models.resolve("resnet18", {"width": 8, "num_classes": 10})
    model = models.build(spec, CPU, seed=1).eval()
    with torch.no_grad():  # non-trivial batch-norm statistics, so eval mode is really exercised
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def gpt():
    spec = models.resolve("gpt-tiny", {"n_layer": 2, "d_model": 32, "n_head": 2, "block_size": BLOCK})
    model = models.build(spec, CPU, seed=3).eval()
    with torch.no_grad():  # sharper attention than at initialisation, so a wrong key or value changes tokens
        for block in model.blocks.values():
            block.attn.wq.weight.mul_(8)
            block.attn.wk.weight.mul_(8)
            block.attn.wv.weight.mul_(8)
    return model


def images(*rows: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, 16, 16, generator=g) for n in rows]  # (N, C, H, W) each


class Gate:
    """The engine's batch hook: records each model call's size and holds the worker after the
    calls numbered in `at` (1-based) until `release` is called."""

    def __init__(self, *at: int):
        self.sizes: list[int] = []
        self.reached = {k: threading.Event() for k in at}
        self.go = {k: threading.Event() for k in at}

    def __call__(self, size: int) -> None:
        self.sizes.append(size)
        k = len(self.sizes)
        if k in self.reached:
            self.reached[k].set()
            assert self.go[k].wait(30), "the test never released the worker"

    async def wait(self, k: int) -> None:
        assert await asyncio.to_thread(self.reached[k].wait, 30)

    def release(self, k: int) -> None:
        self.go[k].set()


class Blocking(nn.Module):
    """A model whose forward waits until the test lets it finish; counts the rows it ran."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.entered, self.go, self.rows = threading.Event(), threading.Event(), 0

    def forward(self, x):
        self.entered.set()
        assert self.go.wait(30)
        self.rows += len(x)
        return x.flatten(1) * self.scale


# ---------------------------------------------------------------- dynamic batching (classifiers)

def test_concurrent_requests_run_as_one_batch_and_each_gets_its_own_rows(resnet):
    xs = images(1, 2, 1, 3, 1)  # 8 rows from 5 requests
    engine = BatchingEngine(resnet, CPU, max_batch_size=8, max_queue_delay_ms=2000)
    engine.start()

    async def body():
        outs = await asyncio.gather(*(engine.infer(x) for x in xs))
        await engine.stop()
        return outs

    outs = run(body())
    # All five in one model call: the batch filled to max_batch_size rows before the 2 s delay.
    assert engine.stats.batch_sizes == {8: 1} and engine.stats.requests == 5
    with torch.inference_mode():
        alone = [resnet(x) for x in xs]
    for out, ref in zip(outs, alone):
        assert out.shape == ref.shape and out.dtype == torch.float32
        # Not bit-exact on the CPU: oneDNN picks its convolution blocking by batch size, so the
        # reductions run in another order for 8 rows than for 1 (measured: about 1e-7 of the
        # largest logit). Within 1e-6 of the largest logit, per request.
        assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()
    # The check can fail: the requests' logits differ by far more than that tolerance.
    assert (alone[0] - alone[2]).abs().max() > 1e-3 * alone[0].abs().max()


def test_a_batch_never_splits_a_request_and_closes_after_the_delay(resnet):
    xs = images(3, 3, 3)
    engine = BatchingEngine(resnet, CPU, max_batch_size=8, max_queue_delay_ms=1)
    gate = Gate()
    engine.observe_batch = gate
    engine.start()

    async def body():
        outs = await asyncio.gather(*(engine.infer(x) for x in xs))
        lone = await engine.infer(xs[0][:1])  # alone: the delay, not a full batch, closes it
        await engine.stop()
        return outs, lone

    outs, lone = run(body())
    assert gate.sizes == [6, 3, 1]  # 3 + 3 fit in 8 rows, the third request waits whole
    with torch.inference_mode():
        ref = resnet(xs[0][:1])
    assert (lone - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert [o.shape[0] for o in outs] == [3, 3, 3]


@pytest.mark.parametrize("x, says", [
    (torch.zeros(3, 16, 16), "(N, C, H, W)"),
    (torch.zeros(1, 3, 16, 16, dtype=torch.float64), "float32"),
    (torch.zeros(0, 3, 16, 16), "1 to 4"),
    (torch.zeros(5, 3, 16, 16), "1 to 4"),
    (torch.zeros(1, 1, 16, 16), "[-1, 3, 16, 16]"),
    ([[0.0]], "tensor"),
])
def test_bad_input_names_the_field(resnet, x, says):
    engine = BatchingEngine(resnet, CPU, max_batch_size=4, input_shape=(3, 16, 16), input_name="images")
    engine.start()

    async def body():
        try:
            with pytest.raises(BadInput) as e:
                await engine.infer(x)
            return e.value
        finally:
            await engine.stop()

    error = run(body())
    assert error.field == "images" and says in error.message


def test_full_queue_refuses_at_once_and_the_rest_are_answered():
    model = Blocking()
    engine = BatchingEngine(model, CPU, max_batch_size=1, max_queue=2, max_queue_delay_ms=0)
    engine.start()

    async def body():
        first = asyncio.ensure_future(engine.infer(torch.ones(1, 1, 2, 2)))
        assert await asyncio.to_thread(model.entered.wait, 30)  # the worker holds the first one
        queued = [asyncio.ensure_future(engine.infer(torch.full((1, 1, 2, 2), float(i)))) for i in (2, 3)]
        await asyncio.sleep(0)  # both reach the queue
        with pytest.raises(QueueFull):
            await engine.infer(torch.ones(1, 1, 2, 2))
        assert engine.queue_depth() == 2
        model.go.set()
        outs = await asyncio.gather(first, *queued)
        await engine.stop()
        return outs

    outs = run(body())
    assert [float(o[0, 0]) for o in outs] == [1.0, 2.0, 3.0]
    assert engine.stats.rejected == 1 and engine.stats.requests == 3


def test_a_request_past_its_deadline_is_refused_and_not_run():
    model = Blocking()
    engine = BatchingEngine(model, CPU, max_batch_size=4, max_queue_delay_ms=0)
    engine.start()

    async def body():
        first = asyncio.ensure_future(engine.infer(torch.ones(2, 1, 2, 2)))
        assert await asyncio.to_thread(model.entered.wait, 30)
        late = asyncio.ensure_future(engine.infer(torch.ones(3, 1, 2, 2), deadline=time.monotonic() + 0.01))
        await asyncio.sleep(0.05)  # its deadline passes while the model is busy with the first
        model.go.set()
        await first
        with pytest.raises(DeadlineExceeded):
            await late
        await engine.stop()

    run(body())
    assert model.rows == 2 and engine.stats.expired == 1  # the late request's 3 rows never ran


def test_stop_answers_what_was_accepted_and_refuses_new_requests():
    model = Blocking()
    engine = BatchingEngine(model, CPU, max_batch_size=1, max_queue_delay_ms=0)
    engine.start()

    async def body():
        accepted = [asyncio.ensure_future(engine.infer(torch.full((1, 1, 1, 1), float(i)))) for i in range(3)]
        assert await asyncio.to_thread(model.entered.wait, 30)
        stopping = asyncio.ensure_future(engine.stop(timeout_s=30))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineStopped):
            await engine.infer(torch.ones(1, 1, 1, 1))
        model.go.set()
        outs = await asyncio.gather(*accepted)
        await stopping
        return outs

    assert [float(o) for o in run(body())] == [0.0, 1.0, 2.0]


def test_stop_past_its_timeout_fails_what_is_still_queued():
    model = Blocking()
    engine = BatchingEngine(model, CPU, max_batch_size=1, max_queue_delay_ms=0)
    engine.start()

    async def body():
        accepted = [asyncio.ensure_future(engine.infer(torch.ones(1, 1, 1, 1))) for _ in range(3)]
        assert await asyncio.to_thread(model.entered.wait, 30)
        threading.Timer(0.2, model.go.set).start()  # the running batch ends after stop's 0.05 s
        await engine.stop(timeout_s=0.05)
        return await asyncio.gather(*accepted, return_exceptions=True)

    first, *rest = run(body())
    assert isinstance(first, torch.Tensor) and all(isinstance(r, EngineStopped) for r in rest)


# ------------------------------------------------------------- generation (continuous batching)

def reference_tokens(model, prompt: list[int], n: int, sampling: Sampling | None = None) -> list[int]:
    """Without a cache: the whole sequence through the model for every new token, then argmax (or
    the same sampler, seeded alike); at most until the context is full."""
    sampling = sampling or Sampling(max_tokens=n, temperature=0)
    g = torch.Generator().manual_seed(sampling.seed or 0)
    ids = list(prompt)
    with torch.inference_mode():
        while len(ids) - len(prompt) < n and len(ids) < BLOCK:
            logits = model(torch.tensor([ids]))[0, -1].float()  # (V,)
            ids.append(sample(logits, sampling, g))
    return ids[len(prompt):]


PROMPTS = [list(b"def main("), list(b"import torch\n"), list(b"x"), list(b"class GPT(nn.Module):\n    ")]


async def collect(stream) -> tuple[list[int], str]:
    ids, finish = [], None
    async for token, _, why in stream:
        if token is not None:
            ids.append(token)
        finish = why or finish
    return ids, finish


def staggered(engine: GenerationEngine, requests: list[tuple[list[int], Sampling]], joins: list[int]):
    """Request 0 starts alone; request i joins after decoding step joins[i-1] (the worker is held
    there until it is queued). Returns [(ids, finish)] in request order and the step sizes."""
    gate = Gate(*joins)
    engine.observe_batch = gate
    engine.start()

    async def body():
        tasks = [asyncio.ensure_future(collect(engine.stream(*requests[0])))]
        for step, request in zip(joins, requests[1:]):
            await gate.wait(step)
            tasks.append(asyncio.ensure_future(collect(engine.stream(*request))))
            await asyncio.sleep(0)  # queued before the worker goes on
            gate.release(step)
        results = await asyncio.gather(*tasks)
        await engine.stop()
        return results

    return run(body()), gate.sizes


def alone(model, prompt: list[int], sampling: Sampling) -> tuple[list[int], str]:
    engine = GenerationEngine(model, CPU, max_batch_size=4)
    engine.start()

    async def body():
        done = await engine.complete(prompt, sampling)
        await engine.stop()
        return done.ids, done.finish

    return run(body())


def test_greedy_tokens_alone_equal_the_no_cache_reference(gpt):
    for prompt in PROMPTS:
        ids, finish = alone(gpt, prompt, Sampling(max_tokens=30, temperature=0))
        assert ids == reference_tokens(gpt, prompt, 30) and finish == "length"


def test_greedy_tokens_are_the_same_when_requests_join_and_leave(gpt):
    lengths = [40, 6, 25, 12]
    requests = [(p, Sampling(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, lengths)]
    results, sizes = staggered(GenerationEngine(gpt, CPU, max_batch_size=4), requests, joins=[3, 5, 9])
    # Sequences per decoding step: request i runs in steps joins[i-1]+1 .. joins[i-1]+max_tokens-1
    # (its first token comes from its prefill), so each joins at the step after it was queued and
    # leaves right after its last token.
    starts = [0, 3, 5, 9]
    assert sizes == [sum(j < k <= j + n - 1 for j, n in zip(starts, lengths)) for k in range(1, 40)]
    for (prompt, sampling), (ids, finish) in zip(requests, results):
        assert ids == reference_tokens(gpt, prompt, sampling.max_tokens) == alone(gpt, prompt, sampling)[0]
        assert finish == "length"


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(gpt):
    sampled = [Sampling(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=s) for s in (11, 12, 13)]
    requests = list(zip(PROMPTS, sampled))
    results, _ = staggered(GenerationEngine(gpt, CPU, max_batch_size=4), requests, joins=[2, 7])
    for (prompt, sampling), (ids, _) in zip(requests, results):
        assert ids == alone(gpt, prompt, sampling)[0] == reference_tokens(gpt, prompt, 20, sampling)
    other = alone(gpt, PROMPTS[0], Sampling(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=99))[0]
    assert other != results[0][0]  # the seed matters: another one draws other tokens


def test_prompts_of_one_length_are_prefilled_together_and_give_the_same_tokens(gpt):
    prompts = [list(b"def main("), list(b"import to"), list(b"x = 1 + 2"), list(b"class GPT")]
    samplings = [Sampling(max_tokens=12, temperature=0), Sampling(max_tokens=1, temperature=0),  # leaves at once
                 Sampling(max_tokens=10, temperature=0.9, top_k=40, seed=5), Sampling(max_tokens=15, temperature=0)]
    engine, calls = GenerationEngine(gpt, CPU, max_batch_size=4), []
    prefill = gpt.prefill
    engine.model = type("Recorded", (), {"prefill": lambda self, ids, *a: calls.append(ids.shape) or prefill(ids, *a),
                                         "decode": lambda self, *a: gpt.decode(*a)})()
    engine.start()

    async def body():
        with engine._cond:  # all four queued before the worker takes any
            streams = [engine.stream(p, s) for p, s in zip(prompts, samplings)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        await engine.stop()
        return results

    results = run(body())
    assert calls == [(4, 9)]  # one prefill for the cohort
    for prompt, sampling, (ids, _) in zip(prompts, samplings, results):
        # the one after the sequence that left at its first token moved into its slot: still the same tokens
        assert ids == reference_tokens(gpt, prompt, sampling.max_tokens, sampling) == alone(gpt, prompt, sampling)[0]


def test_sampler_keeps_to_top_k_and_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, Sampling(temperature=0), g) == 0
    drawn = {sample(logits, Sampling(temperature=5.0, top_k=3), g) for _ in range(300)}
    assert drawn == {0, 1, 2}  # hot enough that all six would show without top_k
    p = torch.softmax(logits, 0)  # the two most likely hold more than 0.8; the first alone does not
    assert p[0] < 0.8 < p[0] + p[1]
    assert {sample(logits, Sampling(temperature=1.0, top_p=0.8), g) for _ in range(300)} == {0, 1}


def test_stop_text_ends_generation_and_is_not_returned(gpt):
    prompt = PROMPTS[0]
    full = reference_tokens(gpt, prompt, 40)
    text = bytes(full).decode("utf-8", errors="replace")
    at = next(i for i in range(12, len(text) - 3) if "\ufffd" not in text[i:i + 3])  # past the first characters
    stop = text[at:at + 3]
    cut = text.find(stop)  # the first place the text holds it
    made = next(n for n in range(len(full) + 1) if stop in bytes(full[:n]).decode("utf-8", errors="replace"))
    engine = GenerationEngine(gpt, CPU, max_batch_size=2)
    engine.start()

    async def body():
        streamed = [item async for item in engine.stream(prompt, Sampling(max_tokens=40, temperature=0,
                                                                          stop=("never seen \x00", stop)))]
        whole = await engine.complete(prompt, Sampling(max_tokens=40, temperature=0, stop=(stop,)))
        missing = await engine.complete(prompt, Sampling(max_tokens=40, temperature=0, stop=("\x00\x01never",)))
        await engine.stop()
        return streamed, whole, missing

    streamed, whole, missing = run(body())
    # Generation ends with the token that completes the stop text; the text ends before it.
    assert [t for t, _, _ in streamed if t is not None] == whole.ids == full[:made]
    assert "".join(piece for _, piece, _ in streamed) == whole.text == text[:cut] and streamed[-1].finish == "stop"
    assert whole.finish == "stop" and missing == (full, text, "length")


def test_max_tokens_and_the_context_end_generation(gpt):
    near_end = list(range(97, 97 + BLOCK - 3))  # 3 tokens of room left in the context
    ids, finish = alone(gpt, PROMPTS[0], Sampling(max_tokens=1, temperature=0))
    assert len(ids) == 1 and finish == "length"
    ids, finish = alone(gpt, near_end, Sampling(max_tokens=10, temperature=0))
    assert ids == reference_tokens(gpt, near_end, 10) and len(ids) == 3 and finish == "length"


@pytest.mark.parametrize("prompt, sampling, field", [
    ([], {}, "prompt"),
    ([1] * BLOCK, {}, "prompt"),
    ([1, 256], {}, "prompt"),
    ([1], {"max_tokens": 0}, "max_tokens"),
    ([1], {"temperature": -1.0}, "temperature"),
    ([1], {"top_p": 0.0}, "top_p"),
    ([1], {"top_k": -2}, "top_k"),
    ([1], {"stop": ("",)}, "stop"),
    ([1], {"stop": (b"\n",)}, "stop"),  # texts, not bytes: the stop is found in the decoded text
])
def test_bad_generation_requests_name_the_field(gpt, prompt, sampling, field):
    engine = GenerationEngine(gpt, CPU, max_batch_size=1)
    engine.start()

    async def body():
        try:
            engine.stream(prompt, Sampling(**sampling))
        finally:
            await engine.stop()

    with pytest.raises(BadInput) as e:
        run(body())
    assert e.value.field == field


def test_generation_queue_full_deadline_and_stop_draining(gpt):
    engine = GenerationEngine(gpt, CPU, max_batch_size=1, max_queue=2)
    gate = Gate(2)
    engine.observe_batch = gate
    engine.start()
    greedy = Sampling(max_tokens=8, temperature=0)

    async def body():
        running = engine.stream(PROMPTS[0], greedy)
        await gate.wait(2)  # the one slot is taken; the worker is held after its second step
        late = engine.stream(PROMPTS[1], greedy, deadline=time.monotonic() + 0.01)
        waiting = engine.stream(PROMPTS[2], greedy)
        with pytest.raises(QueueFull):
            engine.stream(PROMPTS[3], greedy)
        await asyncio.sleep(0.05)  # the late one's deadline passes while it waits for the slot
        stopping = asyncio.ensure_future(engine.stop(timeout_s=30))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineStopped):
            engine.stream(PROMPTS[3], greedy)
        gate.release(2)
        first = await collect(running)
        with pytest.raises(DeadlineExceeded):
            await collect(late)
        last = await collect(waiting)
        await stopping
        return first, last

    first, last = run(body())
    assert first == (reference_tokens(gpt, PROMPTS[0], 8), "length")  # in flight at stop: finished whole
    assert last == (reference_tokens(gpt, PROMPTS[2], 8), "length")   # queued at stop: run, then the end
    assert engine.stats.rejected == 1 and engine.stats.expired == 1 and engine.stats.requests == 2


def test_a_stream_left_early_frees_its_slot(gpt):
    engine = GenerationEngine(gpt, CPU, max_batch_size=2)
    gate = Gate(1, 3)
    engine.observe_batch = gate
    engine.start()

    async def body():
        left = engine.stream(PROMPTS[0], Sampling(max_tokens=50, temperature=0))
        await gate.wait(1)
        stays = asyncio.ensure_future(collect(engine.stream(PROMPTS[1], Sampling(max_tokens=12, temperature=0))))
        gate.release(1)
        await gate.wait(3)
        await left.aclose()
        gate.release(3)
        result = await stays
        await engine.stop()
        return result

    ids, _ = run(body())
    assert ids == reference_tokens(gpt, PROMPTS[1], 12)
    assert gate.sizes[:3] == [1, 2, 2] and set(gate.sizes[3:]) == {1}  # gone from the very next step


def test_the_public_api_serves_an_export_from_python(tmp_path, gpt, resnet):
    """What the README shows: gpudl.serve's load_model and make_engine, from an export's files."""
    import dataclasses
    import json

    from gpudl.checkpoint import export_safetensors
    from gpudl.serve import Sampling as PublicSampling, load_model, make_engine

    assert PublicSampling is Sampling
    for name, model in (("gpt-tiny", gpt), ("resnet18", resnet)):
        settings = dataclasses.asdict(model.cfg)
        (tmp_path / name).mkdir()
        export_safetensors(model, tmp_path / name / "model.safetensors",
                           {"gpudl_model": name, "config": json.dumps(settings), "image_size": "16"})

    async def answers():
        engines = [make_engine(load_model(tmp_path / n, device="cpu")) for n in ("gpt-tiny", "resnet18")]
        for e in engines:
            e.start()
        try:
            ids, _, finish = await engines[0].complete(PROMPTS[0], Sampling(max_tokens=6, temperature=0))
            logits = await engines[1].infer(images(3)[0])
        finally:
            for e in engines:
                await e.stop()
        return ids, finish, logits
    ids, finish, logits = run(answers())
    assert (ids, finish) == (reference_tokens(gpt, PROMPTS[0], 6), "length")
    with torch.inference_mode():
        assert torch.allclose(logits, resnet(images(3)[0]), rtol=1e-5, atol=1e-6)
