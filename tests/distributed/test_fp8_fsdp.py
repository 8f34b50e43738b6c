"""precision = "fp8" with recipe tensorwise under FSDP2, on 2 Gloo processes: the weights all-gathered
in float8 (torchao's `enable_fsdp_float8_all_gather`), their scales precomputed after each optimizer
step, checkpoints written in the background, and the losses those of one process on the whole batch.

No CPU has fp8 tensor cores: both sides run torchao's emulated float8 matmuls (`bodies.train_fp8_emulated`),
which compute what the tensor cores compute, in higher precision. On GPUs: scripts/gpu-check's `fp8` phase.
"""

from __future__ import annotations

import pytest

from helper import run_ranks

pytest.importorskip("torchao", reason="precision fp8 needs torchao (the test extra installs it)")

FP8 = ["train.precision=fp8", "train.fp8_recipe=tensorwise", "checkpoint.export=false"]


@pytest.mark.slow
def test_fsdp_all_gathers_float8_weights_and_trains_as_one_process(tmp_path):
    ranks = run_ranks("train_fp8_emulated", 2, tmp_path / "fsdp", sets=[
        *FP8, "parallel.dp_shard=2", "train.batch_size=2", f"run.dir={tmp_path / 'runs'}", "run.name=fsdp"])
    one = run_ranks("train_fp8_emulated", 1, tmp_path / "one", alone=True,
                    sets=[*FP8, "train.batch_size=4", f"run.dir={tmp_path / 'runs'}"])[0]
    blocks = [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc",
                                                          "mlp.proj")]
    for got in ranks:
        assert got["float8"] == got["sharded"] == got["cast_in_fp8"] == sorted(blocks)  # gathered in fp8
        assert got["precomputed"] == sorted(blocks)  # the optimizer's post-step hook set every scale
        assert got["losses"] == ranks[0]["losses"]
    assert one["float8"] == sorted(blocks) and one["cast_in_fp8"] == []  # no FSDP: plain weights
    # Not equal: each rank scales its own half of the batch's activations (one scale per tensor).
    for step, loss in one["losses"].items():
        assert abs(ranks[0]["losses"][step] - loss) < 5e-3 * loss, step
    assert ranks[0]["losses"][10] < ranks[0]["losses"][1] - 0.4
    # Its checkpoint (float8-cast weights, written in the background) resumed by one process in bf16-mixed
    later = run_ranks("train_fp8_emulated", 1, tmp_path / "later", alone=True, resume=str(tmp_path / "runs" / "fsdp"),
                      sets=["train.precision=bf16-mixed", "train.batch_size=4", "train.max_steps=12",
                            "checkpoint.export=false", f"run.dir={tmp_path / 'runs'}"])[0]
    assert sorted(later["losses"]) == [11, 12] and later["float8"] == []
    assert abs(later["losses"][11] - ranks[0]["losses"][10]) < 0.1 * ranks[0]["losses"][10]
