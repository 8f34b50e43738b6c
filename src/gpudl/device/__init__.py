"""The devices of this machine: detection (detect.py), datasheet specs (specs.py), measured peaks
(peak.py), the host's memory allocator (host.py), kernel choices measured per device (kernels.py)
and the `gpudl info` tree (info.py). Nothing is detected or measured at import time."""

from .discovery import DeviceInfo, available, cpu_info, detect, synchronize

__all__ = ["DeviceInfo", "available", "cpu_info", "detect", "synchronize"]
