"""gpudl: train CNNs and Transformers as fast as your hardware allows, on any accelerator or the CPU.

    gpudl.fit(model, data, loss=...)    any nn.Module (yours, Hugging Face's, timm's) -> FitResult
    gpudl.train(gpudl.load_config(...)) a recipe that ships (gpt-tiny ... gpt-1b, resnet18 ... 152) -> RunResult
    gpudl.plan(cfg, target="h100-80gb") will it fit, and the fastest layout that does -> Plan
    gpudl.detect()                      the device a run would take -> DeviceInfo

`fit`, `train` and `plan` are the real functions (their signatures and docstrings are theirs), imported
on first use so that `import gpudl` stays light. docs/python.md shows them at work.

>>> import gpudl
>>> cfg = gpudl.load_config(None, ["train.max_steps=10"])
>>> cfg.model.name
'gpt-tiny'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .config import Config, ParallelConfig, load_config
from .device import DeviceInfo, detect
from .errors import UserError
from .version import __version__

if TYPE_CHECKING:  # what editors and type checkers see; at run time `__getattr__` imports them when first asked
    from .memory.plan import Plan
    from .run.fit import FitResult, Metrics, fit
    from .run.plan import plan
    from .run.recipe import RunResult, train

# public name -> the module that defines it (imported on first use)
_LAZY = {"fit": "run.fit", "FitResult": "run.fit", "Metrics": "run.fit", "train": "run.recipe",
         "RunResult": "run.recipe", "plan": "run.plan", "Plan": "memory.plan"}

__all__ = ["Config", "DeviceInfo", "FitResult", "Metrics", "ParallelConfig", "Plan", "RunResult", "UserError",
           "__version__", "detect", "fit", "load_config", "plan", "train"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gpudl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # asked once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
