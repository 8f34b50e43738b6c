"""gpudl.fit on several processes: each trains on its share of every batch, as one process on the whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bodies import fit_hf_gpt2, fit_user_model
from helper import need_devices, run_ranks, tolerance


@pytest.mark.parametrize("parallel", [{}, {"dp_shard": 2}], ids=["ddp", "fsdp"])
def test_fit_on_two_processes_equals_one_on_the_full_batch(tmp_path, device, parallel):
    need_devices(device, 2)
    want = fit_user_model(batch_size=32, device=device)
    ranks = run_ranks("fit_user_model", 2, tmp_path, device, batch_size=16, parallel=parallel)
    tol = tolerance(device)
    assert ranks[0]["losses"] == pytest.approx(want["losses"], abs=tol)
    for name, p in want["params"].items():
        assert torch.allclose(ranks[0]["params"][name], p.cpu(), atol=tol, rtol=0), name


def test_fit_of_a_module_larger_than_the_device_memory_plans_cpu_offload_and_trains(tmp_path, accelerator):
    """Under a limit below its training state, fit(plan="auto") keeps the weights, gradients and AdamW
    state in host memory (FSDP over this one process, a group gpudl makes) and trains without running
    out: the shards are on the host, no step ran out of memory, and the losses are those of the same fit
    with no limit, on the device alone (the update runs on the host's fused AdamW there)."""
    got = run_ranks("fit_planned_under_its_training_state", 1, tmp_path, accelerator, alone=True)[0]
    assert got["shards_on"] == ["cpu"] and got["ooms"] == []
    assert len(got["losses"]) == 6 and got["losses"] == pytest.approx(got["plain_losses"], abs=1e-3)


@pytest.mark.parametrize("parallel, data", [({}, "dataloader"), ({"dp_shard": 2}, "columns")],
                         ids=["ddp-dataloader", "fsdp-dict-columns"])
def test_fit_of_a_hugging_face_gpt2_on_two_processes_equals_one(tmp_path, parallel, data):
    """Dict batches and the model's own loss (a ModelOutput), split over two ranks, as one process
    on the full batch: a dataset's batches are split by rank, a DataLoader's dealt out in turn
    (batches 2k and 2k + 1 of 8 samples are batch k of 16 when it does not shuffle)."""
    pytest.importorskip("transformers")
    want = fit_hf_gpt2(batch_size=16, data=data)
    ranks = run_ranks("fit_hf_gpt2", 2, tmp_path, batch_size=8, parallel=parallel, data=data)
    assert ranks[0]["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert want["losses"][-1] < want["losses"][0] and ranks[0]["mfu"] > 0
    assert want["params"].keys() == ranks[0]["params"].keys()
    for name, p in want["params"].items():
        assert torch.allclose(ranks[0]["params"][name], p, atol=1e-5, rtol=0), name


def test_fit_of_a_hugging_face_gpt2_under_torchrun_equals_one_process(tmp_path):
    """The way a user runs it: their script, started by torchrun itself (its agent, its rendezvous)."""
    pytest.importorskip("transformers")
    script = tmp_path / "train_hf.py"
    script.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from bodies import fit_hf_gpt2\n"
        "result = fit_hf_gpt2(batch_size=8)\n"
        "if os.environ['RANK'] == '0':\n"
        "    torch.save(result, sys.argv[1])\n")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path / "rank0.pt")], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    want = fit_hf_gpt2(batch_size=16)
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5) and want["losses"][-1] < want["losses"][0]
    for name, p in want["params"].items():
        assert torch.allclose(got["params"][name], p, atol=1e-5, rtol=0), name
