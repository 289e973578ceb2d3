"""The MLP-block language model the engine benchmarks share (one ZeRO unit per `Block`)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLPModel(nn.Module):
    def __init__(self, vocab: int, dim: int, n_blocks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x)).float()  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
