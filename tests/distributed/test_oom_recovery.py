"""Out-of-memory recovery: a step that runs out of memory is run again from its start with half the
micro-batch, on every rank, and the run goes on as if it had started with the smaller micro-batch.

The error is injected where a real one comes from (a forward, a backward) by a user's module
(`bodies.RunsOutOfMemory`); `test_memory_limit_recovery.py` runs out of gpudl's real memory limit.
"""

from __future__ import annotations

import pytest

from bodies import fit_out_of_memory
from helper import need_devices, run_ranks, tolerance


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_one_process_recovers_with_the_losses_of_the_halved_micro_batch(device, where):
    want = fit_out_of_memory(batch_size=16, grad_accum=2, device=device)
    got = fit_out_of_memory(batch_size=32, at=5, rows=16, where=where, device=device)
    assert got["losses"] == pytest.approx(want["losses"], abs=tolerance(device))
    assert want["ooms"] == [] and len(got["ooms"]) == 1
    oom = got["ooms"][0]
    assert (oom["micro_batch"], oom["halved_to"]) == (32, 16) and 2 <= oom["step"] <= 5, oom
    assert "injected" in oom["error"]


def test_halving_goes_on_until_it_fits_and_stops_at_one_sample():
    got = fit_out_of_memory(batch_size=32, at=1, rows=5)
    assert [(o["micro_batch"], o["halved_to"]) for o in got["ooms"]] == [(32, 16), (16, 8), (8, 4)]
    with pytest.raises(Exception, match="micro-batch of one sample"):
        fit_out_of_memory(batch_size=4, at=1, rows=0)


@pytest.mark.parametrize("parallel, where", [({}, "forward"), ({}, "backward"), ({"dp_shard": 2}, "forward")],
                         ids=["ddp-forward", "ddp-backward", "fsdp-forward"])
def test_two_ranks_agree_and_recover_with_the_losses_of_the_halved_micro_batch(tmp_path, device, parallel, where):
    """Both ranks run out of memory in the same step (the same shapes on each: the usual case)."""
    need_devices(device, 2)
    want = fit_out_of_memory(batch_size=32, grad_accum=2, device=device)  # one process, the whole batch of 64, halves
    ranks = run_ranks("fit_out_of_memory", 2, tmp_path, device, batch_size=32, at=4, rows=16, where=where,
                      parallel=parallel)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(want["losses"], abs=tolerance(device))
        assert [(o["micro_batch"], o["halved_to"]) for o in rank["ooms"]] == [(32, 16)]
