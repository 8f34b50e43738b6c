"""Peak memory per rank of a pipeline-parallel job: traces of its stages, combined by formula.

A schedule's stages exchange shapes with each other, so a schedule cannot run on the fake process
group the other strategies are traced on. Instead each rank's stages are traced on their own
(`pipeline_trace.py`): one micro-batch's forward, its backward (the step's first, which makes the
gradients, and a later one, which adds to them) and the update, each with its rise (the most it
holds above where it starts) and its net (what it leaves). The schedule is then replayed on those
figures, in the order torch's schedule runs the rank's actions (`rank_actions`):

    peak_r = S_r + max over actions a of ( sum of net(a') over the actions a' before a  +  rise(a) )

S_r: what rank r holds between steps: parameters, optimizer state, the step's batch and the one
the loader makes ahead, and PipelineStage's buffers (one per micro-batch for a stage's input, if
not the first stage, and one for its output's gradient, if not the last). net(forward) = H: what
a micro-batch leaves for its backward (saved activations, the stage output; on the last stage the
logits and the loss's saved tensors), plus on a run's first forward the low-precision copies of
the weights autocast caches until the run ends; net(backward) = -H, plus the gradients G on the
step's first backward, plus the input's gradient until its send lets it go. With one stage per
rank and n micro-batches the replay comes to the largest of (give or take a tensor or two that the
schedule's variables and send works hold a little longer: `rank_actions`)

    GPipe:  S + (n - 1) H + rise(forward),  S + n H + rise(first backward)
            (all n forwards run before any backward)
    1F1B:   S + (k - 1) H + rise(forward),  S + k H + rise(first backward),  S + G + k H + rise(later backward)
            (k = min(n, pp - r): Schedule1F1B's warm-up, the micro-batches in flight on rank r)
    both:   S + G + rise(update)

Interleaved 1F1B replays the order torch's own ScheduleInterleaved1F1B computes for the rank. A
job's estimate is its rank with the largest peak.

An FSDP stage (data parallelism beside the pipeline) differs. Its first backward of every run (not
only of the step) makes the unsharded gradients; a backward keeps the weights it gathers, and a
forward (resharding after it) lets them go; so each phase is taken as traced after the same action as in the schedule
(a warm-up forward after a forward, a cool-down backward after a backward). The end of
each run reduce-scatters the gradients and lets the weights go (the traced `reduce`: its rise,
then its net). Its weights are already in the compute dtype: autocast caches no copies of them.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from .. import models
from ..config import Config, ParallelConfig
from ..distributed.pipeline import rank_stages, stage_layers
from ..training.precision import param_dtype_of
from .offload import on_device
from .pipeline_trace import Parts, RankTrace, plus, trace_rank


def _higher(a: Parts, b: Parts) -> Parts:
    """The higher on the device (what CPU offload keeps on the host not counted)."""
    return b if on_device(b) > on_device(a) else a


def rank_actions(p: ParallelConfig, pp_rank: int) -> list[tuple[str, int]]:
    """(action, stage) in the order the schedule runs them on pipeline rank `pp_rank`: "F" and "B", a
    micro-batch's forward and backward; "keep" and "drop": a reference in the schedule (a send's
    work, a variable) holds the stage's output past its backward, and lets it go; "sent": the
    oldest input gradient held for its send is let go. What is held at the end of a run goes then."""
    n, pp, me, last = p.pp_microbatches, p.pp, pp_rank, p.pp * p.pp_stages_per_rank - 1
    if p.pp_schedule == "gpipe":  # keeps every forward's and backward's send work to the end of the run
        return [("F", me)] * n + [("B", me)] * n + ([("keep", me)] * n if me != last else [])
    if p.pp_schedule == "1f1b":
        return _one_f_one_b(n, min(n, pp - me), me, me == last)
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    # torch computes each rank's order from these four attributes alone (no stage, no process group)
    rounds = max(1, n // pp)
    plan = SimpleNamespace(n_local_stages=p.pp_stages_per_rank, pp_group_size=pp, microbatches_per_round=n // rounds,
                           _n_microbatches=n)
    ops = [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(plan, me) if a is not None]
    out = []
    for a in ops:
        if a.computation_type == _ComputationType.FORWARD:
            out.append(("F", a.stage_index))
        else:  # the runtime keeps every send's work to the end of the run
            out += [("B", a.stage_index)] + ([("keep", a.stage_index)] if a.stage_index != last else [])
    return out


def _one_f_one_b(n: int, k: int, stage: int, last: bool) -> list[tuple[str, int]]:
    """Schedule1F1B's order with k warm-up forwards, and what its variables hold on to."""
    out = [("F", stage)] * k
    for i in range(n):
        out.append(("B", stage))
        if i > 0:  # the previous backward's send ops are dropped once this backward is done
            out.append(("sent", stage))
        if k > 1 and i == k - 2 <= n - k:  # the warm-up's last fired send work holds that output ...
            out.append(("keep", stage))
        if k > 1 and k - 2 <= n - k == i:  # ... until the cool-down reuses its variable
            out.append(("drop", stage))
        if i < n - k:
            out.append(("F", stage))
        if last and i < n - 1:  # `output` holds the logits until the next forward returns
            out[-1:-1] = [("keep", stage)]
            out.append(("drop", stage))
    return out


def replay(trace: RankTrace, actions: list[tuple[str, int]], runs: int) -> Parts:
    """The rank's peak (bytes by category): the module docstring's formula over `runs` schedule runs
    (a step with gradient accumulation runs the schedule once per micro-step)."""
    level = peak = trace.static
    backwarded: set[int] = set()       # stages whose gradients exist (an FSDP stage's: this run's unsharded ones)
    for _ in range(runs):
        held_to_end: list[Parts] = []  # let go when the schedule run ends (and its autocast with it)
        sending: list[Parts] = []      # input gradients on their way to the stage before
        forwarded: set[int] = set()
        backwarded -= {s for s, stage in trace.stages.items() if stage.reduce is not None}
        last: dict[int, str] = {}  # the stage's previous action in this run
        for kind, s in actions:
            stage = trace.stages[s]
            if kind == "keep":
                level = plus(level, stage.output)
                held_to_end.append(stage.output)
                continue
            if kind in ("drop", "sent"):
                gone = sending.pop(0) if kind == "sent" else held_to_end.pop(_index(held_to_end, stage.output))
                level = plus(level, gone, -1)
                continue
            if kind == "F" and s not in forwarded:
                forwarded.add(s)
                phase = stage.first_forward
                if stage.reduce is None:
                    held_to_end.append(plus(stage.first_forward.net, stage.forward.net, -1))  # the autocast copies
            elif kind == "F":
                phase = stage.warm_forward if last.get(s) == "F" and stage.warm_forward else stage.forward
            else:
                phase = (stage.first_backward if s not in backwarded else
                         stage.cool_backward if last.get(s) == "B" and stage.cool_backward else stage.backward)
                backwarded.add(s)
                sending.append(stage.in_flight)
            last[s] = kind
            peak = _higher(peak, plus(level, phase.rise))
            level = plus(level, phase.net)
        for s in dict.fromkeys(s for _, s in actions):  # an FSDP stage's end of the run, after its last backward
            if (reduce := trace.stages[s].reduce) is not None:
                peak = _higher(peak, plus(level, reduce.rise))
                level = plus(level, reduce.net)
        level = _release(_release(level, sending), held_to_end)
    return _higher(peak, plus(level, trace.update))


def _index(items: list, item: object) -> int:
    return next(i for i, x in enumerate(items) if x is item)


def _release(level: Parts, held: list[Parts]) -> Parts:
    while held:
        level = plus(level, held.pop(), -1)
    return level


def rank_peaks(cfg: Config, example: tuple[torch.Tensor, ...], session=None) -> list[Parts]:
    """Bytes by category at the peak of each pipeline rank (index: pp rank) of `cfg`'s job.

    `example`: one batch of the data (shapes only). Ranks whose stages look alike (first or last
    or neither, and as many layers) share one trace: their schedules still differ. `session`:
    rank 0's, where data or tensor parallelism runs beside the pipeline (`trace_rank`)."""
    p = cfg.parallel
    n_stages = p.pp * p.pp_stages_per_rank
    layers = stage_layers(models.from_config(cfg).config.n_layer, n_stages)
    traced: dict[tuple, tuple[list[int], RankTrace]] = {}
    peaks = []
    for r in range(p.pp):
        ids = rank_stages(r, p.pp, p.pp_stages_per_rank)
        look = tuple((s == 0, s == n_stages - 1, len(layers[s])) for s in ids)
        if look not in traced:
            traced[look] = ids, trace_rank(cfg, r, example, session)
        like, trace = traced[look]
        trace = dataclasses.replace(trace, stages={s: trace.stages[t] for s, t in zip(ids, like)})
        parts = replay(trace, rank_actions(p, r), runs=min(cfg.train.grad_accum, 2))
        # the tracker files the schedule's buffers with the batches, registered beside model and optimizer
        peaks.append({**parts, "inputs": trace.inputs, "communication": parts["communication"] + parts["inputs"]
                      - trace.inputs})
    return peaks


def pipeline_possible(cfg: Config, pp: int, batch_size: int | None = None) -> bool:
    """Whether `cfg`'s model, and its schedule with `batch_size` rows a run, can run as a pipeline of
    `pp` ranks (gpudl's own checks say)."""
    from ..distributed.pipeline import check_model, check_schedule
    from ..errors import UserError

    p = dataclasses.replace(cfg.parallel, pp=pp)
    try:
        check_model(models.build_meta(models.from_config(cfg)), pp,
                    pp * p.pp_stages_per_rank)
        check_schedule(p, batch_size, cfg.train.precision)
    except UserError:
        return False
    return True


def pipeline_seconds(cfg: Config, compute_s: float, link_b_s: float) -> float:
    """Seconds a pipeline adds to a step's compute: its bubble and its point-to-point sends (not overlapped).

    `compute_s`: the step's compute spread evenly over the ranks. Bubble: a schedule run of n
    micro-batches over pp ranks with v stages each takes v n + pp - 1 stage slots, of which v n
    compute on a rank, so (pp - 1) / (v n + pp - 1) of the time is idle and compute stretches by
    (pp - 1) / (v n) (GPipe and 1F1B: v = 1; interleaved 1F1B: Megatron-LM's v-fold smaller bubble).
    Sends: per run, each micro-batch's activations (rows / n, T, d_model) cross each of a rank's v
    stage boundaries forward and their gradients back; a step has grad_accum runs.
    """
    p, train = cfg.parallel, cfg.train
    if p.pp == 1:
        return 0.0
    n, v = p.pp_microbatches, p.pp_stages_per_rank
    spec = models.from_config(cfg)
    width = param_dtype_of(train.precision).itemsize  # the residual stream's dtype: the parameters'
    activation = train.batch_size // n * spec.config.block_size * spec.config.d_model * width
    sends = train.grad_accum * n * v * 2 * activation
    return compute_s * (p.pp - 1) / (v * n) + sends / link_b_s
