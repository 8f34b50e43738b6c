"""A GPT-style decoder: pre-norm blocks, causal `scaled_dot_product_attention`, tied embeddings.

Query, key and value have separate projections so that tensor parallelism can shard them
column-wise by heads; attention infers the number of local heads from the tensor it gets.

>>> import torch
>>> m = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16)); m.init_weights()
>>> m(torch.zeros(1, 8, dtype=torch.long)).shape
torch.Size([1, 8, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..config.settings import option
from .attention import sdpa

# The MLP's GELU: its tanh form, GPT-2's own (`gelu_new`), so that the Hugging Face export is exact
# (`interop/hf.py` refuses to export under any other).
GELU_APPROXIMATE = "tanh"


@dataclass(kw_only=True)
class GPTConfig:
    n_layer: int = option(4, "transformer blocks", ge=1)
    n_head: int = option(4, "attention heads", ge=1)
    d_model: int = option(128, "width of the residual stream", ge=1)
    block_size: int = option(128, "context length in tokens", ge=1)
    vocab_size: int = option(256, "token ids the model knows (256: raw bytes)", ge=1)
    dropout: float = option(0.0, "dropout probability", ge=0.0, le=1.0)
    bias: bool = option(False, "biases in linear layers and norms")
    mlp_ratio: int = option(4, "hidden width of the MLP as a multiple of d_model", ge=1)
    tie_embeddings: bool = option(True, "share the token embedding with the output head "
                                        "(pipeline parallelism needs false: they live on different stages)")

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise UserError(f"model.d_model={self.d_model} must be divisible by model.n_head={self.n_head}: "
                            f"pick n_head among the divisors of {self.d_model}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class Attention(nn.Module):
    # The kernel attention runs on: SDPA's own choice unless `models.attention.use_attention` sets another
    # (training on the CPU takes the one measured fastest: `gpudl.training.kernels`).
    attention_kernel_slot = True
    kernel = staticmethod(sdpa)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        c = cfg.d_model
        self.head_dim, self.dropout = cfg.head_dim, cfg.dropout
        self.wq = nn.Linear(c, c, bias=cfg.bias)
        self.wk = nn.Linear(c, c, bias=cfg.bias)
        self.wv = nn.Linear(c, c, bias=cfg.bias)
        self.wo = nn.Linear(c, c, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        q, k, v = self._heads(x)
        y = self.kernel(q, k, v, self.dropout if self.training else 0.0)
        return self._merge(y)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v, each (B, H, T, D); H is the local head count, which tensor parallelism divides."""
        b, t, _ = x.shape
        return tuple(w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))

    def _merge(self, y: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B, T, C)
        b, _, t, _ = y.shape
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def prefill(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Causal attention over B whole prompts of one length x (B, T, C), keeping their keys and
        values in their slots' caches (B, H, block_size, D) at positions 0..T-1. Inference only (no dropout)."""
        q, k, v = self._heads(x)  # (B, H, T, D)
        t = x.shape[1]
        k_cache[:, :, :t], v_cache[:, :, :t] = k, v
        return self._merge(self.kernel(q, k, v, 0.0))

    def decode(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """One new token per sequence: x (N, 1, C) at positions pos (N,), sequence i in cache slot i.

        k_cache, v_cache: (slots, H, block_size, D). Each row's key and value go in at its own
        position, then every row attends to its keys 0..pos[i] through mask (N, 1, 1, L), where L
        is the longest row's length: rows of different lengths share one SDPA call.
        """
        q, k, v = self._heads(x)  # (N, H, 1, D)
        n, length = x.shape[0], mask.shape[-1]
        rows = torch.arange(n, device=x.device)
        k_cache[rows, :, pos], v_cache[rows, :, pos] = k[:, :, 0], v[:, :, 0]  # (N, H, D) each
        # SDPA itself, not the `kernel` slot: the kernels measured for training are causal-only, with no mask.
        y = F.scaled_dot_product_attention(q, k_cache[:n, :, :length], v_cache[:n, :, :length], attn_mask=mask)
        return self._merge(y)  # (N, 1, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=GELU_APPROXIMATE))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))

    def cached(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The block for generation: `attend` is this block's attention with its cache bound (no dropout)."""
        x = x + attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); with targets, the mean cross-entropy instead.

    Blocks sit in a ModuleDict keyed by layer number, so a pipeline stage that keeps only some
    of them (and drops the embeddings or the head) still names every parameter as the whole
    model does: checkpoints move between pipeline sizes unchanged.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # Moving a module off the meta device gives each parameter new storage; tie again after.
        if self.cfg.tie_embeddings and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer)."""
        self.tie_weights()
        std = 0.02
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for block in self.blocks.values():
            for proj in (block.attn.wo, block.mlp.proj):
                nn.init.normal_(proj.weight, 0.0, std / math.sqrt(2 * self.cfg.n_layer))

    def activation_checkpoint_units(self) -> list[nn.Module]:
        return list(self.blocks.values())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """A pipeline stage without embeddings takes hidden states (B, T, C) instead of ids."""
        if self.wte is not None:
            t = idx.shape[1]
            if t > self.cfg.block_size:
                raise ValueError(f"sequence of {t} tokens is longer than block_size={self.cfg.block_size}")
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))  # (B, T, C)
        else:
            x = idx
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None:
            return x  # hidden states for the next pipeline stage
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        return lm_loss(logits, targets)

    # Generation with a KV cache (inference only: no dropout, the whole model in one process).

    def prefill(self, idx: torch.Tensor, cache: KVCache, slot: int) -> torch.Tensor:
        """Run B prompts of one length idx (B, T) causally, keeping their keys and values in cache
        slots slot..slot+B-1; returns the logits (B, V) of their last positions."""
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        for i, block in enumerate(self.blocks.values()):
            k, v = cache.k[i, slot:slot + b], cache.v[i, slot:slot + b]  # (B, H, block_size, D)
            x = block.cached(x, lambda h, a=block.attn, k=k, v=v: a.prefill(h, k, v))
        return self.lm_head(self.norm(x[:, -1]))

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One step for the sequences in cache slots 0..N-1: tokens (N,) at positions pos (N,),
        each the length of its sequence so far; returns the next-token logits (N, V)."""
        x = (self.wte(tokens) + self.wpe(pos))[:, None]  # (N, 1, C)
        length = int(pos.max()) + 1  # one host sync per step; the sampler reads the logits right after anyway
        # (N, 1, 1, L): row i sees keys 0..pos[i]; the rest of the slot is an earlier sequence's or zeros.
        mask = (torch.arange(length, device=pos.device) <= pos[:, None])[:, None, None]
        for i, block in enumerate(self.blocks.values()):
            k, v = cache.k[i], cache.v[i]  # (slots, H, block_size, D)
            x = block.cached(x, lambda h, a=block.attn, k=k, v=v: a.decode(h, k, v, pos, mask))
        return self.lm_head(self.norm(x[:, 0]))


class KVCache:
    """Keys and values of up to `slots` sequences, preallocated for their whole context.

    k, v: (layers, slots, heads, block_size, head_dim). Preallocated rather than a tensor per
    request, because: the memory is known when a server starts (it fails then, not under load);
    a decoding step of N sequences reads one view of slots 0..N-1 instead of stacking N caches
    anew every step (a copy of the whole cache per token); and a sequence leaving costs one move
    (the last slot's sequence into the freed slot, `move`), joining nothing beyond its prefill.
    The price: every slot holds room for block_size tokens, used or not.
    Zeros at first: masked positions get zero weight, and zero times a stale finite value is
    zero, where uninitialised memory could hold NaN.
    """

    def __init__(self, cfg: GPTConfig, slots: int, device: torch.device, dtype: torch.dtype):
        shape = (cfg.n_layer, slots, cfg.n_head, cfg.block_size, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot src to slot dst (a sequence changes slot)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T), in fp32.

    Also what a pipeline's schedule applies to its last stage's output.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def formula_flops_per_token(cfg: GPTConfig, n_params: int) -> int:
    """Training FLOPs per token: 6N + 12 * L * H * Q * T (Kaplan et al.; PaLM appendix B)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend token ids (B, T) by `new_tokens` sampled ones; returns (B, T + new_tokens).

    `temperature` 0 is greedy, the likeliest token each time, as the OpenAI API and `transformers` take it."""
    for _ in range(new_tokens):
        context = idx[:, -model.cfg.block_size:]
        logits = model(context)[:, -1, :].float()  # (B, V)
        if temperature == 0:
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
