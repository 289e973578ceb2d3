"""Where the streamed CPU Adam assembles the whole param of a shard kept in pieces.

A shard whose master and moments stream in several pieces ([Note: optimizer state in
chunks] in offload/adam_stream.py) gets its new param written whole, once its last piece
is updated, since param is gathered whole. ``ParamRoom`` is the host room for that: a ring
of two such shards (one written while the next is assembled), taken in step order and
returned as each param write lands. With a bf16 master ([Note: bf16 master weights] in
offload/bf16_master.py) the param is also read whole into its room before the pieces are
updated: it is the master each piece updates in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .errors import OffloadError
from .host_ring import HostRing
from .transfer import TierTransfer


class ParamRoom:
    """``capacity`` bytes (stream_sizes.param_assembly_bytes), allocated once by ``alloc``."""

    def __init__(self, capacity: int, alloc: Callable[[int], torch.Tensor]) -> None:
        self._ring = HostRing(capacity, alloc)
        self._writes: deque[tuple[int, TierTransfer]] = deque()  # oldest first

    @property
    def capacity(self) -> int:
        return self._ring.capacity

    @property
    def transfers(self) -> list[TierTransfer]:
        """The param writes in flight (or landed and not yet given back)."""
        return [t for _, t in self._writes]

    def take(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """(start, 1D view) of room for ``numel`` elements of ``dtype``, waiting for the
        oldest param write when the room is full."""
        nbytes = numel * dtype.itemsize
        start = self._ring.take(nbytes)
        while start is None:
            if not self._writes:
                raise OffloadError("internal: the param ring is full with no write in flight")
            first, t = self._writes.popleft()
            t.wait()
            self._ring.give_back(first)
            start = self._ring.take(nbytes)
        return start, self._ring.view(start, numel, dtype)

    def written(self, start: int, transfer: TierTransfer) -> None:
        """The room at ``start`` is being written by ``transfer``; rooms whose writes have
        landed are given back (in order)."""
        self._writes.append((start, transfer))
        while self._writes and self._writes[0][1].done():
            first, done = self._writes.popleft()
            done.wait()
            self._ring.give_back(first)

    def drain(self) -> None:
        """Wait for every param write (raising the first failure)."""
        while self._writes:
            self._writes.popleft()[1].wait()

    def reset(self) -> None:
        """Forget every room (the writes were waited for by the caller)."""
        self._writes.clear()
        self._ring.reset()
