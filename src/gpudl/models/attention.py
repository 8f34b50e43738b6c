"""Causal attention for the models: SDPA's own kernel choice by default, and the kernels gpudl
may choose between on the CPU instead (`gpudl.training.kernels` measures which is fastest).

A model calls its attention through an attribute (`kernel`) that `use_attention` sets; the model
itself never measures anything.

>>> q = k = v = torch.randn(2, 4, 16, 8)
>>> sdpa(q, k, v).shape
torch.Size([2, 4, 16, 8])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v for (batch, heads, tokens, head size), on SDPA's own choice of kernel."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def _sdpa_on(backend: SDPBackend) -> Kernel:
    def kernel(q, k, v, dropout_p):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    return kernel


def composed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention as four plain ops, in q's dtype; q is scaled before the product (fewer elements, no fp16 overflow)."""
    t, d = q.shape[-2:]
    scores = (q * d**-0.5) @ k.transpose(-2, -1) + _future_mask(t, q.dtype, q.device)  # (B, H, T, T)
    weights = F.dropout(scores.softmax(-1), dropout_p) if dropout_p else scores.softmax(-1)
    return weights @ v


def _future_mask(t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(T, T): -inf where a key lies after the query, 0 elsewhere (adding it beat masked_fill by 20%).

    Made afresh each call (microseconds): a cached tensor could outlive the mode it was made in.
    """
    return torch.full((t, t), float("-inf"), dtype=dtype, device=device).triu(1)


# The kernels a measurement chooses between on the CPU: SDPA's two, and the composition above.
CPU_KERNELS: dict[str, Kernel] = {"flash": _sdpa_on(SDPBackend.FLASH_ATTENTION), "math": _sdpa_on(SDPBackend.MATH),
                                  "composed": composed}


def use_attention(model: nn.Module, kernel: Kernel) -> int:
    """Make every attention layer of `model` (a module with a `kernel` for it) call `kernel`; how many there are."""
    layers = [m for m in model.modules() if getattr(type(m), "attention_kernel_slot", False)]
    for layer in layers:
        layer.kernel = kernel
    return len(layers)
