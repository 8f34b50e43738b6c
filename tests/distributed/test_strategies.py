"""Each data-parallel strategy, on real processes, against one process training on the full batch.

On the CPU with Gloo; on this machine's accelerators with NCCL (CUDA, ROCm) or XCCL (XPU) where it
has one per rank (skipped, with the reason, elsewhere)."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from bodies import on
from gpudl.config import load_config
from gpudl.run.recipe import train
from helper import need_devices, run_ranks, tolerance

_references: dict = {}


def reference(tmp_path, global_batch: int, device: str = "cpu", *sets: str) -> dict:
    """One process, the whole batch, on the same kind of device: what every parallel layout must reproduce."""
    cfg = load_config(None, on(device, [f"train.batch_size={global_batch}", *sets, f"run.dir={tmp_path}",
                                        "run.name=ref"]))
    result = train(cfg, console=Console(quiet=True))
    return {"losses": {r["step"]: r["loss"] for r in result.records if r["kind"] == "train"},
            "evals": [r for r in result.records if r["kind"] == "eval"],
            "params": {k: v.detach().cpu() for k, v in result.model.state_dict().items()}}


def shared_reference(tmp_path_factory, global_batch: int, device: str, *sets: str) -> dict:
    """`reference`, run once per session for each batch, device and settings."""
    key = (global_batch, device, sets)
    if key not in _references:
        _references[key] = reference(tmp_path_factory.mktemp(f"ref{global_batch}"), global_batch, device, *sets)
    return _references[key]


def assert_same_training(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert got["losses"].keys() == want["losses"].keys()
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=tol), f"loss at step {step}"
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        assert torch.allclose(got["params"][name], p, atol=tol, rtol=0), name


@pytest.mark.parametrize("layout", [["parallel.dp_replicate=2"], ["parallel.dp_shard=2"],
                                    ["parallel.dp_shard=2", "parallel.fsdp_cpu_offload=true"],
                                    # replicas with offload: FSDP2 on a (2, 1) mesh, as beside TP or PP
                                    ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.fsdp_cpu_offload=true"]],
                         ids=["ddp", "fsdp", "fsdp-cpu-offload", "replicas-cpu-offload"])
def test_data_parallel_equals_one_process_on_the_full_batch(tmp_path, tmp_path_factory, device, layout):
    need_devices(device, 2)
    want = shared_reference(tmp_path_factory, 8, device)
    ranks = run_ranks("train_tiny", 2, tmp_path, device,
                      sets=[*layout, f"run.dir={tmp_path}/runs", "run.name=dp"])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # every rank logs the job's (reduced) loss
    assert_same_training(ranks[0], want, tolerance(device))
    if "parallel.fsdp_cpu_offload=true" in layout:
        assert ranks[0]["shards_on"] == ["cpu"]  # FSDP's shards (DTensors), in host memory
    assert ranks[0]["summary"]["samples_per_s"] > 0
    assert ranks[0]["summary"]["device"].startswith(device if device == "cpu" else ("cuda", "rocm", device))


def test_cpu_offload_on_one_process_equals_the_plain_run(tmp_path, tmp_path_factory, device):
    """FSDP's CPU offload asked of a process alone (one device, a model larger than it): FSDP runs over a
    group of one that gpudl makes itself, accumulating the micro-batches' gradients in host memory."""
    want = shared_reference(tmp_path_factory, 8, device)
    got = run_ranks("train_tiny", 1, tmp_path, device, alone=True,
                    sets=["parallel.fsdp_cpu_offload=true", "train.batch_size=4", "train.grad_accum=2",
                          f"run.dir={tmp_path}/runs", "run.name=alone"])[0]
    assert got["summary"]["processes"] == 1
    assert got["shards_on"] == ["cpu"]  # FSDP's shards (DTensors), in host memory
    assert_same_training(got, want, tolerance(device))


def test_hsdp_equals_one_process_on_the_full_batch(tmp_path, tmp_path_factory, device):
    need_devices(device, 4)
    want = shared_reference(tmp_path_factory, 16, device)
    ranks = run_ranks("train_tiny", 4, tmp_path, device, timeout=300,
                      sets=["parallel.dp_replicate=2", "parallel.dp_shard=2", f"run.dir={tmp_path}/runs",
                            "run.name=hsdp"])
    assert_same_training(ranks[0], want, tolerance(device))
