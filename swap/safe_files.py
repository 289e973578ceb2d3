"""Creating output files and directories without following symlinks, private by default.

[Note: output files]
Every file tierzero writes for the user (checkpoint files and `latest`, the
metrics file, bench.json, consolidated weights, plots, traces, plan configs)
is created with O_CREAT|O_EXCL|O_NOFOLLOW after removing whatever entry had
its name (unlink removes a symlink or hard link itself, never its target), or
written to such a new temporary file and renamed over the name with
os.replace (rename replaces a symlink, never writes through it). A planted
link therefore never redirects a write. Files get mode 0600 and directories
0700 unless the caller widens them (`outputs.permissions`); the mode is set
with fchmod/chmod, so the umask cannot widen or narrow it silently. An output
directory that belongs to another user gets a warning: its owner can read
and replace whatever is written there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PERMISSIONS", "OutputModes", "create_new", "make_output_dir", "output_modes",
    "warn_if_foreign", "write_atomic",
]

log = logging.getLogger(__name__)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class OutputModes:
    """Permission bits of output files and directories."""

    file: int = 0o600
    dir: int = 0o700


# outputs.permissions -> modes: private (only you), group (+ read for the group), world.
PERMISSIONS: dict[str, OutputModes] = {
    "private": OutputModes(0o600, 0o700),
    "group": OutputModes(0o640, 0o750),
    "world": OutputModes(0o644, 0o755),
}


def output_modes(permissions: str) -> OutputModes:
    try:
        return PERMISSIONS[permissions]
    except KeyError:
        raise ValueError(f"output permissions {permissions!r} is unknown; allowed: "
                         f"{', '.join(PERMISSIONS)}") from None


def warn_if_foreign(directory: str | os.PathLike[str]) -> None:
    """Log a warning when `directory` belongs to another user (root-owned sticky dirs such
    as /tmp are fine: nobody else can replace our entries there)."""
    try:
        st = os.stat(directory)
    except OSError:
        return
    uid = os.geteuid()
    if st.st_uid == uid or (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
        return
    log.warning(
        "output directory %s belongs to uid %d, not to you (uid %d): its owner can read and "
        "replace what tierzero writes there; pick a directory you own",
        os.fspath(directory), st.st_uid, uid,
    )


def make_output_dir(path: str | os.PathLike[str], modes: OutputModes | None = None) -> Path:
    """Create `path` (and missing parents) with `modes.dir` for the directories we create;
    an existing directory is kept as it is. Warns when it belongs to another user."""
    modes = modes or OutputModes()
    p = Path(path)
    missing: list[Path] = []
    probe = p
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    p.mkdir(parents=True, exist_ok=True)
    for d in missing:
        with contextlib.suppress(OSError):
            os.chmod(d, modes.dir, follow_symlinks=False)
    if not p.is_dir():
        raise NotADirectoryError(f"output path {p} exists and is not a directory")
    warn_if_foreign(p)
    return p


def create_new(path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """Open `path` for writing as a new file of ours (see [Note: output files]); return the fd.

    An existing file, symlink or hard link at `path` is removed first, as an overwrite
    would; a link planted again in between makes the open fail (EEXIST), never follow.
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600, *,
                 durable: bool = True) -> None:
    """Replace `path` with a file holding `data`, all or nothing, never through a link.

    Written to a new temporary file beside it, fsynced when `durable`, then renamed.
    """
    final = Path(path)
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        with contextlib.suppress(OSError):
            dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
