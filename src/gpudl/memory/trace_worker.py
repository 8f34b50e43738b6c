"""`python -m gpudl.memory.trace_worker WORLD`: trace configs as rank 0 of a job of WORLD fake processes.

Reads one JSON request per line ({"config": TOML text}) and answers each with one line:
{"parts": {category: bytes}} or {"error": "..."}. Its default process group is torch's fake one:
collectives return at once, so gpudl's real sharding and tensor-parallel code runs with nobody
else there.
"""

from __future__ import annotations

import json
import sys
import tomllib

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..config import config_from_dict
from ..device import cpu_info
from ..distributed.env import DistEnv
from ..training.job import model_and_data
from ..training.session import Session, plan_parallel
from .trace import trace_step


def trace_as_rank_zero(text: str, world: int) -> dict[str, int]:
    cfg = config_from_dict(tomllib.loads(text))
    session = Session(cpu_info(), env=DistEnv(0, world, 0, world))
    plan_parallel(session, cfg.parallel)
    _, data = model_and_data(cfg, *session.dp)
    return trace_step(cfg, session, data.train.batch(0))


def main() -> None:
    world = int(sys.argv[1])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        for line in sys.stdin:
            try:
                answer = {"parts": trace_as_rank_zero(json.loads(line)["config"], world)}
            except Exception as e:  # noqa: BLE001 -- the asking process reports it in one line
                answer = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
            print(json.dumps(answer), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
