"""Encoded examples -> (input_ids, labels) batches: packed or padded, shuffled per epoch.

A row is seq_len + 1 tokens; inputs are its first seq_len, labels its last
seq_len (the next token at each position), with IGNORE (-100, what
cross_entropy skips) where the next token is not a target (a prompt token, or
padding).

- pack: the examples of an epoch, in the epoch's order, concatenated into one
  stream and cut into rows every seq_len tokens (consecutive rows share one
  token: the last input target of a row is the first input of the next). No
  token is dropped but the last partial row; attention spans example
  boundaries inside a row, as in TRL's packing.
- pad: one example per row, cut to seq_len + 1 tokens and right-padded with
  the tokenizer's pad id. With right padding a causal model's logits at real
  positions never see the pads, so no attention mask is needed.

Every rank builds the same epoch (order seeded by seed and epoch) and takes
rows rank, rank + world, ...; a batch is batch_size of those. An epoch is
the whole batches every rank can fill; the remainder is dropped (each rank
must run the same number of forwards). `drawn` counts batches taken: a
checkpoint stores it and `skip` returns to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from tierzero.engine.train.data.encode import Example
from tierzero.engine.train.data.errors import DataError

IGNORE = -100
Packing = Literal["pack", "pad"]
Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids (B, T) int64, labels (B, T) int64


class Batches(Protocol):
    """A training batch stream with a position a checkpoint can record."""

    drawn: int

    def next(self) -> Batch: ...

    def skip(self, n: int) -> None: ...


def as_tensors(examples: Sequence[Example]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example as (ids 1D int64, target 1D bool), converted once."""
    return [(torch.tensor(e.ids, dtype=torch.int64), torch.tensor(e.target, dtype=torch.bool))
            for e in examples]


def pack_rows(examples: Sequence[Example] | Sequence[tuple[torch.Tensor, torch.Tensor]],
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, T + 1) int64, target (N, T + 1) bool) of the examples concatenated."""
    pairs = [e if isinstance(e, tuple) else (torch.tensor(e.ids, dtype=torch.int64),
                                             torch.tensor(e.target, dtype=torch.bool))
             for e in examples]
    ids = torch.cat([i for i, _ in pairs]) if pairs else torch.zeros(0, dtype=torch.int64)
    target = torch.cat([t for _, t in pairs]) if pairs else torch.zeros(0, dtype=torch.bool)
    if ids.numel() < seq_len + 1:
        return ids.new_zeros((0, seq_len + 1)), target.new_zeros((0, seq_len + 1))
    # windows of T + 1 every T tokens, as views: (N, T + 1)
    return ids.unfold(0, seq_len + 1, seq_len), target.unfold(0, seq_len + 1, seq_len)


def pad_rows(examples: Sequence[Example], seq_len: int,
             pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, T + 1) int64, target (N, T + 1) bool), one example per row, right-padded."""
    ids = torch.full((len(examples), seq_len + 1), pad_id, dtype=torch.int64)
    target = torch.zeros((len(examples), seq_len + 1), dtype=torch.bool)
    for r, e in enumerate(examples):
        n = min(len(e.ids), seq_len + 1)
        ids[r, :n] = torch.tensor(e.ids[:n], dtype=torch.int64)
        target[r, :n] = torch.tensor(e.target[:n], dtype=torch.bool)
    return ids, target


def rows_of(examples: Sequence[Example], seq_len: int, packing: Packing,
            pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    if packing == "pack":
        return pack_rows(examples, seq_len)
    return pad_rows(examples, seq_len, pad_id)


def split_rows(ids: torch.Tensor, target: torch.Tensor) -> Batch:
    """Rows (B, T + 1) -> inputs (B, T) and next-token labels (B, T), IGNORE off target."""
    nxt = ids[:, 1:]
    return ids[:, :-1], torch.where(target[:, 1:], nxt, torch.full_like(nxt, IGNORE))


class ExampleBatches:
    """Batches of encoded examples, epoch after epoch (see the module doc)."""

    def __init__(self, examples: Sequence[Example], *, seq_len: int, batch_size: int,
                 packing: Packing, pad_id: int, shuffle: bool, seed: int, rank: int,
                 world: int, source: str) -> None:
        if not examples:
            raise DataError(f"{source} has no rows")
        self.examples = list(examples)
        self._tensors = as_tensors(examples) if packing == "pack" else []
        self.seq_len, self.batch_size = seq_len, batch_size
        self.packing, self.pad_id, self.shuffle = packing, pad_id, shuffle
        self.seed, self.rank, self.world = seed, rank, world
        rows = (len(examples) if packing == "pad"
                else max(0, (sum(len(e.ids) for e in examples) - 1) // seq_len))
        self.per_epoch = rows // (world * batch_size)  # batches per rank per epoch
        if self.per_epoch == 0:
            raise DataError(f"{source} gives {rows} rows of train.seq_len {seq_len} tokens "
                            f"({packing}); one batch on every rank needs {world * batch_size} "
                            f"(world size {world} x micro batch {batch_size}); use more data, "
                            "a shorter seq_len or a smaller batch")
        self.drawn = 0
        self._epoch = -1
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self.drawn // self.per_epoch

    def _build(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shuffle:  # the same order on every rank: seeded by seed and epoch only
            gen = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            order = torch.randperm(len(self.examples), generator=gen).tolist()
        else:
            order = list(range(len(self.examples)))
        if self.packing == "pack":
            return pack_rows([self._tensors[i] for i in order], self.seq_len)
        return pad_rows([self.examples[i] for i in order], self.seq_len, self.pad_id)

    def skip(self, n: int) -> None:
        """Move past `n` batches (resuming at a saved position); rows are built lazily."""
        self.drawn += n

    def next(self) -> Batch:
        epoch, b = divmod(self.drawn, self.per_epoch)
        if epoch != self._epoch or self._rows is None:
            self._rows, self._epoch = self._build(epoch), epoch
        ids, target = self._rows
        first = b * self.batch_size
        pick = torch.tensor([self.rank + self.world * (first + i)
                             for i in range(self.batch_size)])
        self.drawn += 1
        return split_rows(ids[pick], target[pick])


def eval_batches(examples: Sequence[Example], *, seq_len: int, batch_size: int,
                 packing: Packing, pad_id: int, rank: int, world: int, limit: int,
                 source: str) -> list[Batch]:
    """This rank's evaluation batches, in order (`limit` > 0: at most that many)."""
    ids, target = rows_of(examples, seq_len, packing, pad_id)
    n = ids.shape[0] // (world * batch_size)
    if n == 0:
        raise DataError(f"the evaluation set ({source}) gives {ids.shape[0]} rows of "
                        f"train.seq_len {seq_len} tokens; one batch on every rank needs "
                        f"{world * batch_size}; use a larger eval split or a shorter seq_len")
    if limit:
        n = min(n, limit)
    out = []
    for b in range(n):
        pick = torch.tensor([rank + world * (b * batch_size + i) for i in range(batch_size)])
        out.append(split_rows(ids[pick], target[pick]))
    return out
