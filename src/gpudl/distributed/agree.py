"""Host-side agreement between the ranks of a job: rank 0's value everywhere, or "did any rank ...".

What ranks exchange here is data, sent as JSON bytes: torch's `broadcast_object_list` would
unpickle what another process sent, and nothing gpudl reads is unpickled.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..device.accel import current_device


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective on `group` takes its tensors: Gloo the CPU's, NCCL, XCCL and the other
    accelerators' backends the current accelerator's."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else current_device()


def broadcast_json(value, group: dist.ProcessGroup | None = None):
    """Rank 0's `value` (anything JSON holds: None, bools, numbers, strings, lists, dicts) on every rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    src = dist.get_global_rank(group, 0) if group is not None else 0
    device = _device(group)
    payload = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.cpu().numpy()))


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when `flag` is true on any (one blocking collective; no job: `flag`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def ranks_where(flag: bool, group: dist.ProcessGroup | None = None) -> list[int]:
    """The ranks (of `group`) where `flag` is true, on every rank (one all-gather; no job: [0] or [])."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [0] if flag else []
    size = dist.get_world_size(group)
    flags = torch.zeros(size, dtype=torch.int32, device=_device(group))
    dist.all_gather_into_tensor(flags, torch.tensor([int(flag)], dtype=torch.int32, device=flags.device), group=group)
    return [r for r in range(size) if flags[r]]
