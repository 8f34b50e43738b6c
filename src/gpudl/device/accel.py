"""Device-generic calls: what torch.accelerator does for every accelerator, written once.

torch.accelerator drives the one accelerator type this torch build has (CUDA or ROCm, XPU, MPS,
HPU, MTIA, a PrivateUse1 NPU); these helpers ask it instead of listing device names. The CPU,
the meta device and XLA (which torch.accelerator does not cover) answer False or do nothing.

>>> import torch
>>> is_accelerator(torch.device("cpu")), overlaps_copies(torch.device("cpu"))
(False, False)
>>> peak_allocated(torch.device("meta"))
0
"""

from __future__ import annotations

import torch


def is_accelerator(device: torch.device) -> bool:
    """True where `device` is of the accelerator type torch.accelerator drives in this process."""
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return current is not None and current.type == device.type


def overlaps_copies(device: torch.device) -> bool:
    """Whether host -> `device` copies from pinned memory on a side stream run beside the compute:
    accelerators with memory of their own. MPS shares the host's memory, so there is nothing to overlap."""
    return is_accelerator(device) and device.type != "mps"


def use_device(device: torch.device) -> None:
    """Make `device` this process's current accelerator (a rank's own GPU); nothing elsewhere."""
    if is_accelerator(device) and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def current_device() -> torch.device:
    """This process's current accelerator device, index included (the CPU where there is none)."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def peak_allocated(device: torch.device) -> int:
    """Peak bytes of tensors allocated on the accelerator `device` since the last reset (0 elsewhere,
    or where its allocator keeps no statistics)."""
    if not is_accelerator(device):
        return 0
    try:
        return int(torch.accelerator.max_memory_allocated(_index(device)))
    except (RuntimeError, NotImplementedError):  # an allocator without statistics
        return 0


def reset_peak(device: torch.device) -> None:
    if is_accelerator(device):
        try:
            torch.accelerator.reset_peak_memory_stats(_index(device))
        except (RuntimeError, NotImplementedError):
            pass


def empty_cache(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device (after a failed, out-of-memory attempt)."""
    if is_accelerator(device):
        torch.accelerator.empty_cache()


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The random generator state of the accelerator `device` (None elsewhere): checkpoints carry it."""
    return torch.get_device_module(device.type).get_rng_state(device) if is_accelerator(device) else None


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    torch.get_device_module(device.type).set_rng_state(state, device)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.accelerator.current_device_index()
