"""The pipeline split in one process: which parts go where, names and values kept, and refusals."""

import functools

import pytest
import torch

from gpudl import models
from gpudl.config import ParallelConfig
from gpudl.distributed.pipeline import check_schedule, split_model, stage_layers
from gpudl.errors import UserError

UNTIED = {"n_layer": 4, "n_head": 2, "d_model": 32, "block_size": 16, "tie_embeddings": False}


def whole(seed: int = 0, **changes):
    return models.build(models.resolve("gpt-tiny", {**UNTIED, **changes}), torch.device("cpu"), seed=seed)


def parts(model) -> list[str]:
    """The model's top-level pieces and blocks, by the whole model's names."""
    return [n for n, m in model.named_children() if m is not None and n != "blocks"] + \
           [f"blocks.{k}" for k in model.blocks]


def test_layers_are_split_evenly_and_the_first_stages_take_the_rest():
    assert [list(r) for r in stage_layers(4, 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in stage_layers(7, 4)] == [[0, 1], [2, 3], [4, 5], [6]]


def test_two_stages_keep_their_layers_and_the_whole_models_names_and_values():
    full = dict(whole().named_parameters())
    cfg = ParallelConfig(pp=2)
    first, last = (split_model(whole(), rank, cfg) for rank in (0, 1))
    assert parts(first.model) == ["wte", "wpe", "drop", "blocks.0", "blocks.1"]
    assert parts(last.model) == ["drop", "norm", "lm_head", "blocks.2", "blocks.3"]
    assert first.stages == [first.model] and (first.stage_ids, last.stage_ids) == ([0], [1])
    names = [n for s in (first, last) for n, _ in s.model.named_parameters()]
    assert sorted(names) == sorted(full)  # every parameter once, by its whole-model name
    for split in (first, last):
        for name, p in split.model.named_parameters():
            assert torch.equal(p, full[name]), name


def test_interleaved_stages_loop_over_the_ranks_and_share_the_rank_models_blocks():
    cfg = ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2)
    split = split_model(whole(), 0, cfg)
    assert split.stage_ids == [0, 2] and split.n_stages == 4
    assert parts(split.model) == ["wte", "wpe", "drop", "blocks.0", "blocks.2"]
    assert [parts(s) for s in split.stages] == [["wte", "wpe", "drop", "blocks.0"], ["drop", "blocks.2"]]
    assert split.stages[1].blocks["2"] is split.model.blocks["2"]  # shared, not copied
    owned = {id(p) for p in split.model.parameters()}
    assert {id(p) for s in split.stages for p in s.parameters()} == owned


def test_the_stages_in_order_compute_what_the_whole_model_does():
    cfg = ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2)
    ranks = [split_model(whole(), rank, cfg) for rank in (0, 1)]
    stages = dict(kv for split in ranks for kv in zip(split.stage_ids, split.stages))
    x = torch.randint(0, 256, (2, 16))
    h = x
    for s in range(4):
        h = stages[s](h)  # ids -> hidden states (B, T, C) -> ... -> logits (B, T, V)
    assert torch.allclose(h, whole()(x), atol=1e-6)


def test_a_stage_built_on_the_meta_device_gets_the_whole_models_initial_values():
    spec = models.resolve("gpt-tiny", UNTIED)
    materialize = functools.partial(models.materialize, device=torch.device("cpu"), seed=7)
    split = split_model(models.build_meta(spec), 1, ParallelConfig(pp=2), materialize=materialize)
    full = dict(whole(seed=7).named_parameters())
    for name, p in split.model.named_parameters():
        assert not p.is_meta and torch.equal(p, full[name]), name


@pytest.mark.parametrize("model, cfg, message", [
    (lambda: models.build_meta(models.resolve("resnet18")), ParallelConfig(pp=2),
     "model is a ResNet: set --set parallel.pp=1"),
    (lambda: models.build_meta(models.resolve("gpt-tiny")), ParallelConfig(pp=2),
     "set --set model.tie_embeddings=false"),
    (lambda: whole(n_layer=2), ParallelConfig(pp=4), r"4 stages, but model.n_layer=2"),
    (lambda: whole(n_layer=3), ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2),
     r"parallel.pp=2 x parallel.pp_stages_per_rank=2 = 4 stages, but model.n_layer=3"),
], ids=["resnet", "tied", "pp-above-layers", "stages-above-layers"])
def test_models_a_pipeline_cannot_split_are_refused(model, cfg, message):
    with pytest.raises(UserError, match=message):
        split_model(model(), 0, cfg)


@pytest.mark.parametrize("cfg, batch, precision, message", [
    (ParallelConfig(pp=2, pp_schedule="interleaved-1f1b"), 8, "fp32", "set --set parallel.pp_stages_per_rank=2"),
    (ParallelConfig(pp=2, pp_stages_per_rank=2), 8, "fp32", "set --set parallel.pp_schedule=interleaved-1f1b"),
    (ParallelConfig(pp=4, pp_microbatches=2), 8, "fp32", "set --set parallel.pp_microbatches=4"),
    (ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2, pp_microbatches=5), 10, "fp32",
     "set --set parallel.pp_microbatches=4"),
    (ParallelConfig(pp=2, pp_microbatches=4), 6, "fp32",
     r"train.batch_size=6 must be divisible by parallel.pp_microbatches=4 .* one of 1, 2, 3, 6"),
    (ParallelConfig(pp=2), 8, "fp16-mixed", "set --set train.precision=bf16-mixed"),
], ids=["interleaved-one-stage", "1f1b-two-stages", "1f1b-few-microbatches", "interleaved-rounds",
        "batch-not-divisible", "fp16"])
def test_schedules_a_pipeline_cannot_run_are_refused(cfg, batch, precision, message):
    with pytest.raises(UserError, match=message):
        check_schedule(cfg, batch, precision)
    check_schedule(ParallelConfig(pp=cfg.pp), 8, "fp32")  # the defaults run


def test_a_run_refuses_what_no_pipeline_can_run_before_counting_processes(tiny):
    from rich.console import Console

    from gpudl.run.recipe import train

    with pytest.raises(UserError, match="set --set model.tie_embeddings=false"):  # not "needs 2 processes"
        train(tiny("parallel.pp=2"), console=Console(quiet=True))
