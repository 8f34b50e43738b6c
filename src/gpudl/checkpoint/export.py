"""A trained model's weights as one safetensors file: tensors only, nothing that can run when read."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ..errors import UserError


def export_safetensors(model: nn.Module, path: Path, metadata: dict[str, str], state: dict | None = None) -> Path:
    """Write a (whole, single-process) model's weights to one safetensors file (shared tensors once);
    `state`: its whole state dict where it was gathered already (a sharded model's)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("exporting to safetensors needs the safetensors package: pip install 'gpudl[export]'") from None
    seen, tensors = set(), {}
    for name, t in (state if state is not None else get_model_state_dict(model)).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:  # tied weights (GPT's embedding and head) are stored once
            seen.add(key)
            tensors[name] = t.detach().cpu().contiguous()
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write {path} ({e.strerror or e}): choose a place with room that you can write") from e
    return path
