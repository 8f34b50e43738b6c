"""Tensor parallelism's checks, without processes: what it refuses, in one line with the fix."""

import pytest

from gpudl import models
from gpudl.cli import main
from gpudl.distributed.tensor import check_tp
from gpudl.errors import UserError


def meta(name: str, **overrides):
    return models.build_meta(models.resolve(name, overrides))


def test_a_model_without_a_plan_is_refused():
    with pytest.raises(UserError, match=r"parallel.tp=2: tp for a model with no tensor-parallel plan \(ResNet; "
                                        r".*set --set parallel.tp=1"):
        check_tp(meta("resnet18"), 2, sequence_parallel=False)


def test_tp_must_divide_the_heads_and_widths():
    check_tp(meta("gpt-tiny"), 4, sequence_parallel=True)  # 4 heads, width 128, MLP 512, context 128
    with pytest.raises(UserError, match="parallel.tp=3 must divide model.n_head=4, model.d_model=128 and "
                                        "the MLP width=512: set --set parallel.tp to one of 1, 2, 4, "):
        check_tp(meta("gpt-tiny"), 3, sequence_parallel=False)
    with pytest.raises(UserError, match="parallel.tp=4 must divide model.block_size=30: .* one of 1, 2, "):
        check_tp(meta("gpt-tiny", block_size=30), 4, sequence_parallel=True)
    check_tp(meta("gpt-tiny", block_size=30), 4, sequence_parallel=False)  # only sequence parallelism splits T


@pytest.mark.parametrize("sets, words", [
    (["--config", "resnet18", "--set", "parallel.tp=2"], "tp for a model with no tensor-parallel plan"),
    (["--set", "model.n_head=4", "--set", "parallel.tp=3"], "parallel.tp=3 must divide model.n_head=4"),
])
def test_the_command_line_says_it_in_one_line(tmp_path, capsys, sets, words):
    # Refused before the number of processes is looked at: no count of processes would fix it.
    assert main(["train", *sets, "--set", f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
