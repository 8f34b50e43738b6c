"""Serving trained models, from Python or over HTTP (`gpudl serve`).

From Python, with no HTTP in between (the engines run the model in a worker thread and answer
coroutines of the running event loop):

    from gpudl.serve import Sampling, load_model, make_engine

    engine = make_engine(load_model("runs/gpt-tiny-..."))   # a run folder, an export, or a .safetensors
    engine.start()
    done = await engine.complete(list(b"def "), Sampling(max_tokens=40, temperature=0))  # .ids, .text, .finish
    logits = await engine.infer(images)                       # a classifier's engine: (N, C, H, W) -> (N, K)
    await engine.stop()

No serving module is imported until one of its names is used (fastapi and uvicorn only by
`gpudl serve` itself).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "load", "Loaded": "load",
    "make_engine": "server",
    "Sampling": "generation", "GenerationEngine": "generation",
    "BatchingEngine": "batching",
    "BadInput": "engine", "QueueFull": "engine", "DeadlineExceeded": "engine", "EngineStopped": "engine",
    "EngineError": "engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpudl.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
