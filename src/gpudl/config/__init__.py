"""The typed config tree of a training run (tree.py), its loading (load.py) and typed checks (settings.py).

>>> cfg = load_config(None, ["train.max_steps=10", "model.n_layer=2"])
>>> cfg.train.max_steps, cfg.model.name, cfg.model.overrides["n_layer"]
(10, 'gpt-tiny', 2)
"""

from .load import config_from_dict, load_config, recipe_names, with_sets
from .tree import (CheckpointConfig, Config, DataConfig, LogConfig, ModelConfig, OptimConfig, ParallelConfig,
                   RunConfig, SampleConfig, TrainConfig)

__all__ = ["CheckpointConfig", "Config", "DataConfig", "LogConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
           "RunConfig", "SampleConfig", "TrainConfig", "config_from_dict", "load_config", "recipe_names", "with_sets"]
