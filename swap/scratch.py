"""The store's scratch files: where they live, who owns them, stale cleanup.

We never delete what we did not create and never `rmtree` a user path. Inside
the user's `directory` we make (or reuse) one subdirectory per user,
`tierzero-swap-<uid>` (see `subdir_name`), so users sharing `/var/tmp` never
meet. Each store there owns two files named by its pid and a random token:

    swap-<pid>-<token>.lock          held with fcntl.flock(LOCK_EX) while the store lives
    swap-<pid>-<token>.scratch.swp   the data file (see [Note: swap file layout]),
                                     also held with flock(LOCK_EX) while the store lives

[Note: swap directory safety]
The subdirectory is checked with lstat (a real directory, not a symlink, owned
by the caller, no group/other permission bits) and opened once with
O_DIRECTORY|O_NOFOLLOW; every file is then created, locked and removed
relative to that handle, with O_NOFOLLOW, so a symlink planted in a shared
directory never redirects our writes or our deletions.

A lock file is created under a temporary name, locked, then renamed into
place, so a `.lock` file that can be locked has no living owner: the kernel
drops flock locks when the owning process dies, however it dies. The data
file is locked too, so a live store whose lock file was removed (tmp cleaners
do this) is still recognised as live. On open, every store removes the files
of a stem when every file of that stem is a regular file owned by the caller
and none of them is locked; only these two name patterns, only inside the
subdirectory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from tierzero.swap.errors import SwapError

__all__ = [
    "SUBDIR", "ScratchFiles", "check_free_space", "clean_stale", "open_scratch", "subdir_name",
]

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
DATA_SUFFIX = ".scratch.swp"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


def _caller_uid() -> int:
    """The uid that must own the subdirectory and every file we lock or remove."""
    return os.geteuid()


def subdir_name() -> str:
    """The calling user's subdirectory name: one per effective uid."""
    return f"tierzero-swap-{_caller_uid()}"


SUBDIR = subdir_name()  # this process's name, for tests and messages


@dataclass
class ScratchFiles:
    """Paths, directory handle and lock of one store. `remove()` is idempotent and safe at exit."""

    subdir: Path
    dir_fd: int  # O_DIRECTORY|O_NOFOLLOW handle of `subdir`; every file op goes through it
    lock_path: Path
    data_path: Path
    lock_fd: int
    owner_pid: int  # a forked child inherits this object but must not remove the files

    def remove(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        if self.dir_fd >= 0:
            for path in (self.data_path, self.lock_path):
                try:
                    os.unlink(path.name, dir_fd=self.dir_fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("could not remove swap scratch file %s: %s", path, exc)
            os.close(self.dir_fd)
            self.dir_fd = -1
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        with contextlib.suppress(OSError):
            # rmdir removes only an empty directory and never follows a symlink: other
            # stores of this user may live here.
            self.subdir.rmdir()


def _check_directory(directory: Path) -> None:
    if not directory.exists():
        raise SwapError(
            "swap directory does not exist; create it or pass an existing directory",
            path=directory,
        )
    if not directory.is_dir():
        raise SwapError("swap directory is not a directory", path=directory)


def _check_subdir(st: os.stat_result, subdir: Path) -> None:
    """SwapError unless `st` (an lstat) is a directory of the caller's alone."""
    uid = _caller_uid()
    fix = "remove it, or set offload.path to a directory you own"
    if stat.S_ISLNK(st.st_mode):
        raise SwapError(
            f"swap subdirectory is a symbolic link, which tierzero never follows; {fix}",
            path=subdir,
        )
    if not stat.S_ISDIR(st.st_mode):
        raise SwapError(f"swap subdirectory is not a directory; {fix}", path=subdir)
    if st.st_uid != uid:
        raise SwapError(
            f"swap subdirectory belongs to uid {st.st_uid}, not to you (uid {uid}); {fix}",
            path=subdir,
        )
    if st.st_mode & 0o077:
        raise SwapError(
            f"swap subdirectory has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 "
            f"(only you may read it): run `chmod 700 {subdir}` or {fix}",
            path=subdir,
        )


def _open_subdir(root: Path, name: str) -> int:
    """Make (or reuse) `root/name` and return an O_DIRECTORY|O_NOFOLLOW handle on it."""
    subdir = root / name
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError as exc:
        raise SwapError("cannot open the swap directory", path=root, errno=exc.errno) from exc
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=root_fd)
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        _check_subdir(st, subdir)
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError as exc:
        raise SwapError(
            "cannot create swap files in this directory; pick a directory you can write",
            path=getattr(exc, "filename", None) or subdir,
            errno=exc.errno,
        ) from exc
    finally:
        os.close(root_fd)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)  # replaced between the check and the open
        raise SwapError("swap subdirectory changed while it was opened; retry", path=subdir)
    return fd


def _lock_state(dir_fd: int, name: str) -> str:
    """'absent', 'live' (locked), 'free', or 'foreign' (not a regular file of the caller)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "foreign"  # ELOOP: a symlink; EACCES: not ours
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _caller_uid():
            return "foreign"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "live"
        return "free"
    finally:
        os.close(fd)


def clean_stale(subdir: Path, dir_fd: int | None = None) -> list[Path]:
    """Remove scratch files of stores whose process is gone; return what was removed.

    A stem's files go only when each is a regular file the caller owns and none is
    locked (see [Note: swap directory safety]).
    """
    own_fd = dir_fd is None
    if dir_fd is None:
        try:
            dir_fd = os.open(subdir, _DIR_FLAGS)
        except FileNotFoundError:
            return []
    removed: list[Path] = []
    try:
        stems = sorted({
            n.removesuffix(sfx) for n in os.listdir(dir_fd)
            for sfx in (LOCK_SUFFIX, DATA_SUFFIX) if n.endswith(sfx) and n.startswith("swap-")
        })
        for stem in stems:
            names = (stem + DATA_SUFFIX, stem + LOCK_SUFFIX)
            states = [_lock_state(dir_fd, n) for n in names]
            if "live" in states or "foreign" in states:
                continue
            for name, state in zip(names, states, strict=True):
                if state == "absent":
                    continue
                try:
                    os.unlink(name, dir_fd=dir_fd)
                    removed.append(subdir / name)
                except FileNotFoundError:
                    pass
    finally:
        if own_fd:
            os.close(dir_fd)
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
    """Make the caller's subdirectory in `directory`, clean stale files, take this store's lock."""
    root = Path(directory)
    _check_directory(root)
    name = subdir_name()
    subdir = root / name
    dir_fd = _open_subdir(root, name)
    stem = f"swap-{os.getpid()}-{secrets.token_hex(4)}"
    tmp_name = f".{stem}.tmp"
    try:
        clean_stale(subdir, dir_fd)
        fd = os.open(
            tmp_name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        os.close(dir_fd)
        raise SwapError(
            "cannot create swap files in this directory; pick a directory you can write",
            path=subdir / tmp_name if exc.filename else subdir,
            errno=exc.errno,
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp_name, stem + LOCK_SUFFIX, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp_name, dir_fd=dir_fd)
        os.close(dir_fd)
        raise SwapError(
            "cannot lock the swap lock file", path=subdir / tmp_name, errno=exc.errno
        ) from exc
    return ScratchFiles(
        subdir, dir_fd, subdir / (stem + LOCK_SUFFIX), subdir / (stem + DATA_SUFFIX), fd,
        os.getpid(),
    )
