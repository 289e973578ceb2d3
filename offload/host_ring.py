"""A fixed host arena handed out first-in first-out: the streamed Adam's buffers.

The optimizer stream reads shards in a fixed order and frees their buffers in
the same order (a shard's buffers are free once its write has landed), so a
ring is all it needs: regions are carved at the head and returned at the
tail. Shards of different sizes then share one arena of a chosen size instead
of each buffer set being as large as the largest shard.

    | free | region 3 | region 4 | region 5 (head) | free |     one contiguous arena
           ^ tail (oldest, freed first)

Every region starts page-aligned (O_DIRECT reads and writes go straight in).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .errors import OffloadError

PAGE = 4096


def page_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class HostRing:
    """``capacity`` bytes allocated once (by ``alloc``, e.g. the manager's host_empty)."""

    def __init__(self, capacity: int, alloc: Callable[[int], torch.Tensor]) -> None:
        self.capacity = page_up(capacity)
        self.arena = alloc(self.capacity)  # 1D uint8, page-aligned
        self._live: deque[tuple[int, int]] = deque()  # (start, end) oldest first

    def take(self, nbytes: int) -> int | None:
        """Start of a new region of ``nbytes`` at the head, or None if it does not fit
        until older regions are returned."""
        size = page_up(nbytes)
        if size > self.capacity:
            raise OffloadError(f"a {nbytes}-byte region does not fit the {self.capacity}-byte "
                               "host ring; give the optimizer stream more buffer bytes")
        if not self._live:
            start = 0
        else:
            tail, head = self._live[0][0], self._live[-1][1]
            if head > tail:  # not wrapped: room after the head, else at the arena's start
                start = head if head + size <= self.capacity else 0
                if start == 0 and size > tail:
                    return None
            elif head + size <= tail:  # wrapped: room between head and tail only
                start = head
            else:
                return None
        self._live.append((start, start + size))
        return start

    def give_back(self, start: int) -> None:
        """Return the oldest region (regions come back in the order they were taken)."""
        if not self._live or self._live[0][0] != start:
            raise OffloadError(f"internal: host ring region at {start} returned out of order "
                               f"(oldest is {self._live[0] if self._live else None})")
        self._live.popleft()

    def reset(self) -> None:
        self._live.clear()

    @property
    def used(self) -> int:
        return sum(end - start for start, end in self._live)

    def view(self, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        return self.arena[start:start + numel * itemsize].view(dtype)
