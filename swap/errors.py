"""The one exception type of the swap tier."""

from __future__ import annotations

import errno as errno_mod
import os

__all__ = ["SwapError"]


class SwapError(RuntimeError):
    """Any failure of swap I/O. Names the file and the key when it has them.

    Attributes: `path` (the swap file or directory, or None), `key` (or None),
    `errno` (the OS error number when an OS call failed, else None).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        key: str | None = None,
        errno: int | None = None,
    ) -> None:
        parts = [message]
        if key is not None:
            parts.append(f"key {key!r}")
        if path is not None:
            parts.append(f"file {os.fspath(path)!r}")
        if errno is not None:
            name = errno_mod.errorcode.get(errno, str(errno))
            parts.append(f"errno {errno} ({name}: {os.strerror(errno)})")
        super().__init__("; ".join(parts))
        self.path = None if path is None else os.fspath(path)
        self.key = key
        self.errno = errno
