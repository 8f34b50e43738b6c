"""gpudl.fit on several processes: each trains on its share of every batch, as one process on the whole."""

from __future__ import annotations

import pytest
import torch

from bodies import fit_user_model
from helper import run_ranks


@pytest.mark.parametrize("parallel", [{}, {"dp_shard": 2}], ids=["ddp", "fsdp"])
def test_fit_on_two_processes_equals_one_on_the_full_batch(tmp_path, parallel):
    want = fit_user_model(batch_size=32)
    ranks = run_ranks("fit_user_model", 2, tmp_path, batch_size=16, parallel=parallel)
    assert ranks[0]["losses"] == pytest.approx(want["losses"], abs=1e-5)
    for name, p in want["params"].items():
        assert torch.allclose(ranks[0]["params"][name], p, atol=1e-5, rtol=0), name
