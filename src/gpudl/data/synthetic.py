"""Random batches of the right shape, for benchmarks that must not wait on real data."""

from __future__ import annotations

import torch


class SyntheticTokens:
    """(x, y) random token ids (B, T); batch k is a pure function of (seed, k)."""

    def __init__(self, vocab_size: int, block_size: int, batch_size: int, seed: int):
        self.vocab_size, self.block_size, self.batch_size, self.seed = vocab_size, block_size, batch_size, seed

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        w = torch.randint(0, self.vocab_size, (self.batch_size, self.block_size + 1), generator=g)
        return w[:, :-1], w[:, 1:]


class SyntheticImages:
    """(images (B, C, S, S) standard normal, labels (B,)); batch k is a pure function of (seed, k)."""

    def __init__(self, channels: int, size: int, num_classes: int, batch_size: int, seed: int):
        self.shape = (batch_size, channels, size, size)
        self.num_classes, self.seed = num_classes, seed

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        return torch.randn(self.shape, generator=g), torch.randint(0, self.num_classes, self.shape[:1], generator=g)
