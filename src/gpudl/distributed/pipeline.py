"""Pipeline parallelism for GPT models on `torch.distributed.pipelining`: split, stages, schedule.

The blocks are split by layer into pp x pp_stages_per_rank stages; stage s runs on pipeline rank
s % pp (the schedules' own placement: one stage per rank for gpipe and 1f1b, several for
interleaved-1f1b). A stage is the GPT with the blocks of other stages deleted from its
ModuleDict, the embeddings only on the first stage and the final norm and head only on the last
(torchtitan's split), so every parameter keeps its name in the whole model: optimizer state and
checkpoints are keyed as in one process and reshard between pipeline sizes.

Each rank keeps one module with everything it holds, the rank model: the optimizer and the
checkpoints see it. With several stages per rank each stage is a thin GPT sharing its blocks with
the rank model; with one, the stage is the rank model. The schedule runs the stages (forward and
backward together), so the loop gets a `micro_step`, a `clip_norm` and an `eval_fn` that drive it.

>>> [list(r) for r in stage_layers(n_layer=5, n_stages=2)], rank_stages(pp_rank=1, pp=2, per_rank=2)
([[0, 1, 2], [3, 4]], [1, 3])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..config import ParallelConfig
from ..errors import UserError
from ..models.gpt import GPT, lm_loss
from .parts import Parallelized, clip_grad_norm

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
MULTI_STAGE = {"interleaved-1f1b"}          # schedules that run several stages per rank
END_PARTS = ("wte", "wpe", "norm", "lm_head")  # the first stage's embeddings, the last one's head


def check_model(model: nn.Module, pp: int, stages: int) -> None:
    """Refuse a model that cannot be split into `stages` stages."""
    if not isinstance(model, GPT):
        raise UserError(f"parallel.pp={pp} splits a GPT's blocks into stages, but the model is a "
                        f"{type(model).__name__}: set --set parallel.pp=1 and use data parallelism for it")
    if model.cfg.tie_embeddings:
        raise UserError(f"parallel.pp={pp} puts the token embedding (first stage) and the output head (last "
                        f"stage) on different ranks, so they cannot share weights: set --set model.tie_embeddings=false")
    if stages > model.cfg.n_layer:
        raise UserError(f"parallel.pp={pp} x parallel.pp_stages_per_rank={stages // pp} = {stages} stages, but "
                        f"model.n_layer={model.cfg.n_layer}: every stage needs a layer; lower pp or "
                        f"pp_stages_per_rank until their product is at most {model.cfg.n_layer}")


def check_schedule(cfg: ParallelConfig, batch_size: int | None, precision_name: str) -> None:
    """Refuse a schedule, micro-batching or precision the pipeline cannot run."""
    pp, per_rank, m, name = cfg.pp, cfg.pp_stages_per_rank, cfg.pp_microbatches, cfg.pp_schedule
    if name in MULTI_STAGE and per_rank < 2:
        raise UserError(f"parallel.pp_schedule='{name}' interleaves several stages per rank, got "
                        f"parallel.pp_stages_per_rank={per_rank}: set --set parallel.pp_stages_per_rank=2")
    if name not in MULTI_STAGE and per_rank > 1:
        raise UserError(f"parallel.pp_schedule='{name}' runs one stage per rank, got parallel.pp_stages_per_rank="
                        f"{per_rank}: set --set parallel.pp_schedule=interleaved-1f1b, or pp_stages_per_rank=1")
    if name == "1f1b" and m < pp:
        raise UserError(f"parallel.pp_schedule='1f1b' needs at least as many micro-batches as stages, got "
                        f"parallel.pp_microbatches={m} for pp={pp}: set --set parallel.pp_microbatches={pp}")
    rounds = max(1, m // pp)  # interleaved-1f1b runs the micro-batches in rounds
    if name in MULTI_STAGE and m % rounds:
        raise UserError(f"parallel.pp_schedule='{name}' runs parallel.pp_microbatches={m} in {rounds} rounds, "
                        f"which must divide it: set --set parallel.pp_microbatches={rounds * pp}")
    if batch_size is not None and batch_size % m:
        fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise UserError(f"train.batch_size={batch_size} must be divisible by parallel.pp_microbatches={m} (each "
                        f"batch is cut into that many micro-batches): set pp_microbatches to one of "
                        f"{', '.join(map(str, fits))}, or change train.batch_size")
    if precision_name == "fp16-mixed":  # each rank's loss scaler would skip steps and rescale on its own
        raise UserError(f"parallel.pp={pp} does not support precision 'fp16-mixed': set --set "
                        f"train.precision=bf16-mixed (or fp32)")


def check_pipeline(model: nn.Module, cfg: ParallelConfig, batch_size: int | None = None,
                   precision_name: str = "fp32") -> None:
    """Refuse, in one line, what no pipeline can run: before any process is counted or model built."""
    check_model(model, cfg.pp, cfg.pp * cfg.pp_stages_per_rank)
    check_schedule(cfg, batch_size, precision_name)


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Consecutive layers per stage, as even as possible; the first stages take the extra ones
    (the last stage also runs the output head, the heaviest single layer for a large vocabulary)."""
    base, extra = divmod(n_layer, n_stages)
    starts = [s * base + min(s, extra) for s in range(n_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(n_stages)]


def rank_stages(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: pp_rank, pp_rank + pp, ... (the schedules' placement)."""
    return [pp_rank + k * pp for k in range(per_rank)]


def stage_parts(stage: int, layers: list[range]) -> list[str]:
    """Names (as in the whole model) of the submodules stage `stage` holds."""
    first, last = stage == 0, stage == len(layers) - 1
    return [*(("wte", "wpe") if first else ()), *(f"blocks.{i}" for i in layers[stage]),
            *(("norm", "lm_head") if last else ())]


def keep_only(model: GPT, parts: Collection[str]) -> GPT:
    """Delete, in place, every block and end piece of `model` that is not in `parts`."""
    for key in list(model.blocks.keys()):
        if f"blocks.{key}" not in parts:
            del model.blocks[key]
    for name in END_PARTS:
        if name not in parts:
            setattr(model, name, None)  # forward() skips what a stage does not have
    return model


def stage_view(rank_model: GPT, parts: Collection[str]) -> GPT:
    """A GPT over some of `rank_model`'s submodules, shared and not copied: what one stage runs."""
    with torch.device("meta"):
        view = GPT(rank_model.cfg)  # a skeleton: every meta tensor in it is replaced or dropped below
    view.blocks = nn.ModuleDict({k: b for k, b in rank_model.blocks.items() if f"blocks.{k}" in parts})
    view.drop = rank_model.drop
    for name in END_PARTS:
        setattr(view, name, getattr(rank_model, name) if name in parts else None)
    return view


@dataclass
class PipelineSplit:
    """One pipeline rank's share of the model."""

    model: GPT               # the rank model: every part this rank holds, named as in the whole model
    stages: list[GPT]        # what each of its stages runs, in stage order
    stage_ids: list[int]
    n_stages: int


def split_model(model: nn.Module, pp_rank: int, cfg: ParallelConfig, *, batch_size: int | None = None,
                precision_name: str = "fp32", materialize: Callable | None = None) -> PipelineSplit:
    """Keep pipeline rank `pp_rank`'s stages of `model` (in place), allocating only them.

    `materialize(model, only=names)` allocates and initialises a meta-device model; it runs before
    the other ranks' parts are deleted, so the parts kept get the values they have in the whole model.
    """
    check_pipeline(model, cfg, batch_size, precision_name)
    n_stages = cfg.pp * cfg.pp_stages_per_rank
    layers = stage_layers(model.cfg.n_layer, n_stages)
    ids = rank_stages(pp_rank, cfg.pp, cfg.pp_stages_per_rank)
    parts = {s: stage_parts(s, layers) for s in ids}
    held = [name for s in ids for name in parts[s]]
    if materialize is not None:
        materialize(model, only=held)
    keep_only(model, held)
    stages = [model] if len(ids) == 1 else [stage_view(model, parts[s]) for s in ids]
    return PipelineSplit(model, stages, ids, n_stages)


class StageLoss:
    """The schedule's loss on the last stage: the cross-entropy times `factor`.

    `factor` = the loop's scale / micro-batches. The schedule's own division by the number of
    micro-batches (scale_grads) is off: it would also divide gradients accumulated in earlier
    micro-steps of the same optimizer step.
    """

    def __init__(self, microbatches: int):
        self.factor = 1.0 / microbatches

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) * self.factor


def build_schedule(split: PipelineSplit, parts: list[nn.Module], group: dist.ProcessGroup, cfg: ParallelConfig,
                   device: torch.device, loss: StageLoss):
    """PipelineStages over `parts` (the stages, parallelized further) and the configured schedule."""
    stages = [PipelineStage(part, s, split.n_stages, device, group=group) for part, s in zip(parts, split.stage_ids)]
    schedule = SCHEDULES[cfg.pp_schedule]
    first = stages if cfg.pp_schedule in MULTI_STAGE else stages[0]
    return schedule(first, n_microbatches=cfg.pp_microbatches, loss_fn=loss, scale_grads=False)


@dataclass
class Pipeline:
    """Drives the schedule for the loop: a batch in, the batch's mean loss out, on every pipeline rank."""

    schedule: object
    loss: StageLoss
    group: dist.ProcessGroup
    microbatches: int
    has_first: bool
    has_last: bool
    last_rank: int              # the pipeline rank that runs the last stage
    device: torch.device

    def run(self, batch: tuple[torch.Tensor, ...], train: bool) -> torch.Tensor:
        x, y = batch  # (B, T) token ids, (B, T) next tokens
        losses: list[torch.Tensor] = []  # one per micro-batch, on the last stage
        run = self.schedule.step if train else self.schedule.eval
        run(*((x,) if self.has_first else ()), target=y, losses=losses, return_outputs=False)
        if self.has_last:
            mean = torch.stack(losses).detach().sum() / (self.loss.factor * self.microbatches)
        else:
            mean = torch.zeros((), device=self.device)
        # Only the last stage saw the loss: every rank logs (and reports) the same number.
        dist.broadcast(mean, group=self.group, group_src=self.last_rank)
        return mean

    def micro_step(self, job, batch: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
        self.loss.factor = scale / self.microbatches
        with job.precision.autocast():
            return self.run(batch, train=True)

    def eval_fn(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        return {"loss": self.run(batch, train=False)}  # the loop's evaluate() set no_grad and autocast


def pipeline_parallelized(split: PipelineSplit, parts: list[nn.Module], pp_mesh: DeviceMesh, cfg: ParallelConfig,
                          device: torch.device) -> Parallelized:
    """The rank model and the hooks through which the loop runs the schedule."""
    group = pp_mesh.get_group()
    loss = StageLoss(cfg.pp_microbatches)
    pipe = Pipeline(build_schedule(split, parts, group, cfg, device, loss), loss, group, cfg.pp_microbatches,
                    has_first=split.stage_ids[0] == 0, has_last=split.stage_ids[-1] == split.n_stages - 1,
                    last_rank=(split.n_stages - 1) % cfg.pp, device=device)
    return Parallelized(split.model, clip_norm=functools.partial(clip_grad_norm, group=group),
                        micro_step=pipe.micro_step, eval_fn=pipe.eval_fn)
