"""The independent observers of CPU allocations that the memory benchmark reads: the running
sum of signed allocation sizes over a window (`live_bytes`), taken from `torch.profiler`'s memory
events (`profiler_deltas`) or from c10's own CPU allocator log of every thread
(`C10AllocationLog`), and the bytes a job holds between steps (`storage_bytes` of
`held_tensors`); on an accelerator, the device allocator's own counters (`DeviceCounters`).
`benchmarks/memory_measure.py` measures a training step through them; they
share no code with gpudl's estimator, which is what they are compared with.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Live bytes from memory events: pure bookkeeping, tested on its own.

def live_bytes(deltas: Iterable[tuple[int, int]], start: int, end: int) -> dict:
    """The running sum of signed allocation sizes `(when, nbytes)` over the window [start, end].

    `when` is a time (the profiler's ns) or a position in a log; events with equal `when` keep
    their given order. Returns, in bytes: baseline (live just before the window), peak (the most
    live at any moment inside it, at least the baseline), end (live at its end) and step_peak
    (peak - baseline).
    """
    live, baseline, peak, inside = 0, 0, 0, False
    for when, n in sorted(deltas, key=lambda e: e[0]):
        if when > end:
            break
        if when >= start and not inside:
            baseline, peak, inside = live, live, True
        live += n
        if inside:
            peak = max(peak, live)
    if not inside:  # nothing was allocated or freed inside the window
        baseline = peak = live
    return {"baseline_bytes": baseline, "peak_bytes": peak, "end_bytes": live, "step_peak_bytes": peak - baseline}


def profiler_deltas(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """The "[memory]" events of a finished `torch.profiler.profile` as (start_ns, nbytes), and each
    record_function marker's (start_ns, end_ns)."""
    deltas, marks = [], {}
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            deltas.append((e.start_ns(), e.nbytes()))
        elif name.startswith("memory_measure/"):
            s, t = e.start_ns(), e.start_ns() + e.duration_ns()
            old = marks.get(name)
            marks[name] = (s, t) if old is None else (min(old[0], s), max(old[1], t))
    return deltas, marks


def storage_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct CPU storages behind `tensors` (views count once; DTensors by their local part)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor's own storage is its local shard's
        if t is None or t.device.type != "cpu":
            continue
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def held_tensors(model, optimizer) -> Iterator:
    """What a job holds between steps: parameters, their gradients, buffers, optimizer state."""
    for p in model.parameters():
        yield p
        yield p.grad
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from (v for v in state.values() if hasattr(v, "untyped_storage"))


# ---------------------------------------------------------------------------------------------
# The second source: c10's CPU allocator reporter, every thread (method="c10-log").

_C10_EVENT = re.compile(rb"C10 (alloc|deleted) (\d+) bytes, total alloc (\d+) bytes|@@memory_measure (\S+)")


class C10AllocationLog:
    """Every CPU allocation and free, of any thread, with the process-wide live total, in a file.

    While on, c10's `FLAGS_caffe2_report_cpu_memory_usage` is set (the CPU allocator then logs
    "C10 alloc N bytes, total alloc M bytes." for each allocation and "C10 deleted ..." for each
    free, whichever thread makes it), the c10 log level is INFO, and stderr (fd 2) goes to `path`.
    `mark(name)` writes a marker line there. Allocations made before `start()` are not counted,
    nor are their frees (c10 forgets a block it did not see allocated).
    """

    def __init__(self, path: Path):
        import torch

        self.path = Path(path)
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            self._flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
            self._level = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
        except (OSError, ValueError) as e:
            raise RuntimeError(f"this torch ({torch.__version__}) does not export c10's allocation-report flags ({e}): "
                               f"use method='profiler' (exact for one process only)") from e
        self._saved_fd = None

    def start(self) -> None:
        sys.stderr.flush()
        self._saved_fd, self._saved_level = os.dup(2), self._level.value
        self._file = open(self.path, "wb")
        os.dup2(self._file.fileno(), 2)
        self._level.value, self._flag.value = 0, True

    def mark(self, name: str) -> None:
        os.write(2, f"@@memory_measure {name}\n".encode())

    def stop(self) -> None:
        if self._saved_fd is None:
            return
        self._flag.value, self._level.value = False, self._saved_level
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._saved_fd = None
        self._file.close()

    def events(self) -> tuple[list[tuple[int, int]], dict[str, int]]:
        """(position, signed bytes) of each allocation and free in the order logged, and each mark's position.

        A size is the change of the logged live total, so the running sum is that total exactly
        (two threads' lines can be logged in the other order than their totals were taken). The
        total may include blocks c10 was already tracking before `start()` (only if something
        else set the flag or profiled memory earlier): the first line's own size sets that offset.
        """
        deltas, marks, total, pos = [], {}, None, 0
        with open(self.path, "rb") as f:
            for line in f:
                for m in _C10_EVENT.finditer(line):  # a marker can land inside another thread's line
                    pos += 1
                    if m.group(4):
                        marks[m.group(4).decode()] = pos
                        continue
                    now = int(m.group(3))
                    if total is None:
                        total = now - (int(m.group(2)) if m.group(1) == b"alloc" else -int(m.group(2)))
                    deltas.append((pos, now - total))
                    total = now
        if not deltas:
            raise RuntimeError(f"c10 logged no allocation in {self.path}: this torch build does not log them; "
                               f"use method='profiler' (exact for one process only)")
        return deltas, marks

    def window(self, begin: str, end: str) -> dict:
        """live_bytes() between the marks `begin` and `end`."""
        deltas, marks = self.events()
        missing = [m for m in (begin, end) if m not in marks]
        if missing:
            raise RuntimeError(f"marks {missing} are not in {self.path}")
        return live_bytes(deltas, marks[begin], marks[end])


class DeviceCounters:
    """The device allocator's counters over step 2, in the shape of `C10AllocationLog`'s window.

    Used where `_build_job_and_record_two_steps` takes a log: `start` before the job is built,
    `mark` at each step's edges, `stop` after. Bytes allocated before `start` are not counted.
    """

    def __init__(self):
        import torch

        self.cuda = torch.cuda
        self.at: dict[str, int] = {}

    def start(self) -> None:
        # cuBLAS takes a workspace (32 MiB on Hopper) from the caching allocator for each handle at
        # its first matmul, and keeps it: a runtime buffer, which the planner reserves beside the
        # estimate (plan.RUNTIME_BYTES, plan.WORKSPACE_BYTES), not a tensor of the job. Handles are
        # per thread, and autograd runs the backward on a thread of its own: both made here, with
        # and without a bias (cuBLASLt), before the count starts.
        import torch

        for dtype in (torch.float32, torch.bfloat16):
            layer = torch.nn.Linear(64, 64, device="cuda", dtype=dtype)
            x = torch.ones(8, 64, device="cuda", dtype=dtype, requires_grad=True)
            (layer(x) @ x.t()).sum().backward()
        del layer, x
        self.cuda.synchronize()
        self.before = self.cuda.memory_allocated()

    def mark(self, name: str) -> None:
        self.cuda.synchronize()  # every kernel of the step has run: its frees are counted
        self.at[name] = self.cuda.memory_allocated() - self.before
        if name == "step2-begin":
            self.cuda.reset_peak_memory_stats()
        if name == "step2-end":
            self.at["peak"] = self.cuda.max_memory_allocated() - self.before

    def stop(self) -> None:
        pass

    def window(self) -> dict:
        base = self.at["step2-begin"]
        return {"baseline_bytes": base, "peak_bytes": self.at["peak"], "step_peak_bytes": self.at["peak"] - base,
                "end_bytes": self.at["step2-end"]}
