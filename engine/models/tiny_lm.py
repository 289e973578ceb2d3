"""The built-in causal language model of `tierzero train`: a small GPT over bytes.

Byte-level (vocabulary 256), pre-norm transformer blocks, learned positions,
tied input/output embedding. Each `Block` is one engine unit (named in
`_no_split_modules`, as Hugging Face models do); the embeddings and the final
norm form the root unit.

forward(input_ids, labels=None) -> LMOutput(logits, loss): `labels` are the
next-token targets aligned with `input_ids` (shifted by the caller), so the
loss is plain cross-entropy over every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


@dataclass(frozen=True)
class TinyLMConfig:
    """Shape of the built-in model."""

    dim: int = 512
    layers: int = 8
    heads: int = 8
    max_seq_len: int = 256
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")

    @property
    def num_parameters(self) -> int:
        """Parameters (tied head counted once): hand arithmetic, checked by a test."""
        d, h = self.dim, self.mlp_ratio * self.dim
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return VOCAB * d + self.max_seq_len * d + self.layers * block + 2 * d


# Named sizes for `train.model: builtin:<size>`; "small" is the embedded default.
SIZES: dict[str, TinyLMConfig] = {
    "tiny": TinyLMConfig(dim=64, layers=2, heads=4, max_seq_len=128),
    "small": TinyLMConfig(),  # 25.5M parameters
    "base": TinyLMConfig(dim=768, layers=12, heads=12, max_seq_len=512),
}


@dataclass
class LMOutput:
    logits: torch.Tensor  # (B, T, VOCAB)
    loss: torch.Tensor | None  # scalar fp32, when labels were given


class Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # (B, H, T, C/H)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.dim
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyLM(nn.Module):
    _no_split_modules = ("Block",)

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(
                    ("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        b, t = input_ids.shape  # (B, T) int64 byte values
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.tok.weight)  # tied head, (B, T, VOCAB)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(b * t, VOCAB), labels.reshape(b * t))
        return LMOutput(logits, loss)
