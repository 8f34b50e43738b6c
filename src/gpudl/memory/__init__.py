"""Memory before it runs: a training step's peak per rank traced on fake tensors (trace.py), per
strategy (estimate.py)."""
