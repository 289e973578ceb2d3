"""Background checkpoint saves: write and publish from a snapshot while training goes on.

[Note: background save] `save_checkpoint(..., background=True)` records, on the calling
thread, what the rank writes: small tensors (optimizer scalars' tensors, RNG states,
buffers) and shards resident in device memory are copied into host memory; shards held
by the tier manager (offload cpu / nvme) are *not* copied: the store's snapshot keeps them
([Note: snapshot parts] in engine/shards/snapshot.py: NVMe regions kept from release, host
state copied only just before the training changes it, within
outputs.background_save_copy_bytes). Then this module's single worker thread writes the
rank file part by part, fsyncs and publishes, and the call returns a PendingSave. A step
whose optimizer update is still deferred into the next forward is not waited for: its
groups are read as their update lands ([Note: saving a deferred step] in
engine/checkpoint/deferred.py).

The worker stays behind the training: its reads of kept NVMe regions are served after
every other swap request (swap/queues.py), it is busy at most
outputs.background_save_share of the wall time (`Pacer`: it pauses between parts), and
its file is written down and dropped from the page cache as it goes (no dirty pages
piling up in host memory, no large flush at the end). What it did is counted in
`SaveStats` (bytes read from the snapshot, bytes written, busy and paused seconds).

The ranks' file digests are exchanged over a process group of the saver's own, so the
worker's collectives never interleave with training's. Every later save, load and
`close()` waits for the pending save first; `PendingSave.wait()` returns the path or
raises the save's error. `abandon()` (a second SIGINT while closing) stops the writer at
the next part: the save fails on every rank (the error goes through the same exchange),
its `.partial` directory is removed and `latest` still names the previous checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from tierzero.engine.checkpoint.io import SafetensorsWriter
from tierzero.engine.checkpoint.layout import CheckpointError

if TYPE_CHECKING:
    from pathlib import Path

    from tierzero.engine.checkpoint.save import SnapRef, _SaveJob
    from tierzero.engine.shards.snapshot import StoreSnapshot

log = logging.getLogger(__name__)

SYNC_EVERY = 64 << 20  # bytes between a background writer's fdatasync + page-cache drops


@dataclass
class SaveStats:
    """What one background save did; the worker fills it in as it goes."""

    held_s: float = 0.0  # the caller's thread inside save_checkpoint (an earlier save included)
    # of which: waiting for optimizer work to end (the step's deferred update only when
    # the save fell back to a synchronous one: [Note: saving a deferred step] in
    # engine/checkpoint/deferred.py)
    settle_s: float = 0.0
    started: float = 0.0  # time.perf_counter() when the call returned
    finished: float | None = None  # time.perf_counter() when `latest` named it (or it failed)
    read_bytes: int = 0  # snapshot parts taken from the store (kept regions, copies)
    written_bytes: int = 0  # rank file bytes
    busy_s: float = 0.0  # the worker taking parts and writing them
    paused_s: float = 0.0  # the worker pausing for the training (Pacer)
    snapshot: dict[str, float] = field(default_factory=dict)  # StoreSnapshot.stats() at the end

    def as_json(self) -> dict[str, object]:
        return {"held_s": self.held_s, "settle_s": self.settle_s,
                "read_bytes": self.read_bytes,
                "written_bytes": self.written_bytes, "busy_s": self.busy_s,
                "paused_s": self.paused_s,
                "seconds": (self.finished - self.started) if self.finished else None,
                **{f"snapshot_{k}": v for k, v in self.snapshot.items()}}


class Pacer:
    """Keeps a worker busy at most `share` of the wall time: after a part that took
    `busy` seconds it pauses busy * (1/share - 1), on `cancel` (so abandoning is at once).
    A bound on what the save takes from the training's CPU and disk, not a poll."""

    def __init__(self, share: float, cancel: threading.Event, stats: SaveStats) -> None:
        self.share = share
        self.cancel = cancel
        self.stats = stats

    def after(self, busy: float) -> None:
        self.stats.busy_s += busy
        if self.cancel.is_set():
            raise CheckpointError("the background save was abandoned (the run is stopping)")
        if self.share < 1:
            pause = busy * (1 / self.share - 1)
            self.cancel.wait(pause)
            self.stats.paused_s += pause


def write_snapshot_entry(w: SafetensorsWriter, name: str, ref: SnapRef,
                         snapshot: StoreSnapshot, pacer: Pacer) -> None:
    """Write entry `name` from the store's snapshot, one part at a time (each released
    once written: the kept region freed, the copy dropped). Waiting for a part's deferred
    optimizer update to land is not the writer's work: the Pacer does not count it."""
    for part in ref.parts:
        start = time.perf_counter()
        awaited = snapshot.await_s
        buf = snapshot.take(part)
        try:
            w.write_part(name, buf)
            n = buf.numel() * buf.element_size()
        finally:
            snapshot.free(buf)
        pacer.stats.read_bytes += n
        pacer.after(time.perf_counter() - start - (snapshot.await_s - awaited))


@dataclass
class PendingSave:
    """A checkpoint being written: its snapshot (held by the job) and its completion.
    `fallback`: why it was written before the call returned (None: in the background)."""

    job: _SaveJob
    future: Future[Path]
    stats: SaveStats
    fallback: str | None = None
    waited: bool = False  # the caller saw the outcome: the saver does not raise it again

    @property
    def background(self) -> bool:
        return self.fallback is None

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

    def completed(self, job: _SaveJob, path: Path, why: str) -> PendingSave:
        """A save that ran on the caller's thread (`why`), as a PendingSave already done."""
        future: Future[Path] = Future()
        future.set_result(path)
        stats = job.stats
        stats.finished = time.perf_counter()
        return PendingSave(job, future, stats, fallback=why)

    def submit(self, job: _SaveJob) -> PendingSave:
        self.wait()
        if self._pool is None:
            # One thread: checkpoint writes run behind training, one save at a time in order.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierzero-ckpt")
            if self._world > 1:  # a collective: every rank is inside save_checkpoint here
                self._group = dist.new_group(backend="gloo")
        self.pending = PendingSave(job, self._pool.submit(job.run, self._group), job.stats)
        return self.pending

    def wait(self) -> None:
        """Finish the pending save; raise its error unless the caller already saw it, or
        abandoned it (then the failure is what was asked for)."""
        pending, self.pending = self.pending, None
        if pending is not None and pending.job.cancel.is_set():
            pending.future.exception()  # waits for its writer to clean up
        elif pending is not None and not pending.waited:
            pending.wait()

    def abandon(self) -> None:
        """Stop the pending save at its next part and wait for it to clean up; its error (the
        abandonment) is logged, not raised."""
        pending, self.pending = self.pending, None
        if pending is None or pending.done():
            return
        pending.job.cancel.set()
        try:
            pending.future.exception()  # waits; the worker removes the partial directory
        finally:
            log.warning("background save %s abandoned: its .partial directory is removed, "
                        "latest names the previous checkpoint", pending.job.tag)

    def close(self) -> None:
        """Finish the pending save (an interrupt while waiting abandons it), stop the worker."""
        pending = self.pending
        try:
            try:
                self.wait()
            except KeyboardInterrupt:
                self.pending = pending
                self.abandon()
                raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
