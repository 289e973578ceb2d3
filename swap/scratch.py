"""The store's scratch files: where they live, who owns them, stale cleanup.

We never delete what we did not create and never `rmtree` a user path. Inside
the user's `directory` we make (or reuse) one subdirectory, SUBDIR. Each store
there owns two files named by its pid and a random token:

    swap-<pid>-<token>.lock          held with fcntl.flock(LOCK_EX) while the store lives
    swap-<pid>-<token>.scratch.swp   the data file (see [Note: swap file layout])

A lock file is created under a temporary name, locked, then renamed into
place, so a `.lock` file that can be locked has no living owner: the kernel
drops flock locks when the owning process dies, however it dies. On open,
every store removes such stale pairs, and data files whose lock file is gone,
but only these two name patterns, only inside SUBDIR.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from tierzero.swap.errors import SwapError

__all__ = ["SUBDIR", "ScratchFiles", "check_free_space", "clean_stale", "open_scratch"]

log = logging.getLogger(__name__)

SUBDIR = "tierzero-swap"
LOCK_SUFFIX = ".lock"
DATA_SUFFIX = ".scratch.swp"


@dataclass
class ScratchFiles:
    """Paths and lock of one store. `remove()` is idempotent and safe at exit."""

    subdir: Path
    lock_path: Path
    data_path: Path
    lock_fd: int
    owner_pid: int  # a forked child inherits this object but must not remove the files

    def remove(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        for path in (self.data_path, self.lock_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove swap scratch file %s: %s", path, exc)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        with contextlib.suppress(OSError):
            self.subdir.rmdir()  # only if empty: other stores may live here


def _check_directory(directory: Path) -> None:
    if not directory.exists():
        raise SwapError(
            "swap directory does not exist; create it or pass an existing directory",
            path=directory,
        )
    if not directory.is_dir():
        raise SwapError("swap directory is not a directory", path=directory)


def clean_stale(subdir: Path) -> list[Path]:
    """Remove scratch files of stores whose process is gone; return what was removed."""
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(subdir))
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.endswith(LOCK_SUFFIX):
            continue
        lock_path = subdir / name
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live store holds it
            data_path = subdir / (name.removesuffix(LOCK_SUFFIX) + DATA_SUFFIX)
            for path in (data_path, lock_path):
                try:
                    path.unlink()
                    removed.append(path)
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)
    for name in names:
        if name.endswith(DATA_SUFFIX):
            lock_path = subdir / (name.removesuffix(DATA_SUFFIX) + LOCK_SUFFIX)
            data_path = subdir / name
            if not lock_path.exists() and data_path.exists():
                try:
                    data_path.unlink()
                    removed.append(data_path)
                except FileNotFoundError:
                    pass
    if removed:
        log.warning(
            "removed %d stale swap scratch file(s) of dead processes in %s: %s",
            len(removed), subdir, ", ".join(p.name for p in removed),
        )
    return removed


def check_free_space(directory: Path, needed: int) -> None:
    """SwapError unless the file system holding `directory` has `needed` bytes free."""
    if needed <= 0:
        return
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SwapError(
            f"not enough free space for the planned swap: need {needed} bytes "
            f"({needed / 2**30:.2f} GiB), {free} bytes ({free / 2**30:.2f} GiB) free; "
            "free space, lower reserve_bytes or choose another directory",
            path=directory,
            errno=errno.ENOSPC,
        )


def open_scratch(directory: str | os.PathLike[str]) -> ScratchFiles:
    """Create SUBDIR in `directory`, clean stale files, and take this store's lock."""
    root = Path(directory)
    _check_directory(root)
    subdir = root / SUBDIR
    try:
        subdir.mkdir(mode=0o700, exist_ok=True)
        clean_stale(subdir)
        stem = f"swap-{os.getpid()}-{secrets.token_hex(4)}"
        tmp_path = subdir / f".{stem}.tmp"
        fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise SwapError(
            "cannot create swap files in this directory; pick a directory you can write",
            path=getattr(exc, "filename", None) or subdir,
            errno=exc.errno,
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock_path = subdir / (stem + LOCK_SUFFIX)
        os.rename(tmp_path, lock_path)
    except OSError as exc:
        os.close(fd)
        tmp_path.unlink(missing_ok=True)
        raise SwapError("cannot lock the swap lock file", path=tmp_path, errno=exc.errno) from exc
    return ScratchFiles(subdir, lock_path, subdir / (stem + DATA_SUFFIX), fd, os.getpid())
