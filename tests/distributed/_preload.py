"""What the fork server that CPU ranks are forked from (helper.py) does once, so that no rank does it
again: the imports every rank needs, and the default corpus's file list (a walk of the standard
library, cached per process, the same in every rank: the library does not change during a session)."""

import torch.distributed.checkpoint  # noqa: F401

import bodies  # noqa: F401
import gpudl.config  # noqa: F401
import gpudl.run.fit  # noqa: F401
import gpudl.run.recipe  # noqa: F401
from gpudl.data.text.sources import stdlib_sources

stdlib_sources()
