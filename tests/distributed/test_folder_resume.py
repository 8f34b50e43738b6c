"""Exact resume from a streamed JPEG folder: augmentation drawn from (seed, k, sample), files decoded
by two threads in whatever order they finish, a run cut mid-epoch and resumed must give bit for bit
the losses of the run left alone, in one process and on two Gloo ranks."""

from __future__ import annotations

import pytest

from bodies import train_images
from jpeg_folder import write_jpeg_folder
from helper import run_ranks

pytest.importorskip("PIL")

GLOBAL_BATCH = 8
STEPS, CUT = 9, 4  # 57 training images: 7 batches an epoch, so the cut is mid-epoch and the run crosses into the next


def sets(tmp_path, world: int, steps: int, name: str) -> list[str]:
    return ["model.name=resnet18", f"data.path={tmp_path}/jpegs", "data.image_size=32", "data.num_workers=2",
            "data.augment=true", "data.val_fraction=0.05", "run.seed=3", f"train.batch_size={GLOBAL_BATCH // world}",
            f"train.max_steps={steps}", "train.precision=fp32", "train.compile=false", "train.eval_every=0",
            "train.log_every=1", "train.time_budget_s=0", "optim.warmup_steps=2", "optim.min_lr_ratio=1.0",
            "log.progress=false", "log.plot=false", "checkpoint.export=false", f"checkpoint.every={CUT}",
            f"run.dir={tmp_path}/runs", f"run.name={name}", *([f"parallel.dp_replicate={world}"] if world > 1 else [])]


def on(tmp_path, world: int, tag: str, **kw) -> dict:
    if world == 1:
        return train_images(**kw)
    return run_ranks("train_images", world, tmp_path / tag, timeout=300, **kw)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_cut_and_resumed_run_sees_the_same_crops(tmp_path, world):
    write_jpeg_folder(tmp_path / "jpegs", 60, 3, width=80, height=60)
    whole = on(tmp_path, world, "whole", sets=sets(tmp_path, world, STEPS, "whole"))
    first = on(tmp_path, world, "first", sets=sets(tmp_path, world, CUT, "cut"))
    rest = on(tmp_path, world, "rest", sets=sets(tmp_path, world, STEPS, "cut"), resume=f"{tmp_path}/runs/cut")
    assert sorted(whole["losses"]) == list(range(1, STEPS + 1))
    assert {**first["losses"], **rest["losses"]} == whole["losses"]  # ==: bit for bit, not approximately
    assert sorted(rest["losses"]) == list(range(CUT + 1, STEPS + 1))
