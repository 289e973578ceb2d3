"""Space allocator for one swap file: best-fit over free extents, coalesced on free."""

from __future__ import annotations

import bisect

from tierzero.swap.aligned import ALIGN

__all__ = ["ExtentAllocator", "round_up"]


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class ExtentAllocator:
    """Hands out ALIGN-aligned byte ranges of a file and takes them back.

    The file size (`end`) only grows, through `grow`, which the store calls
    after it has preallocated the new tail on disk; freed ranges are reused
    before the file grows. Not thread-safe: the store calls it under its lock.
    """

    def __init__(self) -> None:
        self.end = 0  # file bytes under management
        self.used = 0  # bytes handed out and not yet freed
        self._starts: list[int] = []  # sorted offsets of free extents
        self._lengths: dict[int, int] = {}  # offset -> length of each free extent

    @property
    def free_bytes(self) -> int:
        return self.end - self.used

    def alloc(self, size: int) -> int | None:
        """Offset of a free range of `size` bytes (best fit), or None if none fits."""
        size = round_up(size)
        best: int | None = None
        for start in self._starts:
            length = self._lengths[start]
            if length >= size and (best is None or length < self._lengths[best]):
                best = start
                if length == size:
                    break
        if best is None:
            return None
        length = self._lengths.pop(best)
        self._starts.remove(best)
        if length > size:
            self._insert(best + size, length - size)
        self.used += size
        return best

    def tail_free(self) -> int:
        """Free bytes that end at the end of the file (a growth only needs the rest)."""
        if self._starts:
            last = self._starts[-1]
            if last + self._lengths[last] == self.end:
                return self._lengths[last]
        return 0

    def grow(self, size: int) -> None:
        """Add `size` bytes (already preallocated on disk) at the end of the file."""
        size = round_up(size)
        old_end = self.end
        self.end += size
        self.free(old_end, size, _new=True)

    def free(self, offset: int, size: int, *, _new: bool = False) -> None:
        size = round_up(size)
        if offset % ALIGN or offset < 0 or offset + size > self.end:
            raise ValueError(f"free({offset}, {size}) outside the file [0, {self.end})")
        if not _new:
            self.used -= size
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + size:
            raise ValueError(f"double free of [{offset}, {offset + size})")
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] > offset:
                raise ValueError(f"double free of [{offset}, {offset + size})")
        # coalesce with the following and preceding extents
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._lengths.pop(self._starts.pop(i))
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:
                self._lengths[prev] += size
                return
        self._insert(offset, size)

    def _insert(self, offset: int, size: int) -> None:
        bisect.insort(self._starts, offset)
        self._lengths[offset] = size
