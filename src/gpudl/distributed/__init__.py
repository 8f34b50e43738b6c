"""Spreading a model over devices and machines on torch.distributed (and the one order it happens in)."""
