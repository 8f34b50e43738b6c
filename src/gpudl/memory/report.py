"""A plan as a table, a line that says why the winner won, and JSON for scripts."""

from __future__ import annotations

from rich.table import Table

from .. import models
from .oom import explain
from .plan import MARGIN, Candidate, Plan

GiB = 2**30


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def plan_table(p: Plan) -> Table:
    t = Table(title=f"Plans for {p.machine.name} · {p.machine.usable / GiB:.1f} GiB usable per device · "
                    f"global batch {p.global_batch} · GiB per device", title_justify="left")
    for name in ("layout", "micro-batch", "weights+grads+optimizer", "activations", "comm.", "peak",
                 f"peak+{MARGIN:.0%}", "step s", "verdict"):
        t.add_column(name, justify="left" if name in ("layout", "verdict") else "right")
    winner = p.winner
    for c in p.candidates:
        t.add_row(*_row(c), style="bold green" if c is winner else "dim" if not c.fits else None)
    return t


def _row(c: Candidate) -> list[str]:
    layout = c.strategy + (" · AC" if c.activation_checkpointing else "")
    batch = f"{c.micro_batch} x {c.grad_accum}" if c.micro_batch else "—"
    if c.estimate is None:
        return [layout, batch, *["—"] * 6, c.rejected]
    parts = c.estimate.parts
    state = parts["params"] + parts["buffers"] + parts["grads"] + parts["optimizer"]
    acts = parts["activations"] + parts["temporaries"] + parts["inputs"]
    host = f" (+{_gib(c.estimate.host)} host)" if c.estimate.host else ""  # FSDP's CPU offload
    return [layout, batch, _gib(state) + host, _gib(acts), _gib(parts["communication"] + parts["other"]),
            _gib(c.estimate.peak), _gib(int(c.estimate.peak * (1 + MARGIN))),
            f"{c.step_s:.3g}" if c.step_s else "—", "fits" if c.fits else c.rejected]


def why(p: Plan) -> str:
    """One line: the winner and the apply command, or why nothing fits."""
    w = p.winner
    if w is None:
        needs = [c.estimate.peak for c in p.candidates if c.estimate]
        least = f": the smallest need is {min(needs) * (1 + MARGIN) / GiB:.2f} GiB with the margin" if needs else ""
        return (f"Nothing fits in {p.machine.usable / GiB:.2f} GiB per device{least}. As asked, "
                f"{explain(p.cfg, p.machine.world, p.machine.usable)}")
    others = [c for c in p.candidates if c.fits and c is not w]
    beaten = f", {_faster(min(c.step_s for c in others) / w.step_s)} the next that fits" if others else ""
    host = f" (and {w.estimate.host / GiB:.2f} GiB of host memory each)" if w.estimate.host else ""
    return (f"Chosen: {w.describe()}, predicted {w.estimate.peak / GiB:.2f} GiB per device{host} and {w.step_s:.3g} s "
            f"a step{beaten}. Apply it: " + " ".join(f"--set {s}" for s in w.sets))


def _faster(ratio: float) -> str:
    return f"{ratio:.2f}x as fast as" if ratio >= 1.1 else f"{(ratio - 1) * 100:.1f}% faster than"


def plan_json(p: Plan) -> dict:
    return {"model": models.describe(models.from_config(p.cfg)),
            "machine": {"name": p.machine.name, "usable_bytes": p.machine.usable, "world": p.machine.world},
            "global_batch": p.global_batch, "margin": MARGIN,
            "candidates": [{"layout": c.strategy, "activation_checkpointing": c.activation_checkpointing,
                            "micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "sets": c.sets,
                            "parts": c.estimate.parts if c.estimate else None,
                            "peak_bytes": c.estimate.peak if c.estimate else None,
                            "host_bytes": c.estimate.host if c.estimate else None, "step_s": c.step_s,
                            "fits": c.fits, "rejected": c.rejected or None, "winner": c is p.winner}
                           for c in p.candidates]}
