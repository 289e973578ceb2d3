"""The OS calls the swap store makes, in one object: the fault-injection seam.

`SwapStore(..., fileio=...)` takes any `FileIO`; tests pass a subclass whose
`pwrite`/`pread`/`fallocate` raise `OSError(errno.ENOSPC)` or `OSError(errno.EIO)`
on chosen calls, or return short counts, to check that every fault reaches the
right future as a `SwapError` and leaves earlier data readable. Each method is
the plain OS call; all of them release the GIL while the kernel works.
"""

from __future__ import annotations

import os

__all__ = ["FileIO"]


class FileIO:
    """Positional file I/O on raw file descriptors. Subclass to inject faults."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        """Open `path`, relative to the directory handle `dir_fd` when given."""
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        """Write `buf` at `offset`; return the number of bytes written."""
        return os.pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        """Read into `buf` from `offset`; return the number of bytes read (0 at EOF)."""
        return os.preadv(fd, [buf], offset)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        """Reserve disk blocks for [offset, offset + length) so writes never extend the file."""
        os.posix_fallocate(fd, offset, length)
