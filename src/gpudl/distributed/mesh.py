"""The parallel degrees of a job, checked once against the number of processes, and its DeviceMesh.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallelism is
innermost so that its heavy traffic stays between neighbouring ranks (the same node).

>>> ParallelDims.resolve(dp_replicate="auto", dp_shard="auto", tp=2, pp=1, world=8)
ParallelDims(dp_replicate=4, dp_shard=1, tp=2, pp=1)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import UserError

NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


def _factors(**degrees) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items())


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @classmethod
    def resolve(cls, *, dp_replicate: int | str, dp_shard: int | str, tp: int, pp: int, world: int,
                shard: bool = False) -> ParallelDims:
        """Fill the "auto" data-parallel degrees with what is left of `world`.

        Both auto: the rest goes to dp_shard (FSDP) when `shard` (the model's training state is
        large for the device), else to dp_replicate (DDP, faster while the model fits).
        """
        fixed = tp * pp * (dp_replicate if dp_replicate != "auto" else 1) * (dp_shard if dp_shard != "auto" else 1)
        given = _factors(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp)
        if world % fixed:
            fits = [d for d in range(1, world + 1) if world % d == 0]
            raise UserError(f"parallel degrees {given} need a number of processes divisible by {fixed}, got {world}: "
                            f"choose degrees whose product divides {world} (divisors: {', '.join(map(str, fits))})")
        rest = world // fixed
        if dp_replicate == "auto" and dp_shard == "auto":
            dp_replicate, dp_shard = (1, rest) if shard else (rest, 1)
        elif dp_replicate == "auto":
            dp_replicate = rest
        elif dp_shard == "auto":
            dp_shard = rest
        elif rest != 1:
            raise UserError(f"parallel degrees {given} multiply to {fixed}, but there are {world} processes: "
                            f"set one degree to auto or make them multiply to {world}")
        return cls(int(dp_replicate), int(dp_shard), tp, pp)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp") if getattr(self, k) > 1]
        return " x ".join(parts) or "one process"

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 4-D mesh over all ranks, and the 1-D mesh of the data-parallel ranks (both dp dims flattened)."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=NAMES)
        # torchtitan's way to name the combined data-parallel ranks; no public API does this yet.
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")
