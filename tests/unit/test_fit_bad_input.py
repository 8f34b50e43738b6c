"""Bad input to `gpudl.fit` is refused with one line that names the value and the fix, before
anything is trained or written."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gpudl
from gpudl import UserError

QUIET = dict(device="cpu", precision="fp32", progress=False, quiet=True)


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def refused(model=None, train_data=None, **kwargs) -> str:
    """fit's one-line message for this input; the model's weights must be as they were."""
    model = model if model is not None else net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError) as e:
        gpudl.fit(model, data() if train_data is None else train_data, **{"loss": F.cross_entropy, "max_steps": 2,
                                                                           "batch_size": 8, **QUIET, **kwargs})
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters())), "fit trained before refusing"
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["max_steps", "batch_size", "grad_accum", "log_every"])
def test_counts_below_one_are_refused(name):
    assert refused(**{name: 0}) == f"{name} must be >= 1, got 0: pass {name}=<a value >= 1>"


def test_a_learning_rate_of_the_wrong_type_is_refused():
    assert refused(lr="fast") == "lr must be float, got 'fast'"


@pytest.mark.parametrize("returned, words", [
    (lambda out, y: F.cross_entropy(out, y).item(), "got a float ("),
    (lambda out, y: F.cross_entropy(out, y, reduction="none"), "got a tensor of shape (8,)"),
])
def test_a_loss_that_is_not_a_scalar_tensor_is_refused(returned, words):
    message = refused(loss=returned)
    assert message.startswith("the loss must be a scalar tensor, ") and words in message and "loss.mean()" in message


def test_a_loss_without_a_gradient_is_refused():
    message = refused(loss=lambda out, y: F.cross_entropy(out.detach(), y))
    assert message.startswith("the loss does not depend on any trainable parameter")


def test_a_model_without_trainable_parameters_is_refused():
    model = net()
    model.requires_grad_(False)
    assert refused(model) == ("the model (Sequential) has no trainable parameters (none, or all with "
                              "requires_grad=False): unfreeze some with p.requires_grad_(True)")
    assert "no trainable parameters" in refused(torch.nn.ReLU())


@pytest.mark.parametrize("empty, words", [
    (TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)), "a TensorDataset, is empty (length 0)"),
    ([], "a list, yields no batches"),
    ((b for b in []), "a generator, yields no batches"),
])
def test_empty_data_is_refused(empty, words):
    assert words in refused(train_data=empty)


class Ragged(Dataset):
    """Samples whose inputs have 8 features, except sample 5 with 7."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.zeros(7 if i == 5 else 8), 0


def test_samples_of_different_shapes_are_named():
    message = refused(train_data=Ragged(), batch_size=16)
    assert "samples" in message and "of the dataset have different shapes" in message
    assert "((8,), 0) and ((7,), 0)" in message and "pad" in message
    message = refused(train_data=DataLoader(Ragged(), batch_size=16))  # collated by the DataLoader itself
    assert message.startswith("the training data, a DataLoader, cannot stack its samples into one batch (stack "
                              "expects each tensor to be equal size, but got [8] at entry 0 and [7] at entry 5)")


def test_tensors_of_different_lengths_are_refused():
    x, y = data()
    assert "their first dimensions are {0: 64, 1: 60}" in refused(train_data=(x, y[:60]))


def test_a_dict_batch_without_labels_is_refused_when_a_loss_is_given():
    x, y = data()
    message = refused(train_data=[{"x": x[:8], "target": y[:8]}])
    assert message.startswith("with loss= given, a dict batch holds the target under 'labels', but this one has "
                              "['x', 'target']")


def test_a_generator_that_runs_out_says_it_is_read_once():
    x, y = data()
    batches = ((x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8))  # 3 batches for 5 steps
    with pytest.raises(UserError, match=r"^the training data, a generator, ran out after 3 batches: a generator or "
                                        r"iterator can be read only once; pass a list of batches, a Dataset"):
        gpudl.fit(net(), batches, loss=F.cross_entropy, max_steps=5, **QUIET)


def test_a_model_output_without_a_loss_is_refused():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16,
                                                                 n_positions=8))
    message = refused(model, [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}], loss=None)
    assert message.startswith("with loss=None the model must compute its loss, but it returned a "
                              "CausalLMOutputWithCrossAttentions without one")


@pytest.mark.parametrize("held", ["metrics.jsonl", "config.toml", "checkpoints/step-1/.metadata"])
def test_a_run_folder_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path, held):
    run = tmp_path / "run"
    (run / held).parent.mkdir(parents=True)
    (run / held).write_text("earlier run")
    before = {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in run.rglob("*")}
    assert refused(run_dir=run) == (f"run folder {run} already holds a run: continue it with resume={str(run)!r}, "
                                    f"pass another run_dir=, or delete the folder to start again")
    assert {p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in run.rglob("*")} == before


def test_keywords_that_need_another_are_refused():
    assert refused(checkpoint_every=5) == "checkpoint_every=5 saves checkpoints into the run folder: pass run_dir= too"
    assert refused(checkpoint_every=-1) == ("checkpoint_every must be an int >= 0 (0: at the end only), got -1: pass "
                                            "checkpoint_every=<steps between checkpoints>")
    assert refused(metrics=lambda p, t: {}) == "metrics= are computed on the validation data: pass val_data= too"
    assert refused(resume="auto") == ("resume='auto' continues run_dir when it holds a checkpoint and starts it "
                                      "otherwise: pass run_dir= too")


def test_validation_data_that_can_be_read_only_once_is_refused():
    x, y = data()
    assert refused(val_data=((x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8))) == (
        "the validation data, a generator, can be read only once, and every evaluation reads all of it: pass a list "
        "of batches, a Dataset, tensors or a DataLoader")


def test_metrics_that_are_not_numbers_are_named():
    x, y = data()
    with pytest.raises(UserError) as e:
        gpudl.fit(net(), (x, y), loss=F.cross_entropy, max_steps=1, batch_size=8, val_data=(x[:16], y[:16]),
                  metrics=lambda pred, target: {"hits": pred.argmax(-1) == target}, **QUIET)
    assert str(e.value) == ("metrics= must return a dict of numbers (one value per batch, a mean over its samples), "
                            "but 'hits' is a tensor of shape (8,): reduce it, e.g. (pred.argmax(-1) == "
                            "target).float().mean()")


def test_the_commands_do_not_take_a_fit_run_for_a_recipe_run(tmp_path):
    from gpudl.config import load_config

    x, y = data()
    gpudl.fit(net(), (x, y), loss=F.cross_entropy, max_steps=1, batch_size=8, run_dir=tmp_path / "run", **QUIET)
    with pytest.raises(UserError, match=r"config.toml is the config of a gpudl.fit run, whose model is the user's own"):
        load_config(tmp_path / "run" / "config.toml")
