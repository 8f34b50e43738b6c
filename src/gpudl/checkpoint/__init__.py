"""Checkpoints: sharded DCP save and load that never runs code from the files, and safetensors export.

store.py    Checkpointer: save (atomic, every rank its shards) and load (verified, resharded)
background.py  saves copied at the step and written on a thread while training goes on (checkpoint.async)
files.py    which checkpoints are complete; manifest, confinement and state.json checks
reader.py   DCP's reader and planner with a restricted metadata unpickler and named failures
streams.py  RNG states across world sizes: restored where unchanged, re-seeded where not
export.py   the weights as one safetensors file
"""

from .export import export_safetensors
from .files import complete_checkpoints
from .store import Checkpointer, model_fingerprint

__all__ = ["Checkpointer", "complete_checkpoints", "export_safetensors", "model_fingerprint"]
