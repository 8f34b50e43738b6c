"""Tensor parallelism for GPT models: each block's attention and MLP split over the tp ranks
(Megatron-LM's plan, through torch's `parallelize_module`), optionally sequence parallelism too.

Per block, sharded:
  attn.wq, attn.wk, attn.wv   column-wise: each rank computes n_head / tp whole heads
  attn.wo                     row-wise: one all-reduce per attention (reduce-scatter with SP)
  mlp.fc                      column-wise: each rank holds mlp_ratio * d_model / tp hidden units
  mlp.proj                    row-wise: one all-reduce per MLP (reduce-scatter with SP)
  norm1, norm2                only with sequence parallelism: each rank normalises T / tp positions
Replicated (the same on every tp rank): the token and position embeddings, the final norm and
the output head, and the block norms without sequence parallelism. The GPT ties the output head
to the token embedding; one weight sharded two ways (by vocabulary rows for the lookup, by
vocabulary columns for the head) is not worth its complexity at the sizes gpudl trains.

Replicated parameters become DTensors too (placement Replicate), so that every parameter of a
tensor-parallel model is a DTensor on the tp mesh: the optimizer, gradient clipping and FSDP
(which then shards each on a 2-D dp x tp mesh) see one kind of parameter, never a mix.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
    parallelize_module)

from ..errors import UserError
from ..models.gpt import GPT

SEQUENCE = Shard(1)  # activations (B, T, C) split along T


def check_tp(model: nn.Module, tp: int, sequence_parallel: bool) -> None:
    """Refuse, with the fix, a model tensor parallelism of degree `tp` has no plan for or cannot split evenly.

    Runs on the meta-device model too, so a run can refuse before it starts any process group.
    """
    if not isinstance(model, GPT):
        raise UserError(f"parallel.tp={tp}: tp for a model with no tensor-parallel plan ({type(model).__name__}; "
                        f"only GPT models have one): set --set parallel.tp=1 and give the processes to data "
                        f"parallelism (parallel.dp_shard or parallel.dp_replicate)")
    c = model.cfg
    sizes = {"model.n_head": c.n_head, "model.d_model": c.d_model, "the MLP width": c.mlp_ratio * c.d_model}
    if sequence_parallel:  # every rank must hold the same number of positions
        sizes["model.block_size"] = c.block_size
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp]
    if bad:
        common = math.gcd(*sizes.values())
        fits = [str(d) for d in range(1, min(common, 64) + 1) if common % d == 0]
        what = f"{', '.join(bad[:-1])} and {bad[-1]}" if len(bad) > 1 else bad[0]
        raise UserError(f"parallel.tp={tp} must divide {what}: set --set parallel.tp to one of {', '.join(fits)}, "
                        f"or change the model")


def _block_plan(sequence_parallel: bool) -> dict[str, Any]:
    """Styles for one transformer block, by submodule name."""
    if not sequence_parallel:  # the residual stream stays whole and replicated
        return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    # The residual stream is split along T between the row-wise and the next column-wise layer:
    # norms and dropout run on T / tp positions; attention and the MLP gather the whole sequence.
    gather = PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),))
    return {"norm1": SequenceParallel(), "attn": gather,
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=SEQUENCE),
            "norm2": SequenceParallel(), "mlp": gather,
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=SEQUENCE)}


def _as_replicated(mesh: DeviceMesh):
    def to_dtensor(module, args):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)
    return to_dtensor


def _to_local(module, args, output):
    return output.to_local() if isinstance(output, DTensor) else output


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter the plan left alone becomes a Replicate DTensor; its module takes and
    returns plain tensors as before. A shared (tied) parameter stays shared."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        plain = [(n, p) for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        for name, p in plain:
            if id(p) not in made:
                # Every rank built the same weights from the same seed, so no broadcast is needed
                # (SequenceParallel replicates its norms the same way).
                made[id(p)] = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                                           requires_grad=p.requires_grad)
            module.register_parameter(name, made[id(p)])
        if plain:
            module.register_forward_pre_hook(_as_replicated(mesh))
            module.register_forward_hook(_to_local)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Shard a GPT's blocks over `tp_mesh` in place (see the module docstring for the plan).

    Every tp rank must get the same batch (the data-parallel rank does not include tp) and
    returns the same loss.
    """
    check_tp(model, tp_mesh.size(), sequence_parallel)
    blocks = list(model.blocks.values())
    for block in blocks:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    if sequence_parallel and blocks:
        # Split the replicated embeddings along T before the first block; gather after the last,
        # so that the final norm and the head (and a pipeline's next stage) get the whole sequence.
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(SEQUENCE,), use_local_output=True))
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=(SEQUENCE,), desired_output_layouts=(Replicate(),), use_local_output=True))
    _replicate_rest(model, tp_mesh)
    return model
