"""Text from a trained byte-level GPT."""

from __future__ import annotations

import torch

from .gpt import GPT, generate


def sample_text(model: GPT, prompt: str, tokens: int, temperature: float = 0.8, top_k: int = 40,
                seed: int = 0) -> str:
    """Continue `prompt` by `tokens` bytes; undecodable bytes show as U+FFFD."""
    if model.cfg.vocab_size < 256:
        raise ValueError("sample_text needs a byte-level model (vocab_size >= 256)")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt.encode("utf8")) or [10]], dtype=torch.long, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = generate(model, ids, tokens, temperature=temperature, top_k=top_k, generator=g)
    model.train(was_training)
    return bytes(min(int(t), 255) for t in out[0].tolist()).decode("utf8", errors="replace")
