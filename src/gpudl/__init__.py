"""gpudl: train CNNs and Transformers as fast as your hardware allows, on any accelerator or the CPU.

>>> import gpudl
>>> cfg = gpudl.load_config(None, ["train.max_steps=10"])
>>> cfg.model.name
'gpt-tiny'
"""

from .config import Config, load_config
from .device import DeviceInfo, detect
from .errors import UserError

from .version import __version__


def train(cfg: Config, resume=None, console=None):
    """Train the model a config describes; `resume`: a run folder to continue (`gpudl.run.recipe.train`).

    >>> result = gpudl.train(gpudl.load_config("gpt-tiny", ["train.max_steps=20"]))  # doctest: +SKIP
    """
    from .run.recipe import train as _train

    return _train(cfg, resume=resume, console=console)


def fit(model, train_data, loss=None, **options):
    """Train any nn.Module on the best device (`gpudl.run.fit.fit` lists the options).

    >>> result = gpudl.fit(torch.nn.Linear(8, 2), (x, y), loss=F.cross_entropy, max_steps=500)  # doctest: +SKIP
    """
    from .run.fit import fit as _fit

    return _fit(model, train_data, loss, **options)


def plan(cfg: Config | None = None, *, target: str | None = None, nproc_per_node: int = 1, nnodes: int = 1,
         memory_limit: str | int | None = None, device: str = "auto"):
    """Will this job fit, and what is the fastest way to make it fit? (`gpudl.memory.plan.plan`)

    Traces one training step per candidate layout on fake tensors (nothing is allocated) for
    this machine's device (`device`), a named GPU (`target`, e.g. "a100-40gb"), or any
    `memory_limit` per device ("12GiB" or bytes). Returns the `Plan`: its `candidates` (each with
    its `estimate.parts` and why it was rejected) and the `winner`, whose `sets` apply it.

    >>> p = gpudl.plan(gpudl.load_config("gpt2-124m"), target="a100-40gb", nproc_per_node=8)  # doctest: +SKIP
    >>> p.winner.sets  # doctest: +SKIP
    """
    from .config.sizes import parse_size
    from .memory.plan import local_machine, plan as _plan, target_machine

    cfg = cfg if cfg is not None else load_config(None)
    limit = parse_size(memory_limit) if isinstance(memory_limit, str) else memory_limit
    machine = target_machine(target, nproc_per_node, nnodes, limit) if target else \
        local_machine(device, nproc_per_node, nnodes, limit)
    return _plan(cfg, machine)


__all__ = ["fit", "plan", "Config", "DeviceInfo", "UserError", "detect", "load_config", "train", "__version__"]
