"""What a generation request asks for (`Sampling`), what it gets back (`Delta` per token as it streams,
`Completion` at the end), and how one token is drawn from a sequence's logits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .engine import BadInput


@dataclass(frozen=True)
class Sampling:
    """How one request is sampled. Checked when made: a bad value raises BadInput naming its field."""

    max_tokens: int = 16               # new tokens at most (>= 1)
    temperature: float = 1.0           # 0: greedy (argmax)
    top_k: int = 0                     # keep the k most likely tokens; 0: all
    top_p: float = 1.0                 # keep the most likely tokens up to this probability mass; 1: all
    stop: tuple[str, ...] = ()         # generation ends when the new text holds one; it is not returned
    seed: int | None = None            # the request's own generator; None: a fresh random seed

    def __post_init__(self):
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise BadInput("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadInput("temperature", f"must be a number >= 0 (0: greedy), got {self.temperature!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise BadInput("top_k", f"must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise BadInput("top_p", f"must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise BadInput("stop", f"must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise BadInput("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")


class Delta(NamedTuple):
    """One item of a stream: a new token and the text it made certain, or (token None) the end, with
    the text still held back and why it ended: "stop" (a stop text, not included) or "length"."""

    token: int | None
    text: str
    finish: str | None = None


class Completion(NamedTuple):
    """A whole answer: every token made (those of a stop text too: they were generated), its text, why it ended."""

    ids: list[int]
    text: str
    finish: str


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from logits (V,) in fp32 on the CPU: argmax at temperature 0, else temperature,
    then top-k, then top-p (nucleus), then a draw from `generator`."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)  # (V,)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        # Keep a token while the mass of the more likely ones is below top_p: the smallest such set (>= 1 token).
        sorted_p[(sorted_p.cumsum(0) - sorted_p) >= sampling.top_p] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
