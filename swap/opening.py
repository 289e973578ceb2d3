"""Opening the data file: O_DIRECT where the file system takes it, buffered otherwise."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path

import torch

from tierzero.swap.aligned import ALIGN, aligned_empty
from tierzero.swap.errors import SwapError
from tierzero.swap.fileio import FileIO

__all__ = ["open_data_file"]

log = logging.getLogger(__name__)

_BASE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NO_DIRECT = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _probe(fileio: FileIO, fd: int) -> None:
    """Some file systems accept O_DIRECT at open and refuse it at the first I/O."""
    page = aligned_empty(ALIGN, torch.uint8)
    page.zero_()
    view = page.numpy().data
    fileio.pwrite(fd, view, 0)
    fileio.pread(fd, view, 0)
    os.ftruncate(fd, 0)


def open_data_file(
    fileio: FileIO, dir_fd: int, path: Path, direct: bool | None
) -> tuple[int, bool]:
    """Create the data file `path` (opened as `path.name` relative to the handle `dir_fd`
    of its directory) and lock it; return (fd, whether it uses O_DIRECT).

    The lock marks the store live even if its lock file is removed (see
    [Note: swap directory safety]).
    """
    fd, used_direct = _create(fileio, dir_fd, path, direct)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        fileio.close(fd)
        raise SwapError("cannot lock the swap file", path=path, errno=exc.errno) from exc
    return fd, used_direct


def _create(fileio: FileIO, dir_fd: int, path: Path, direct: bool | None) -> tuple[int, bool]:
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct is not False and o_direct:
        fd = -1
        try:
            fd = fileio.open(path.name, _BASE_FLAGS | o_direct, dir_fd=dir_fd)
            _probe(fileio, fd)
            return fd, True
        except OSError as exc:
            if fd >= 0:
                fileio.close(fd)
            if fd >= 0 or exc.errno in _NO_DIRECT:
                # Some file systems (ramfs; tmpfs before Linux 6.6) create the file and
                # then refuse O_DIRECT: the name is this store's own, so remove it
                # before the buffered O_EXCL retry.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path.name, dir_fd=dir_fd)
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
        return fileio.open(path.name, _BASE_FLAGS, dir_fd=dir_fd), False
    except OSError as exc:
        raise SwapError("cannot create the swap file", path=path, errno=exc.errno) from exc
