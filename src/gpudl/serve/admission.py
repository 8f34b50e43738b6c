"""Admission by what can be served: a request is taken only if it can start within a target wait
(`max_wait_s`), estimated when it arrives; the rest are refused at once with the time after which
a retry could be taken, instead of waiting in a long queue to time out late.

The estimate: the units (rows for a classifier, requests for a GPT) that would start before it in
the fair order (`fair.FairQueue.ahead`: its client's own queue, and about as much of each other
client's), less what can start at once (free decode slots, or an idle batch), over the engine's
service rate. The rate is measured, not configured: units per second over the stretches where the
engine was saturated (every decode slot taken; a batch that filled up or left requests waiting),
since only then does it show what the
engine can do rather than what it was asked; for a GPT, generated tokens per second over the mean
tokens a request gets, both measured. Before the first saturated stretch (a cold start) nothing is
measured: one batch may wait (as many units as `max_batch_size`), no more.

>>> rate = Rate(); rate.record(64, 0.5); rate.record(64, 0.5); round(rate.per_s)
128
>>> retry_after(ahead=300, units=1, free=0, per_s=rate.per_s, max_wait_s=1.0, capacity=32)  # 2.35 s: wait 1.35 s more
1.3515625
>>> retry_after(ahead=100, units=1, free=0, per_s=rate.per_s, max_wait_s=1.0, capacity=32) is None
True
"""

from __future__ import annotations

import math

TAU_S = 2.0          # the rate forgets what it measured this many seconds of saturation ago (1/e)
MIN_SAMPLES = 2      # saturated stretches measured before the rate is trusted
COLD_RETRY_S = 1.0   # what a refusal at a cold start asks the client to wait


class Rate:
    """Units per second over an exponentially decaying window of measured time: units done and
    seconds taken, each decayed by exp(-seconds / tau_s) as more is measured. So many short decoding
    steps weigh what one long batch does, and the first samples give a plain average (no start-up
    bias toward the very first one)."""

    def __init__(self, tau_s: float = TAU_S):
        self.tau_s, self.samples = tau_s, 0
        self._units = self._seconds = 0.0

    def record(self, units: float, seconds: float) -> None:
        if seconds <= 0:
            return
        keep = math.exp(-seconds / self.tau_s)
        self._units = self._units * keep + units
        self._seconds = self._seconds * keep + seconds
        self.samples += 1

    @property
    def per_s(self) -> float | None:
        """The rate, or None until MIN_SAMPLES stretches were measured."""
        if self.samples < MIN_SAMPLES or self._units <= 0:
            return None
        return self._units / self._seconds


class Mean:
    """An exponentially weighted mean (tokens a GPT request gets), None before the first value."""

    def __init__(self, weight: float = 0.05):
        self.weight, self.value = weight, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


def retry_after(*, ahead: int, units: int, free: int, per_s: float | None, max_wait_s: float,
                capacity: int) -> float | None:
    """None: admit a request costing `units` with `ahead` units before it and `free` units that
    can start at once. Else the seconds until it could be admitted (its estimated wait past
    `max_wait_s`; COLD_RETRY_S before the rate is measured, when `capacity` units may wait)."""
    waiting = ahead + units - free  # units that must wait for capacity, this request's included
    if waiting <= 0:
        return None
    if per_s is None:
        return None if waiting <= capacity else COLD_RETRY_S
    wait = waiting / per_s
    return None if wait <= max_wait_s else wait - max_wait_s
