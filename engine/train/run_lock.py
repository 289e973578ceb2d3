"""One run at a time per checkpoint directory and per metrics file.

[Note: run locks] Two `tierzero train` runs given the same `train.checkpoint_dir` would
save the same tags over each other (one run logged a checkpoint that the other's files
then made unloadable), and two given the same `train.metrics_path` interleave their
lines. So a run takes an exclusive lock on each before any work:

    <checkpoint_dir>/.lock            the lock file (kept; its contents name the owner)
    <dir>/.<metrics file name>.lock   for train.metrics_path

The lock is `flock(LOCK_EX | LOCK_NB)` on that file, held for the life of the run. The
kernel drops it when the process dies however it dies (kill -9 included), so a lock left
by a dead run is taken over by the next one without anyone cleaning up. The file holds
the owner (`pid`, `host`, start time) only to name it in the second run's error. Where the
file system has no flock (some network file systems: ENOLCK/EOPNOTSUPP), the owner record
decides: a live pid on this host holds the lock, anything else is stale and taken over.
The lock file is opened without following symlinks and with mode 0600.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from tierzero.engine.train.checkpoints import TrainError

log = logging.getLogger(__name__)

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


class LockError(TrainError):
    """The path is locked by another live run; the message names it and the owner."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_owner(fd: int) -> dict[str, object]:
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict[str, object]) -> str:
    if not owner:
        return "another process"
    return (f"pid {owner.get('pid')} on host {owner.get('host')!s}, started "
            f"{owner.get('started', '?')}")


class RunLock:
    """An exclusive, crash-safe lock on `lock_file` for one run; `what` names the resource
    in errors ("train.checkpoint_dir '/x'")."""

    def __init__(self, lock_file: str | os.PathLike[str], what: str) -> None:
        self.path = Path(lock_file)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise LockError(f"{self.what}: cannot open the lock file {self.path} ({exc.strerror}); "
                            "it must be a regular file in a directory you can write") from exc
        try:
            previous = _read_owner(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockError(
                    f"{self.what} is in use by another tierzero run ({_describe(previous)}; "
                    f"lock {self.path}); wait for that run to end, stop it, or give this "
                    "run another directory") from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise LockError(f"{self.what}: cannot lock {self.path} ({exc.strerror})"
                                    ) from exc
                self._check_owner_without_flock(previous)
            self._take_over(fd, previous)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _check_owner_without_flock(self, previous: dict[str, object]) -> None:
        pid = previous.get("pid")
        same_host = previous.get("host") == socket.gethostname()
        if isinstance(pid, int) and pid != os.getpid() and (not same_host or _pid_alive(pid)):
            raise LockError(
                f"{self.what} is in use by another tierzero run ({_describe(previous)}; lock "
                f"{self.path}; this file system has no flock, so the owner record decides); "
                "wait for that run to end, or remove the lock file if that run is gone")

    def _take_over(self, fd: int, previous: dict[str, object]) -> None:
        pid = previous.get("pid")
        if isinstance(pid, int) and pid != os.getpid():
            log.info("%s: taking over the lock left by %s (no longer running)", self.what,
                     _describe(previous))
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: unlinking it would let a third run
        lock a new file while a second still waits on the old one."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # no owner any more
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
