"""Opening the data file: O_DIRECT where the file system takes it, buffered otherwise."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import torch

from tierzero.swap.aligned import ALIGN, aligned_empty
from tierzero.swap.errors import SwapError
from tierzero.swap.fileio import FileIO

__all__ = ["open_data_file"]

log = logging.getLogger(__name__)

_BASE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_NO_DIRECT = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _probe(fileio: FileIO, fd: int) -> None:
    """Some file systems accept O_DIRECT at open and refuse it at the first I/O."""
    page = aligned_empty(ALIGN, torch.uint8)
    page.zero_()
    view = page.numpy().data
    fileio.pwrite(fd, view, 0)
    fileio.pread(fd, view, 0)
    os.ftruncate(fd, 0)


def open_data_file(fileio: FileIO, path: Path, direct: bool | None) -> tuple[int, bool]:
    """Create the data file; return (fd, whether it uses O_DIRECT)."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct is not False and o_direct:
        fd = -1
        try:
            fd = fileio.open(str(path), _BASE_FLAGS | o_direct)
            _probe(fileio, fd)
            return fd, True
        except OSError as exc:
            if fd >= 0:
                fileio.close(fd)
                path.unlink(missing_ok=True)
            if exc.errno not in _NO_DIRECT:
                raise SwapError("cannot create the swap file", path=path,
                                errno=exc.errno) from exc
            if direct:
                raise SwapError(
                    "the file system does not support O_DIRECT and direct=True was asked; "
                    "use a local ext4/xfs NVMe directory or pass direct=None",
                    path=path, errno=exc.errno,
                ) from exc
            log.warning(
                "swap file %s: the file system refuses O_DIRECT (errno %s); using buffered "
                "I/O, which goes through the page cache (slower, uses host memory)",
                path, exc.errno,
            )
    elif direct is None:
        log.warning("O_DIRECT is not available on this platform; swap uses buffered I/O")
    try:
        return fileio.open(str(path), _BASE_FLAGS), False
    except OSError as exc:
        raise SwapError("cannot create the swap file", path=path, errno=exc.errno) from exc
