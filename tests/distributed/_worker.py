"""One rank of a distributed test: join the group, run the body, save its result."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bodies  # noqa: E402  (the bodies live next to this file)

name, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
backend = os.environ["GPUDL_TEST_BACKEND"]
# The helper's group (file rendezvous), unless the process runs alone (`gpudl train` without torchrun) or
# its ranks join through gpudl's own rendezvous (GPUDL_TEST_GPUDL_JOINS, with MASTER_ADDR as a hand-made
# launch sets it): gpudl then makes the group itself.
if "RANK" in os.environ and not os.environ.get("GPUDL_TEST_GPUDL_JOINS"):
    if os.environ.get("GPUDL_TEST_DEVICE", "cpu") != "cpu":  # one accelerator per rank, as gpudl picks it
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
    # The group is the helper's (file rendezvous), so a test that needs a short collective timeout says so here.
    timeout = timedelta(seconds=float(os.environ.get("GPUDL_TEST_TIMEOUT_S", 300)))
    dist.init_process_group(backend, init_method=os.environ["GPUDL_TEST_INIT"], rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
try:
    result = getattr(bodies, name)(**kwargs)
    torch.save(result, out)
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
# The result is saved and the group destroyed: end now. Python's own shutdown has, rarely,
# aborted a worker at this point ("terminate called without an active exception" from torch's
# C++ teardown), failing a test of training over a race that happens after it. (gpudl's own
# workers, started by torchrun in test_launch.py, exit the normal way.)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
