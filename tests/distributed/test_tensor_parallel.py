"""Tensor parallelism (with and without sequence parallelism, alone and under FSDP or replication)
on real processes, against one process training on the full batch."""

from __future__ import annotations

import pytest

from helper import need_devices, run_ranks, tolerance
from test_strategies import assert_same_training, shared_reference

# TINY's GPT: d_model=32, n_head=2, block_size=32; the MLP is 4 x 32 = 128 wide; batch 4 per data-parallel rank.
SHARDED = {"blocks.0.attn.wq.weight": (16, 32), "blocks.0.attn.wo.weight": (32, 16),
           "blocks.1.mlp.fc.weight": (64, 32), "blocks.1.mlp.proj.weight": (32, 64)}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_equals_one_process(tmp_path, tmp_path_factory, device, sequence_parallel):
    need_devices(device, 2)
    # Both tp ranks train on the same batch: the data-parallel world is 1, so the reference's batch is 4.
    ref4 = shared_reference(tmp_path_factory, 4, device)
    ranks = run_ranks("train_tiny_tp", 2, tmp_path, device,
                      sets=["parallel.tp=2", f"parallel.tp_sequence_parallel={str(sequence_parallel).lower()}",
                            f"run.dir={tmp_path}/runs", "run.name=tp"])
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert_same_training(ranks[0], ref4, tolerance(device))
    layout = ranks[0]["layout"]
    assert {dims for _, _, dims in layout.values()} == {("tp",)}  # every parameter a DTensor on the tp mesh
    for name, local in SHARDED.items():  # really split: each rank holds half of each matrix
        assert layout[name][1] == local, name
    assert "Shard(dim=0)" in layout["blocks.0.attn.wq.weight"][0]
    assert "Shard(dim=1)" in layout["blocks.0.attn.wo.weight"][0]
    for name in ("wte.weight", "wpe.weight", "norm.weight", "blocks.0.norm1.weight"):  # replicated, as DTensors
        assert layout[name][0] == "(Replicate(),)", name
    assert ranks[0]["tied"]  # the head still shares the embedding's weight
    # With sequence parallelism a norm sees half the positions on each rank.
    assert ranks[0]["norm_out"] == ((2, 16, 32) if sequence_parallel else (2, 32, 32))


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.dp_replicate=2"]], ids=["fsdp", "replicate"])
def test_data_parallel_over_tensor_parallel_equals_one_process(tmp_path, tmp_path_factory, device, layout):
    need_devices(device, 4)
    ref8 = shared_reference(tmp_path_factory, 8, device)
    ranks = run_ranks("train_tiny_tp", 4, tmp_path, device, timeout=300,
                      sets=[*layout, "parallel.tp=2", f"run.dir={tmp_path}/runs", "run.name=dpxtp"])
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert_same_training(ranks[0], ref8, tolerance(device))  # 2 data-parallel ranks x batch 4
    # Every parameter is one DTensor over the data-parallel and tp dimensions of the mesh.
    meshes = {dims for _, _, dims in ranks[0]["layout"].values()}
    assert meshes == ({("dp_shard", "tp")} if "parallel.dp_shard=2" in layout else {("dp_replicate", "dp_shard", "tp")})
    placements, local, _ = ranks[0]["layout"]["blocks.0.attn.wq.weight"]
    assert placements.endswith("Shard(dim=0))")  # split by tp over heads; FSDP splits the tp shard again
    assert local == ((8, 32) if "parallel.dp_shard=2" in layout else (16, 32))
