"""How `gpudl.fit` turns a user's batch into a loss (training) and into validation metrics.

A batch is a tuple (inputs..., target) or a dict whose "labels" is the target. With a `loss`
function the model's prediction (its output, or the output's `logits` or first element) and the
target go to it; with `loss=None` the model computes its own loss (a tensor, or its output's `loss`).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..data.loader import Batch
from ..errors import UserError


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature Python cannot read
        return False


def _prediction(out: Any) -> Any:
    """What a user's `loss` gets from the model's output: its logits, else its first element, else itself."""
    if isinstance(out, Mapping):  # a dict, or a Hugging Face ModelOutput
        return out["logits"] if "logits" in out else next(iter(out.values()))
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def _own_loss(out: Any) -> Any:
    """With loss=None: the model's output itself, or its `loss` field (a dict, a dataclass, a ModelOutput)."""
    found = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    if found is None:
        raise UserError(f"with loss=None the model must compute its loss, but it returned a {type(out).__name__} "
                        f"without one: give the model its targets (a dict batch with 'labels', as Hugging Face "
                        f"models take them) or pass loss=")
    return found


def _scalar(loss: Any) -> torch.Tensor:
    """The loss, if it is one number that backward can follow to the weights."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        if not loss.requires_grad:
            raise UserError("the loss does not depend on any trainable parameter (it has no gradient): compute it "
                            "from the model's output, without .detach()")
        return loss
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
        f"a {type(loss).__name__} ({repr(loss)[:40]})"
    raise UserError(f"the loss must be a scalar tensor, got {got}: return one value as a tensor (F.cross_entropy(...), "
                    f"loss.mean()), not loss.item()")


def _predict(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
    """(the model's prediction, the target) for a `loss=` given: the target never reaches the model."""
    if isinstance(batch, dict):
        if "labels" not in batch:
            raise UserError(f"with loss= given, a dict batch holds the target under 'labels', but this one has "
                            f"{list(batch)}: name the target 'labels', or pass loss=None if the model computes "
                            f"its loss")
        return _prediction(model(**{k: v for k, v in batch.items() if k != "labels"})), batch["labels"]
    if len(batch) < 2:
        raise UserError(f"with loss= given, a batch is (inputs..., target), but this one holds {len(batch)} "
                        f"element: add the target, or pass loss=None if the model computes its loss")
    return _prediction(model(*batch[:-1])), batch[-1]


def _own_forward(model: nn.Module, batch: Batch, labels_by_name: bool) -> Any:
    """The model's output for loss=None: a dict batch as keyword arguments, a tuple by position (its last
    element as `labels=` for a model that takes them)."""
    if isinstance(batch, dict):
        return model(**batch)
    if labels_by_name and len(batch) > 1:  # (inputs..., labels) for a model that takes labels=
        return model(*batch[:-1], labels=batch[-1])
    return model(*batch)


def loss_fn_for(loss: Callable | None, model: nn.Module) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """How a batch becomes a loss; the result is checked to be a scalar with a gradient, every step."""
    if loss is not None:
        return lambda m, batch: _scalar(loss(*_predict(m, batch)))
    labels_by_name = _takes_labels(model)
    return lambda m, batch: _scalar(_own_loss(_own_forward(m, batch, labels_by_name)))


def _target(batch: Batch) -> Any:
    if isinstance(batch, dict):
        if "labels" not in batch:
            raise UserError(f"metrics= gets (prediction, target), and a dict batch holds the target under 'labels', "
                            f"but this one has {list(batch)}: name the target 'labels'")
        return batch["labels"]
    if len(batch) < 2:
        raise UserError("metrics= gets (prediction, target), but this batch holds 1 element: add the target")
    return batch[-1]


def _number(name: str, value: Any) -> torch.Tensor:
    """One metric's value as a 0-dim float tensor (evaluation averages it over the samples)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).float()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.tensor(float(value))
    got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
    raise UserError(f"metrics= must return a dict of numbers (one value per batch, a mean over its samples), but "
                    f"{name!r} is {got}: reduce it, e.g. (pred.argmax(-1) == target).float().mean()")


def eval_fn_for(loss: Callable | None, model: nn.Module, metrics: Callable | None):
    """What one validation batch gives: {"loss": ...} and what `metrics(prediction, target)` returns, from
    one forward. Evaluation weighs each batch by its samples, so each value is a mean over the batch."""
    labels_by_name = _takes_labels(model)

    def run(m: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        if loss is not None:
            pred, target = _predict(m, batch)
            value = loss(pred, target)
        else:
            out = _own_forward(m, batch, labels_by_name)
            value = _own_loss(out)
            pred, target = (_prediction(out), _target(batch)) if metrics is not None else (None, None)
        found = {"loss": _number("loss", value)}
        if metrics is not None:
            extra = metrics(pred, target)
            if not isinstance(extra, Mapping):
                raise UserError(f"metrics= must return a dict of numbers (name -> value), got a "
                                f"{type(extra).__name__}: return e.g. {{'accuracy': ...}}")
            found.update({str(k): _number(str(k), v) for k, v in extra.items() if str(k) != "loss"})
        return found
    return run
