"""A file system filling up mid-run, told in one line (not a chained traceback).

The swap store raises SwapError (errno ENOSPC) when its file cannot grow; a checkpoint save
raises CheckpointError whose text carries the OS error of the rank that failed. Either way
nothing committed is lost: a failed swap write leaves the previous contents readable (the
store is copy-on-write), a failed save leaves `latest` naming the previous complete
checkpoint and removes its `.partial` directory, and the engine's close removes the swap
files. `describe` finds the ENOSPC in an exception's chain and says so.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

_TEXT = ("No space left on device", "ENOSPC")


def _chain(exc: BaseException) -> list[BaseException]:
    seen: set[int] = set()
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


_QUOTED_FILE = re.compile(r"file '([^']+)'")


def _enospc(exc: BaseException) -> tuple[BaseException, str | None] | None:
    """(the ENOSPC in `exc`'s cause/context chain, the file it names), or None. An OS error
    number wins over text; text is what crosses ranks (CheckpointError carries each
    failing rank's message as a string), and names its file as `file '<path>'`."""
    chain = _chain(exc)
    for e in chain:
        if getattr(e, "errno", None) == errno.ENOSPC:
            return e, getattr(e, "path", None) or getattr(e, "filename", None)
    for e in chain:
        if any(t in str(e) for t in _TEXT):
            m = _QUOTED_FILE.search(str(e))
            return e, m.group(1) if m else None
    return None


def mount_point(path: str | os.PathLike[str]) -> str:
    p = Path(os.path.abspath(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def describe(exc: BaseException, *, checkpoint_dir: str | None, last_good: str) -> str | None:
    """One line for a full file system behind `exc`, or None when `exc` is something else.

    `checkpoint_dir`: where the run saves (named when the error does not carry a path);
    `last_good`: the sentence naming the newest complete checkpoint."""
    found = _enospc(exc)
    if found is None:
        return None
    path = found[1]
    what = ("the swap file could not be written" if path and str(path).endswith(".swp")
            else "a checkpoint could not be written")
    if path is None and checkpoint_dir is not None:
        path = checkpoint_dir
    where = "a file system"
    if path is not None:
        existing = Path(os.path.abspath(path))
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        where = f"the file system at {mount_point(existing)} (holding {path}; {free} bytes free)"
    return (f"{where} is full: {what} (ENOSPC). Nothing was lost: {last_good}, and the swap "
            "files were removed; free space there, or point offload.path / "
            "train.checkpoint_dir at a larger file system, then resume")
