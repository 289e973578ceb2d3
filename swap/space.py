"""The data file's space: the extent allocator plus preallocation on disk."""

from __future__ import annotations

from tierzero.swap.allocator import ExtentAllocator
from tierzero.swap.errors import SwapError
from tierzero.swap.fileio import FileIO

__all__ = ["FileSpace"]


class FileSpace:
    """Hands out regions of the data file, growing it with fallocate when none fits.

    The file only ever grows through `fallocate`, before any write lands there,
    so writes never extend the file. Not thread-safe: the store calls it under
    its lock.
    """

    def __init__(self, fileio: FileIO, fd: int, path: str) -> None:
        self._fileio = fileio
        self._fd = fd
        self._path = path
        self._alloc = ExtentAllocator()

    @property
    def file_bytes(self) -> int:
        return self._alloc.end

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    def grow(self, size: int, *, key: str | None = None) -> None:
        """Preallocate `size` more bytes at the end of the file."""
        start = self._alloc.end
        try:
            self._fileio.fallocate(self._fd, start, size)
        except OSError as exc:
            raise SwapError(
                f"cannot grow the swap file from {start} to {start + size} bytes",
                path=self._path, key=key, errno=exc.errno,
            ) from exc
        self._alloc.grow(size)

    def allocate(self, size: int, *, key: str) -> int:
        """Offset of a free region of `size` bytes (reusing freed space first)."""
        offset = self._alloc.alloc(size)
        if offset is None:
            self.grow(size - self._alloc.tail_free(), key=key)
            offset = self._alloc.alloc(size)
        if offset is None:
            raise SwapError("internal: allocation failed after growth", path=self._path, key=key)
        return offset

    def free(self, offset: int, size: int) -> None:
        self._alloc.free(offset, size)
