"""Shared helpers for the swap tests: fault-injecting FileIO subclasses."""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

from tierzero.swap import FileIO


class FaultyIO(FileIO):
    """Raises OSError(err) on chosen pwrite/pread/fallocate calls (counted from 1).

    `arm(op, err, after=n)` makes the (n+1)-th call of `op` from now on fail, and
    every later call too when `sticky`. Calls are counted under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plan: dict[str, tuple[int, int, bool]] = {}  # op -> (calls left, errno, sticky)
        self.calls = {"pwrite": 0, "pread": 0, "fallocate": 0}

    def arm(self, op: str, err: int, *, after: int = 0, sticky: bool = False) -> None:
        with self._lock:
            self._plan[op] = (after, err, sticky)

    def disarm(self) -> None:
        with self._lock:
            self._plan.clear()

    def _maybe_fail(self, op: str) -> None:
        with self._lock:
            self.calls[op] += 1
            plan = self._plan.get(op)
            if plan is None:
                return
            left, err, sticky = plan
            if left > 0:
                self._plan[op] = (left - 1, err, sticky)
                return
            if not sticky:
                del self._plan[op]
        raise OSError(err, os.strerror(err))

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self._maybe_fail("pwrite")
        return super().pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        self._maybe_fail("pread")
        return super().pread(fd, buf, offset)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        self._maybe_fail("fallocate")
        super().fallocate(fd, offset, length)


class SlowIO(FileIO):
    """Sleeps before each pwrite/pread (to widen races and to measure interleaving)."""

    def __init__(self, write_delay: float = 0.0, read_delay: float = 0.0) -> None:
        self.write_delay = write_delay
        self.read_delay = read_delay

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        time.sleep(self.write_delay)
        return super().pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        time.sleep(self.read_delay)
        return super().pread(fd, buf, offset)


class NoDirectIO(FileIO):
    """A file system that refuses O_DIRECT at open (as tmpfs on older kernels, ZFS, sshfs)."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return super().open(path, flags, mode, dir_fd=dir_fd)


class CreateThenRefuseDirectIO(FileIO):
    """ramfs, or tmpfs before Linux 6.6: open(O_CREAT|O_DIRECT) creates the file, then
    fails with EINVAL, leaving the file behind."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        o_direct = getattr(os, "O_DIRECT", 0)
        if flags & o_direct:
            os.close(super().open(path, flags & ~o_direct, mode, dir_fd=dir_fd))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return super().open(path, flags, mode, dir_fd=dir_fd)


def faulty_swaps(monkeypatch: Any) -> list[FaultyIO]:
    """Every SwapStore built from now on writes through a FaultyIO (the list, in order)."""
    from tierzero.swap import store as store_mod

    ios: list[FaultyIO] = []
    real_init = store_mod.SwapStore.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        ios.append(FaultyIO())
        kwargs["fileio"] = ios[-1]
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(store_mod.SwapStore, "__init__", init)
    return ios
