"""Memory sizes as people write them: "12GiB", "40GB", "500MiB"."""

from __future__ import annotations

import re

from ..errors import UserError


def parse_size(text: str, what: str = "memory size") -> int:
    """"12GiB", "12 GB", "500MiB", "1.5TiB" or a number of bytes -> bytes (GB: 10^9, GiB: 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"{what} {text!r} is not a size: write it like 12GiB, 40GB or 500MiB")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) or not m.group(2) else 1000) ** power)
