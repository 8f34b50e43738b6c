"""Text from a trained GPT, through the tokenizer of its run (bytes unless the run kept a tokenizer.json)."""

from __future__ import annotations

import torch

from ..data.tokenizer import ByteTokenizer, Tokenizer
from ..models.gpt import GPT, generate


class UnknownToken(ValueError):
    """The prompt encodes to a token id the model does not have: the tokenizer is another model's."""


class _Known:
    """The model as `generate` calls it, its logits cut to the tokens the tokenizer knows: a vocabulary
    padded past the tokenizer's (to a multiple of 64, say) has rows that decode to nothing, never drawn."""

    def __init__(self, model: GPT, known: int):
        self.model, self.cfg, self.known = model, model.cfg, known

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[..., :self.known]  # (B, T, known)


def sample_text(model: GPT, prompt: str, tokens: int, temperature: float = 0.8, top_k: int = 40,
                seed: int = 0, tokenizer: Tokenizer | None = None) -> str:
    """The prompt continued by `tokens` tokens, decoded; bytes that do not form UTF-8 show as U+FFFD.
    `temperature` 0: the likeliest token each time (greedy; `top_k` and `seed` then change nothing).

    Raises UnknownToken when the prompt encodes to a token id the model does not have."""
    tokenizer = tokenizer or ByteTokenizer()
    ids = tokenizer.encode(prompt) or tokenizer.encode("\n") or [0]  # something to continue from
    if max(ids) >= model.cfg.vocab_size:
        raise UnknownToken(f"the prompt encodes to token id {max(ids)} (tokenizer {tokenizer.name}), past this "
                           f"model's vocabulary of {model.cfg.vocab_size}: use a prompt of tokens it knows")
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    known = _Known(model, min(tokenizer.vocab_size, model.cfg.vocab_size))
    out = generate(known, torch.tensor([ids], dtype=torch.long, device=device), tokens, temperature=temperature,
                   top_k=top_k, generator=g)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())
