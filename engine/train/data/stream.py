"""Byte-level random windows: a text or JSONL file as one stream of byte tokens.

Tokenisation is the UTF-8 encoding itself (vocabulary 256), so any text works
and nothing has to be downloaded. Samples are windows of seq_len + 1 bytes at
random offsets (seeded; each rank draws its own), split into inputs and
next-byte labels.
"""

from __future__ import annotations

import json
import os
from importlib import resources

import torch

from tierzero.engine.train.data.errors import DataError

SHIPPED = "the shipped corpus (engine/data/corpus.txt)"


def load_bytes(path: str | None) -> tuple[torch.Tensor, str]:
    """(1D uint8 tokens, description) for a .txt/.jsonl file, or the shipped corpus."""
    if path is None:
        raw = resources.files("tierzero.engine.data").joinpath("corpus.txt").read_bytes()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8), SHIPPED
    if not os.path.isfile(path):
        raise DataError(f"train.dataset: '{path}' is not a file; give a .txt file or a .jsonl "
                        "file with a 'text' field per line, or null for the shipped corpus")
    if path.endswith(".jsonl"):
        raw = _jsonl_text(path).encode("utf-8")
    elif path.endswith(".txt"):
        with open(path, "rb") as f:
            raw = f.read()
    else:
        raise DataError(f"train.dataset: '{path}' has an unknown extension; allowed: .txt, .jsonl")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8), path


def _jsonl_text(path: str) -> str:
    parts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: needs a string field 'text'; found keys "
                                f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
            parts.append(text)
    return "\n\n".join(parts)


class ByteBatches:
    """Random (input_ids, labels) batches of shape (B, T) int64 from a byte stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, *,
                 seed: int, rank: int, source: str) -> None:
        if tokens.numel() < seq_len + 2:
            raise DataError(f"{source} has {tokens.numel()} bytes; train.seq_len {seq_len} needs "
                            f"at least {seq_len + 2}; lower train.seq_len or use more text")
        self.tokens = tokens.long()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.source = source
        # Each rank draws different windows; the same seed and rank repeat a run exactly.
        self._gen = torch.Generator().manual_seed(seed * 1000003 + rank)
        self.drawn = 0  # batches returned so far: the data position a checkpoint records

    def _starts(self) -> torch.Tensor:
        hi = self.tokens.numel() - self.seq_len - 1
        self.drawn += 1
        return torch.randint(0, hi + 1, (self.batch_size,), generator=self._gen)  # (B,)

    def skip(self, n: int) -> None:
        """Move past `n` batches without building them (resuming at a saved position)."""
        for _ in range(n):
            self._starts()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._starts()
        idx = starts[:, None] + torch.arange(self.seq_len + 1)  # (B, T + 1)
        window = self.tokens[idx]
        return window[:, :-1], window[:, 1:]  # inputs (B, T), next-byte labels (B, T)
