import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from rich.console import Console

from gpudl.checkpoint.reader import SafeLoadPlanner
from gpudl.checkpoint import complete_checkpoints
from gpudl.checkpoint.files import manifest
from gpudl.errors import UserError
from gpudl.run.recipe import train

QUIET = Console(quiet=True)
RESUMABLE = ["train.max_steps=12", "checkpoint.every=6", "train.log_every=1", "train.eval_every=0",
             "model.dropout=0.1", "sample.tokens=0"]


def losses(records):
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def rewrite_state(ckpt, change) -> None:
    """Change a checkpoint's state.json as gpudl would have written it (its manifest made to match)."""
    state = json.loads((ckpt / "state.json").read_text())
    change(state)
    (ckpt / "state.json").write_text(json.dumps(state))
    (ckpt / "manifest.json").write_text(json.dumps(manifest(ckpt)))


@pytest.mark.parametrize("written_by", ["now", "before world_size"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tiny, device, written_by):
    """On the CPU, bit for bit. An accelerator's kernels may sum in a different order from one run to the
    next (atomics in the embedding's backward, say): there the resumed run must match within 1e-4 here,
    and bit for bit under torch.use_deterministic_algorithms (tests/accelerator). A checkpoint written
    before state.json recorded the saving world size restores its RNG states too (dropout is on)."""
    on = f"run.device={device}"
    full = train(tiny(*RESUMABLE, on, "run.name=full"), console=QUIET)
    cut = train(tiny(*RESUMABLE, on, "run.name=cut"), console=QUIET)
    ckpts = complete_checkpoints(cut.run_dir / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000006", "step_00000012"]
    shutil.rmtree(ckpts[-1])  # as if the run had died after step 6's checkpoint
    assert json.loads((ckpts[0] / "state.json").read_text())["world_size"] == 1
    if written_by != "now":
        rewrite_state(ckpts[0], lambda state: state.pop("world_size"))
    resumed = train(tiny(*RESUMABLE, on, "run.name=cut"), resume=cut.run_dir, console=QUIET)
    want = {s: v for s, v in losses(full.records).items() if s > 6}
    params = list(zip(full.model.parameters(), resumed.model.parameters()))
    assert next(resumed.model.parameters()).device.type == torch.device(device).type
    if device == "cpu":
        assert losses(resumed.records) == want
        assert all(torch.equal(a, b) for a, b in params)
    else:
        assert losses(resumed.records) == pytest.approx(want, abs=1e-4)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in params)
    on_disk = [json.loads(line) for line in (cut.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on_disk if r["kind"] == "train"] == list(range(1, 13))  # no duplicates


def test_a_run_folder_in_use_is_never_overwritten(tiny):
    first = train(tiny("run.name=same", "train.max_steps=2"), console=QUIET)
    before = {p.name: p.stat().st_mtime_ns for p in first.run_dir.iterdir()}
    with pytest.raises(UserError, match="already holds a run: continue it with --resume"):
        train(tiny("run.name=same", "train.max_steps=2"), console=QUIET)
    assert {p.name: p.stat().st_mtime_ns for p in first.run_dir.iterdir()} == before


@pytest.fixture
def finished(tiny):
    return train(tiny("run.name=done", "train.max_steps=4", "checkpoint.every=2"), console=QUIET)


def test_only_the_newest_checkpoints_are_kept(finished):
    assert [c.name for c in complete_checkpoints(finished.run_dir / "checkpoints")] == \
        ["step_00000002", "step_00000004"]


def test_a_half_written_checkpoint_is_ignored(finished):
    ckpts = finished.run_dir / "checkpoints"
    (ckpts / "step_00000006.tmp").mkdir()
    (ckpts / "step_00000006.tmp" / "__0_0.distcp").write_bytes(b"partial")
    incomplete = ckpts / "step_00000008"
    shutil.copytree(ckpts / "step_00000004", incomplete)
    (incomplete / "manifest.json").unlink()  # the manifest is written last: no manifest, no checkpoint
    assert complete_checkpoints(ckpts)[-1].name == "step_00000004"


@pytest.mark.parametrize("damage, words", [
    (lambda f: f.write_bytes(f.read_bytes()[:-100]), "bytes, expected"),
    (lambda f: f.write_bytes(f.read_bytes()[:50] + b"X" + f.read_bytes()[51:]), "wrong checksum"),
    (lambda f: f.unlink(), "is missing"),
])
def test_a_damaged_checkpoint_is_refused_and_left_alone(tiny, finished, damage, words):
    newest = complete_checkpoints(finished.run_dir / "checkpoints")[-1]
    damage(next(newest.glob("*.distcp")))
    files_before = sorted(p.name for p in finished.run_dir.rglob("*"))
    with pytest.raises(UserError, match=f"checkpoint .*step_00000004 is damaged .*{words}"):
        train(tiny("run.name=done", "train.max_steps=6"), resume=finished.run_dir, console=QUIET)
    assert sorted(p.name for p in finished.run_dir.rglob("*")) == files_before


def test_a_world_size_that_its_rng_states_contradict_is_refused(tiny, finished):
    newest = complete_checkpoints(finished.run_dir / "checkpoints")[-1]
    rewrite_state(newest, lambda state: state.update(world_size=2))
    with pytest.raises(UserError, match=r"is damaged \(state.json says 2 processes saved it, but it holds the RNG "
                                        r"states of ranks \[0\]\)"):
        train(tiny("run.name=done", "train.max_steps=6"), resume=finished.run_dir, console=QUIET)


def test_a_checkpoint_of_another_model_is_refused(tiny, finished):
    with pytest.raises(UserError, match="holds another model"):
        train(tiny("run.name=done", "train.max_steps=6", "model.n_layer=3"), resume=finished.run_dir, console=QUIET)


def test_resume_without_a_checkpoint_says_so(tiny, tmp_path):
    empty = tmp_path / "runs" / "empty"
    empty.mkdir(parents=True)
    with pytest.raises(UserError, match="is not a run folder"):
        train(tiny(), resume=empty, console=QUIET)
    (empty / "config.toml").write_text(tiny().to_toml())  # a run that stopped before its first save
    with pytest.raises(UserError, match="nothing to resume"):
        train(tiny(), resume=empty, console=QUIET)


def test_export_writes_the_weights_once_each(finished):
    from safetensors.torch import load_file

    tensors = load_file(finished.run_dir / "model.safetensors")
    named = dict(finished.model.named_parameters())
    assert "lm_head.weight" not in tensors or "wte.weight" not in tensors  # tied: stored once
    for name, t in tensors.items():
        assert torch.equal(t, named[name].detach())


class NotData:
    pass


def test_checkpoints_never_unpickle_arbitrary_objects(tmp_path):
    dcp.save({"x": NotData(), "t": torch.zeros(2)}, checkpoint_id=str(tmp_path))
    target = {"x": None, "t": torch.ones(2)}
    with pytest.raises(CheckpointException) as refused:
        dcp.load(target, checkpoint_id=str(tmp_path), planner=SafeLoadPlanner())
    assert "Unsupported global" in str(refused.value) and target["x"] is None
    ok = {"t": torch.zeros(2), "n": 3}
    dcp.save(ok, checkpoint_id=str(tmp_path / "ok"))
    back = {"t": torch.ones(2), "n": 0}
    dcp.load(back, checkpoint_id=str(tmp_path / "ok"), planner=SafeLoadPlanner())
    assert back["n"] == 3 and torch.equal(back["t"], torch.zeros(2))


def test_the_saving_world_size_is_read_or_inferred_from_the_rng_states(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from gpudl.checkpoint.streams import rng_note, saved_world

    def holding(*keys):
        return Metadata(state_dict_metadata={k: BytesStorageMetadata() for k in ("model.w", *keys)})

    two = holding("rng_0.cpu", "rng_1.cpu", "rng_1.device")
    assert saved_world(tmp_path, {"world_size": 2}, two) == 2
    assert saved_world(tmp_path, {}, two) == 2  # written before world_size was recorded
    assert saved_world(tmp_path, {}, holding()) is None  # no RNG states at all: nothing to restore
    assert saved_world(tmp_path, {}, holding("rng_1.cpu")) is None  # not ranks 0..n-1: not a world
    with pytest.raises(UserError, match="world_size must be an integer >= 1, got '2'"):
        saved_world(tmp_path, {"world_size": "2"}, two)
    assert rng_note(2, 2) is None
    assert rng_note(None, 2).startswith("The checkpoint holds no RNG states and resumes on 2: random streams")


def test_a_load_without_the_optimizer_still_needs_every_weight(tmp_path):
    """Loading the model alone skips the optimizer's entries, never a weight: one the checkpoint lacks is
    named rather than left as allocated (export and serve allocate without drawing initial values)."""
    import dataclasses

    from gpudl.checkpoint import Checkpointer
    from gpudl.training.loop import TrainState

    saved = torch.nn.Sequential(torch.nn.Linear(4, 4))
    ckpt = Checkpointer(tmp_path, keep=1, model_fingerprint={"name": "mlp"})
    path = ckpt.save(1, saved, torch.optim.AdamW(saved.parameters()),
                     {"train_state": dataclasses.asdict(TrainState(step=1))})
    same = torch.nn.Sequential(torch.nn.Linear(4, 4))
    ckpt.load(path, same, optimizer=None)
    assert torch.equal(same[0].weight, saved[0].weight)
    larger = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(UserError, match=r"is damaged \(it holds no model\.1\.weight \(and 1 more\), which this "
                                        r"model has\)"):
        ckpt.load(path, larger, optimizer=None)
