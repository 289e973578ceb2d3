"""Background checkpoint saves: write and publish from a snapshot while training goes on.

`save_checkpoint(..., background=True)` captures, on the calling thread, a CPU
copy of everything the rank writes (so the next optimizer step cannot change
what is saved: a consistent snapshot, at the cost of one copy of this rank's
checkpoint in host memory until the write finishes), then hands writing,
fsync and publishing to this module's single worker thread. The ranks' file
digests are exchanged over a process group of their own, so the worker's
collectives never interleave with training's. Every later save, load and
`close()` waits for the pending save first; `PendingSave.wait()` returns the
path or raises the save's error. Shards held by the tier manager (offload
cpu/nvme) are not snapshotted into host memory: those saves run on the
caller's thread ([Note: background save of offloaded state]).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from tierzero.engine.checkpoint.save import _SaveJob

log = logging.getLogger(__name__)


@dataclass
class PendingSave:
    """A checkpoint being written: its snapshot (held by the job) and its completion."""

    job: _SaveJob
    future: Future[Path]
    waited: bool = False  # the caller saw the outcome: the saver does not raise it again

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> Path:
        """The checkpoint path once `latest` names it; the save's error if it failed."""
        try:
            return self.future.result()
        finally:
            self.waited = True


class BackgroundSaver:
    """One engine's background writer: a worker thread and a process group, made on first use."""

    def __init__(self, world_size: int) -> None:
        self._world = world_size
        self._pool: ThreadPoolExecutor | None = None
        self._group: dist.ProcessGroup | None = None
        self.pending: PendingSave | None = None
        self.warned_sync = False  # the "written synchronously" line was logged once

    def completed(self, job: _SaveJob, path: Path) -> PendingSave:
        """A save that ran on the caller's thread ([Note: background save of offloaded
        state] in engine/checkpoint/save.py), as a PendingSave that is already done."""
        future: Future[Path] = Future()
        future.set_result(path)
        return PendingSave(job, future)

    def submit(self, job: _SaveJob) -> PendingSave:
        self.wait()
        if self._pool is None:
            # One thread: checkpoint writes run behind training, one save at a time in order.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierzero-ckpt")
            if self._world > 1:  # a collective: every rank is inside save_checkpoint here
                self._group = dist.new_group(backend="gloo")
        self.pending = PendingSave(job, self._pool.submit(job.run, self._group))
        return self.pending

    def wait(self) -> None:
        """Finish the pending save; raise its error unless the caller already saw it."""
        pending, self.pending = self.pending, None
        if pending is not None and not pending.waited:
            pending.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
