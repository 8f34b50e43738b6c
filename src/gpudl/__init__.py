"""gpudl: train CNNs and Transformers as fast as your hardware allows, on any accelerator or the CPU.

>>> import gpudl
>>> cfg = gpudl.load_config(None, ["train.max_steps=10"])
>>> cfg.model.name
'gpt-tiny'
"""

from .config import Config, load_config
from .device import DeviceInfo, detect
from .errors import UserError

__version__ = "0.1.0"


def train(cfg: Config, resume=None, console=None):
    """Train the model a config describes; `resume`: a run folder to continue (`gpudl.training.recipe.train`).

    >>> result = gpudl.train(gpudl.load_config("gpt-tiny", ["train.max_steps=20"]))  # doctest: +SKIP
    """
    from .training.recipe import train as _train

    return _train(cfg, resume=resume, console=console)


def fit(model, train_data, loss=None, **options):
    """Train any nn.Module on the best device (`gpudl.training.fit.fit` lists the options).

    >>> result = gpudl.fit(torch.nn.Linear(8, 2), (x, y), loss=F.cross_entropy, max_steps=500)  # doctest: +SKIP
    """
    from .training.fit import fit as _fit

    return _fit(model, train_data, loss, **options)


__all__ = ["fit", "Config", "DeviceInfo", "UserError", "detect", "load_config", "train", "__version__"]
