"""`gpudl.fit` keeps its work: checkpoints in its run folder, and a resumed fit that trains as if it
had never stopped, bit for bit on the CPU, for every kind of data it takes.

A run is cut the way a crash cuts it (its newest checkpoint removed: it died after the one before)
or by a real signal to a real process. It is not cut by a shorter max_steps: the cosine schedule
is aimed at max_steps, so a shorter run is another run. Each resumed run is compared with a run
that had no run folder at all, so saving must not change training either. The models have
dropout, so the RNG must be restored too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpudl
from gpudl import UserError
from gpudl.checkpoint import complete_checkpoints

QUIET = dict(device="cpu", precision="fp32", log_every=1, progress=False, quiet=True)


def net(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(width, 3))


def tensors(n: int = 160, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def train_data(kind: str):
    """The same samples as each kind of data fit takes; 12 steps of 32 read them more than twice."""
    x, y = tensors()
    if kind == "tensors":
        return x, y
    if kind == "list":  # 4 batches: the run starts the list again twice, and resumes in its middle
        return [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]
    # shuffled by a generator of its own, so reading it again gives the same passes
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3))


def losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"}


def cut_after(run: Path, step: int) -> None:
    """As if the run had died just after checkpoint `step`: the newer ones gone."""
    for ckpt in complete_checkpoints(run / "checkpoints"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    assert complete_checkpoints(run / "checkpoints")[-1].name == f"step_{step:08d}"


@pytest.mark.parametrize("kind, grad_accum", [("tensors", 1), ("list", 1), ("dataloader", 2)])
def test_a_resumed_fit_trains_as_if_never_stopped(tmp_path, kind, grad_accum):
    kw = dict(loss=F.cross_entropy, max_steps=12, batch_size=32 // grad_accum, grad_accum=grad_accum, lr=1e-2,
              **QUIET)
    whole = gpudl.fit(net(), train_data(kind), **kw)
    run = tmp_path / "run"
    gpudl.fit(net(), train_data(kind), run_dir=run, checkpoint_every=5, **kw)
    assert [c.name for c in complete_checkpoints(run / "checkpoints")] == ["step_00000010", "step_00000012"]
    cut_after(run, 10)
    resumed = gpudl.fit(net(seed=1), train_data(kind), resume=run, checkpoint_every=5, **kw)  # other initial weights
    assert losses(resumed) == {s: v for s, v in losses(whole).items() if s > 10}
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))
    on_disk = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in on_disk if r["kind"] == "train"] == list(losses(whole).values())  # no step twice


def gpt2():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=16, n_positions=16,
                                            bos_token_id=0, eos_token_id=0))  # with its dropout: the RNG matters


def counting(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 16, (n, 1), generator=g) + torch.arange(16)) % 16


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    return {"accuracy": (logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean()}


def test_a_hugging_face_gpt2_resumes_and_validates(tmp_path):
    """Dict batches and the model's own loss; the validation loss and accuracy in the records and the
    summary are the final model's, computed here by a plain loop."""
    ids, held_out = counting(96, 1), counting(40, 2)
    val = [{"input_ids": held_out[i:i + 8], "labels": held_out[i:i + 8]} for i in range(0, 40, 8)]
    kw = dict(max_steps=8, batch_size=8, lr=3e-3, val_data=val, metrics=token_accuracy, eval_every=3, **QUIET)
    whole = gpudl.fit(gpt2(), {"input_ids": ids, "labels": ids}, **kw)
    run = tmp_path / "run"
    gpudl.fit(gpt2(), {"input_ids": ids, "labels": ids}, run_dir=run, checkpoint_every=3, **kw)
    cut_after(run, 6)
    resumed = gpudl.fit(gpt2(), {"input_ids": ids, "labels": ids}, resume=run, **kw)
    assert losses(resumed) == {s: v for s, v in losses(whole).items() if s > 6}
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))
    evals = [r for r in whole.records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6, 8] and [r for r in resumed.records if r["kind"] == "eval"] == evals[2:]
    model = whole.model.eval()
    with torch.no_grad():
        outs = [model(**b) for b in val]
    want_loss = sum(o.loss.item() for o in outs) / len(val)  # batches of equal size
    want_acc = sum(token_accuracy(o.logits, b["labels"])["accuracy"].item() for o, b in zip(outs, val)) / len(val)
    assert evals[-1]["loss"] == pytest.approx(want_loss, abs=1e-6) == resumed.summary["val_loss"]
    assert evals[-1]["accuracy"] == pytest.approx(want_acc, abs=1e-6) == resumed.summary["val_accuracy"]


SCRIPT = """
import sys, torch, torch.nn.functional as F, gpudl
sys.path.insert(0, {here!r})
from test_fit_resume import net, train_data
run, how, out = sys.argv[1:4]
where = {{"resume": run, "checkpoint_every": 100}} if how == "resume" else \\
    {{"run_dir": run, "checkpoint_every": 100}} if how == "cut" else {{}}
result = gpudl.fit(net(), train_data("dataloader"), loss=F.cross_entropy, max_steps=200, batch_size=16, lr=1e-3,
                   device="cpu", precision="fp32", log_every=1, progress=False, **where)
torch.save({{"params": dict(result.model.state_dict()), "losses": {{r["step"]: r["loss"] for r in result.records
            if r["kind"] == "train"}}}}, out)
"""


def logged_steps(run: Path) -> int:
    try:
        return sum('"train"' in line for line in (run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


# SIGTERM only: SIGINT takes the same path (interrupt.StopRequest), tested with both for recipes (test_interrupt.py)
@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["SIGTERM"])
def test_a_signal_saves_and_the_resumed_fit_is_bit_identical(tmp_path, signum):
    """A real process gets a real signal at a random step: it finishes the step, saves, says how to
    resume, and returns; the resumed run ends with the losses and weights of a run never signalled
    (the three in processes of their own, with one thread each: the same kernels)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=str(Path(__file__).parent)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the test session's cache (conftest), one thread each

    def start(how: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), how, str(tmp_path / f"{how}.pt")],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    whole = start("whole")
    cut, step = start("cut"), random.Random(int(signum)).randint(20, 100)  # seeded: a failure can be rerun
    deadline = time.monotonic() + 120
    while logged_steps(tmp_path / "run") < step and cut.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cut.poll() is None, "the run ended before it could be signalled"
    cut.send_signal(signum)
    out, err = cut.communicate(timeout=120)
    assert cut.returncode == 0 and "Traceback" not in err, err[-3000:]
    stopped = int(" ".join(out.split()).split("Stopped at step ")[1].split()[0])
    assert step <= stopped < 200 and f"by {signal.Signals(signum).name}; checkpoint saved" in " ".join(out.split())
    assert f"Resume with: gpudl.fit(model, train_data, ..., resume='{tmp_path / 'run'}')" in " ".join(out.split())
    assert complete_checkpoints(tmp_path / "run" / "checkpoints")[-1].name == f"step_{stopped:08d}"
    resumed = start("resume")
    for proc in (whole, resumed):
        assert proc.wait(timeout=180) == 0, proc.stderr.read()[-3000:]
    want, got = (torch.load(tmp_path / f"{how}.pt", weights_only=True) for how in ("whole", "resume"))
    assert got["losses"] == {s: v for s, v in want["losses"].items() if s > stopped}
    assert all(torch.equal(got["params"][k], p) for k, p in want["params"].items())


class Other(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x)


@pytest.fixture
def finished(tmp_path) -> Path:
    run = tmp_path / "run"
    gpudl.fit(net(), train_data("list"), loss=F.cross_entropy, max_steps=2, batch_size=32, run_dir=run, **QUIET)
    return run


def files(folder: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def refused_resume(run: Path, model=None, data=None, **kwargs) -> str:
    """fit's one line for resuming `run` so; neither the run's files nor the model's weights change."""
    model = model if model is not None else net()
    before, weights = files(run), [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError) as e:
        gpudl.fit(model, train_data("list") if data is None else data, loss=F.cross_entropy, max_steps=4,
                  **{"batch_size": 32, "resume": run, **QUIET, **kwargs})
    assert files(run) == before and all(torch.equal(a, b.detach()) for a, b in zip(weights, model.parameters()))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_generator_cannot_be_resumed(finished):
    batches = train_data("list")
    assert refused_resume(finished, data=(b for b in batches)) == (
        "cannot resume on a generator: it cannot be read again from its start to skip the batches the run consumed; "
        "pass the data as a list of batches, a Dataset, tensors or a DataLoader (in the run and in its resume)")


def test_another_model_is_refused_and_what_differs_is_named(finished):
    ckpt = finished / "checkpoints" / "step_00000002"
    fix = "pass the model the run trained (same class and shapes), or start a new run in another run_dir"
    assert refused_resume(finished, model=net(width=16)) == (
        f"checkpoint {ckpt} holds another torch.nn.modules.container.Sequential: parameter '0.weight' is "
        f"float32[32, 8] there and float32[16, 8] here: {fix}")
    assert refused_resume(finished, model=Other()) == (
        f"checkpoint {ckpt} holds a torch.nn.modules.container.Sequential, but fit got a "
        f"{Other.__module__}.Other: {fix}")


def test_a_run_without_a_checkpoint_is_refused(finished):
    shutil.rmtree(finished / "checkpoints")
    assert refused_resume(finished).startswith(f"nothing to resume: {finished / 'checkpoints'} holds no complete "
                                               f"checkpoint")
    assert refused_resume(finished.parent / "nowhere").startswith("resume='")


def test_other_settings_than_the_run_had_are_named(finished):
    """The run trained on a list of batches of 32 samples; tensors in batches of 16 are other data."""
    assert refused_resume(finished, data=train_data("tensors"), batch_size=16, seed=3) == (
        f"fit(resume={str(finished)!r}) continues a run that had batch_size=32, seed=0, data='list', but this call "
        f"has batch_size=16, seed=3, data='dataset': pass what the run had (with as many processes), or start a new "
        f"run in another run_dir")


def test_resume_and_another_run_dir_are_refused(finished, tmp_path):
    assert refused_resume(finished, run_dir=tmp_path / "elsewhere") == (
        f"resume={str(finished)!r} and run_dir={str(tmp_path / 'elsewhere')!r} name two folders: resume names the "
        f"run it continues, and writes there; pass resume= alone")


def test_resume_auto_starts_a_run_and_then_continues_it(tmp_path):
    """What a script that a preemptible job reruns passes: the first time it starts, then it continues;
    a longer max_steps extends the run."""
    run, kw = tmp_path / "run", dict(loss=F.cross_entropy, batch_size=32, run_dir=tmp_path / "run", resume="auto",
                                     **QUIET)
    first = gpudl.fit(net(), train_data("tensors"), max_steps=3, **kw)
    again = gpudl.fit(net(), train_data("tensors"), max_steps=5, **kw)
    assert first.metrics.steps == 3 and list(losses(again)) == [4, 5] and again.metrics.steps == 5
    assert [c.name for c in complete_checkpoints(run / "checkpoints")] == ["step_00000003", "step_00000005"]
