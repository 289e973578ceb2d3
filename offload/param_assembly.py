"""The new param of a shard kept in several pieces, assembled whole before it is written.

Param is gathered whole, so the streamed CPU Adam ([Note: optimizer state in chunks] in
offload/adam_stream.py) writes it once its last piece is updated: it is assembled in a
second host ring with room for two shards, so one is written while the next is assembled
(three with a bf16 master: the next shard's param, which is its master, is read ahead,
[Note: shard inputs read ahead] in offload/shard_inputs.py).
"""

from __future__ import annotations

from collections import deque

import torch

from .errors import OffloadError
from .host_ring import HostRing
from .manager import TierManager
from .stream_parts import wait_all
from .stream_sizes import param_assembly_bytes
from .transfer import TierTransfer


class ParamAssembly:
    """Room for the whole new param of the shards in several pieces (`whole_bytes`: each
    one's, page-aligned) and its writes in flight, oldest first."""

    def __init__(self, manager: TierManager, whole_bytes: list[int], dtype: torch.dtype,
                 *, regions: int = 2) -> None:
        self._mgr = manager
        self._dtype = dtype  # the param's: the compute dtype, the bf16 master, or fp32 (the master)
        self._ring = HostRing(param_assembly_bytes(whole_bytes, regions), lambda nbytes:
                              manager.host_empty(nbytes, torch.uint8, purpose="adam_param"))
        self._writes: deque[tuple[int, TierTransfer]] = deque()  # (ring start, write)

    @property
    def capacity(self) -> int:
        return self._ring.capacity

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """A region for `numel` elements: (its start, its view), waiting for the oldest
        write when both regions are in use."""
        nbytes = numel * self._dtype.itemsize
        start = self._ring.take(nbytes)
        while start is None:
            if not self._writes:
                raise OffloadError("internal: the param ring is full with no write in flight")
            first, t = self._writes.popleft()
            t.wait_once()
            self._ring.give_back(first)
            start = self._ring.take(nbytes)
        return start, self._ring.view(start, numel, self._dtype)

    def write(self, key: str, start: int, whole: torch.Tensor, *, keep_host: bool) -> None:
        """Write the region at `start` (`whole`, its view) to manager key `key`; regions
        whose writes have landed are returned."""
        self._writes.append((start, self._mgr.write_from(key, whole, keep_host=keep_host)))
        while self._writes and self._writes[0][1].done():
            first, done = self._writes.popleft()
            done.wait_once()
            self._ring.give_back(first)

    def in_flight(self) -> list[TierTransfer]:
        return [t for _, t in self._writes]

    def flush(self) -> None:
        """Wait for every write (raising the first failure); the ring is empty after."""
        try:
            wait_all(self.in_flight())
        finally:
            self._writes.clear()
            self._ring.reset()

    def reset(self) -> None:
        """Forget the writes (each already waited for by the caller) and empty the ring."""
        self._writes.clear()
        self._ring.reset()
