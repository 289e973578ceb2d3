"""Snapshots: the data of some shards at one moment, readable while training changes them.

[Note: shard snapshots] A background checkpoint must write the state as it was when
it was asked for, while the next steps rewrite that state, and without a second copy
of the state in host memory. `TierManager.snapshot(keys)` records, per shard:

- homed on NVMe: its swap region, kept from release ([Note: kept regions] in
  swap/kept.py). Dirty caches are written down first, so the region holds the newest
  data; later writes of the key go to new regions (copy-on-write), so the kept one is
  the snapshot's until `snapshot_take` has read it (behind the training's own I/O);
- homed in host or device memory: nothing is copied now. The home copy *is* the
  snapshot's data until the shard is about to change (a writable fetch of the home
  copy, or a write-back into it): then the old bytes are copied into a host buffer
  first (copy-on-write, `_preserve`). Those buffers are bounded by the snapshot's
  `copy_limit`; a writer that would pass it waits until the snapshot has been read
  past its shard (or has room again), so host memory stays bounded whatever the
  state's size. A shard being read out by the snapshot's reader is waited for too.

`snapshot_take(snap, key, out)` copies one shard's snapshot data into `out` and releases
it (once per key); `snapshot_close(snap)` releases whatever was not taken (a failed or
abandoned save). One snapshot at a time.

A key may also be recorded as *awaiting* (`snapshot(awaiting=...)`): its snapshot data is
not the data now but what an update in progress leaves (a background save of a step whose
optimizer update is still deferred: [Note: saving a deferred step] in
engine/checkpoint/deferred.py). Until `snapshot_landed` says that update ended, writes to
the key are the update's own and are not preserved, and `snapshot_take` of it waits. From
then on a host- or device-homed key is like any other. An NVMe-homed one is reported
when the update has *issued* its write (the worker that ran it must not wait for the
disk), so it is kept lazily: its region is kept (`keep`) once that write has landed, by
whichever comes first, the reader's take (which waits for the write) or the next write
of the key (which waits for it anyway, one write of a key in flight at a time, and
keeps the landed region before it issues its own). So the snapshot never reads a
region mid-write, nor one from before the update; a write of the update that failed
makes the take fail. The swap room such a key's next write needs is reserved at the
call, with the kept regions'. An update that failed makes the take fail with its
reason.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from tierzero.swap import KeptRegion, SwapError
from tierzero.swap.request import region_bytes

from .core import ResidencyCore
from .errors import OffloadError
from .residency import TRANSIENT, ShardRecord, State
from .transfer import TierTransfer

SNAPSHOT_PURPOSE = "snapshot"  # memory_report().outside key of the copy-on-write buffers


class SnapshotSpaceError(OffloadError):
    """The swap directory cannot hold the regions a snapshot keeps; the message says how
    much was needed and why the disk refused."""


@dataclass(eq=False)
class ShardSnapshot:
    """A snapshot's bookkeeping (read under the manager's lock)."""

    keys: frozenset[str]
    copy_limit: int  # host bytes of copy-on-write buffers at most
    kept: dict[str, KeptRegion] = field(default_factory=dict)  # NVMe homes: kept regions
    pending: set[str] = field(default_factory=set)  # host/device homes, still the snapshot's
    copies: dict[str, torch.Tensor] = field(default_factory=dict)  # copied before a change
    reading: set[str] = field(default_factory=set)  # being read from the home copy now
    awaiting: set[str] = field(default_factory=set)  # their update has not ended yet
    # NVMe homes whose update ended with its write in flight: kept once it has landed
    landing: dict[str, TierTransfer] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # key -> why it was not updated
    taken: set[str] = field(default_factory=set)
    closed: bool = False
    copy_bytes: int = 0  # in `copies` now
    kept_total: int = 0  # region bytes kept (or to be kept: awaiting NVMe homes) at the call
    copies_made: int = 0  # copy-on-write copies taken
    copy_waits: int = 0  # writers that waited for the reader (copy_limit reached)
    wait_s: float = 0.0  # seconds writers waited in all
    await_s: float = 0.0  # seconds the reader waited for awaiting keys' updates

    @property
    def kept_bytes(self) -> int:
        return sum(r.entry.region_bytes for r in self.kept.values())


class SnapshotCore(ResidencyCore):
    """Snapshot mechanics under TierManager (see the Note); lock rules as ResidencyCore."""

    _snap: ShardSnapshot | None = None

    def snapshot(self, keys: Sequence[str], *, copy_limit: int,
                 awaiting: Collection[str] = ()) -> ShardSnapshot:
        """Record the current data of `keys` ([Note: shard snapshots]); cheap: dirty caches
        are written down and swap regions kept, nothing else is copied. `awaiting` (a
        subset of `keys`): recorded once `snapshot_landed` names them (see the Note)."""
        with self._lock:
            if self._snap is not None:
                raise OffloadError("a snapshot is open already; close it first (one at a time)")
            unknown = sorted(set(awaiting) - set(keys))
            if unknown:
                raise OffloadError(f"snapshot: awaiting keys {unknown[:3]} are not among its keys")
            self._settle_all()
            snap = ShardSnapshot(frozenset(keys), copy_limit)
            later = 0  # region bytes of awaiting NVMe homes, kept once their update lands
            try:
                for key in keys:
                    rec = self._rec(key)
                    if key in awaiting:
                        snap.awaiting.add(key)  # the update in progress may hold it writable
                        if rec.home == "nvme" and rec.copies["nvme"].state not in TRANSIENT:
                            # room for the write after the one it will keep (with the
                            # update's write in flight, the region that one replaces will
                            # be free by then)
                            later += region_bytes(rec.spec.nbytes)
                        continue
                    self._flush_above(rec, rec.home, drop=False)
                    self._wait_settled(rec, rec.home)
                    self._check_lost(rec, "snapshot")
                    if rec.copies[rec.home].write_held:
                        raise OffloadError(f"snapshot: shard {key!r} is held writable; "
                                           "release it first")
                    if rec.home == "nvme":
                        snap.kept[key] = self._mover.keep(key)
                    else:
                        snap.pending.add(key)
                # the training's writes while the regions are kept go to new regions: room
                # for them now (the file keeps it afterwards: later snapshots reuse it)
                snap.kept_total = snap.kept_bytes + later
                if snap.kept_total:
                    self._mover.reserve_free(snap.kept_total)
            except SwapError as exc:
                self._release_snapshot(snap)
                raise SnapshotSpaceError(f"a snapshot keeps {snap.kept_bytes} bytes of swap "
                                         f"regions and cannot reserve as many for the writes "
                                         f"that replace them: {exc}") from exc
            except BaseException:
                self._release_snapshot(snap)
                raise
            self._snap = snap
            return snap

    def snapshot_landed(self, snap: ShardSnapshot, keys: Sequence[str],
                        error: str | None) -> None:
        """The update `keys` awaited has ended (`error`: why it did not update them): from
        now on their home data is the snapshot's, preserved before it changes (an NVMe
        home: its region, kept once the update's write has landed). Runs on the thread that
        ran the update, before anyone else may write the keys; never waits for the disk
        for an NVMe home."""
        with self._lock:
            for key in keys:
                if snap.closed or key not in snap.awaiting:
                    continue
                rec = self._rec(key)
                if error is None and rec.home == "nvme":
                    self._nvme_landed(snap, rec)
                elif error is None:
                    self._flush_above(rec, rec.home, drop=False)
                    self._wait_settled(rec, rec.home)
                    if snap.closed:  # closed while the write-down settled
                        break
                    snap.pending.add(key)
                else:
                    snap.failed[key] = error
                snap.awaiting.discard(key)
            self._cond.notify_all()

    def _nvme_landed(self, snap: ShardSnapshot, rec: ShardRecord) -> None:
        """An awaiting NVMe home's update has issued its writes: keep its region now if
        they have landed, else once they have (`_keep_landed`). A dirty cache above it
        (not left by the stream, which writes past the caches) is written down first."""
        key = rec.spec.key
        if any(rec.copies[t].state is State.DIRTY for t in rec.cache_tiers()):
            self._flush_above(rec, "nvme", drop=False)
        home = rec.copies["nvme"]
        if home.state in TRANSIENT and home.transfer is not None:
            snap.landing[key] = home.transfer
        else:
            snap.kept[key] = self._mover.keep(key)

    def _keep_landed(self, snap: ShardSnapshot, key: str) -> None:
        """(The key's NVMe copy settled.) Keep the region the update's write left, or
        record why it cannot be saved."""
        written = snap.landing.pop(key)
        try:
            written.wait()  # landed: returns at once, or raises its failure again
        except Exception as exc:
            snap.failed[key] = f"its write failed: {exc}"
            return
        snap.kept[key] = self._mover.keep(key)

    def snapshot_take(self, snap: ShardSnapshot, key: str, out: torch.Tensor) -> None:
        """Copy `key`'s snapshot data into the host buffer `out` (the shard's numel and
        dtype; page-aligned for a direct read) and release it. Runs on the reader's thread;
        an NVMe region is read behind the training's I/O (SwapStore.read_kept). An awaiting
        key is waited for until its update has ended."""
        with self._lock:
            if snap.closed or key not in snap.keys or key in snap.taken:
                raise OffloadError(f"snapshot_take({key!r}): not in this open snapshot, or "
                                   "taken already")
            start = time.perf_counter()
            while key in snap.awaiting and not snap.closed:
                self._cond.wait()
            rec = self._rec(key)
            while key in snap.landing and not snap.closed:  # its update's write lands first
                if rec.copies["nvme"].state in TRANSIENT:
                    self._wait_transfer(self._need(rec.copies["nvme"].transfer))
                elif key in snap.landing:
                    self._keep_landed(snap, key)
            snap.await_s += time.perf_counter() - start
            if snap.closed:
                raise OffloadError(f"snapshot_take({key!r}): the snapshot was closed while "
                                   "waiting for its update")
            if key in snap.failed:
                raise OffloadError(f"snapshot of {key!r}: its update did not complete "
                                   f"({snap.failed[key]}); the state of that step cannot be "
                                   "saved")
            if out.numel() != rec.spec.numel or out.dtype != rec.spec.dtype:
                raise OffloadError(f"snapshot_take({key!r}): got {out.numel()} x {out.dtype}, "
                                   f"the shard is {rec.spec.numel} x {rec.spec.dtype}")
            region = snap.kept.get(key)
            copied = snap.copies.pop(key, None)
            src = copied if copied is not None else rec.copies[rec.home].data
            if region is None and copied is None:
                snap.reading.add(key)
        try:
            if region is not None:
                self._mover.read_kept(region, out.reshape(-1)).wait()
            elif src is None:
                raise OffloadError(f"internal: snapshot of {key!r}: its home copy has no data")
            else:
                out.reshape(-1).copy_(src)
        finally:
            with self._lock:
                snap.taken.add(key)
                snap.reading.discard(key)
                snap.pending.discard(key)
                if region is not None:
                    del snap.kept[key]
                    self._mover.release_kept(region)
                if copied is not None:
                    self._drop_copy(snap, copied)
                self._cond.notify_all()

    def snapshot_close(self, snap: ShardSnapshot) -> None:
        """Release what was not taken (idempotent): kept regions, copies, waiting writers."""
        with self._lock:
            self._release_snapshot(snap)
            if self._snap is snap:
                self._snap = None

    def _release_snapshot(self, snap: ShardSnapshot) -> None:
        snap.closed = True
        for region in snap.kept.values():
            self._mover.release_kept(region)
        snap.kept.clear()
        for buf in snap.copies.values():
            self._drop_copy(snap, buf)
        snap.copies.clear()
        snap.pending.clear()
        snap.awaiting.clear()
        snap.landing.clear()
        self._cond.notify_all()

    def _drop_copy(self, snap: ShardSnapshot, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        snap.copy_bytes -= nbytes
        self._acct.add_outside(SNAPSHOT_PURPOSE, -nbytes)

    def _preserve(self, rec: ShardRecord, *, may_wait: bool = True) -> None:
        """The home copy of `rec` (host or device) is about to change: if an open snapshot
        still reads it there, copy it out first ([Note: shard snapshots]). `may_wait`:
        over copy_limit, wait for the reader instead (False: copy anyway, for a
        write-back, which must not block)."""
        snap, key = self._snap, rec.spec.key
        if snap is not None and key in snap.landing:  # NVMe: replaced next, so kept now
            self._keep_landed(snap, key)
            return
        if snap is None or key not in snap.pending:
            return
        start = time.perf_counter()
        while key in snap.reading:  # the reader is copying it out now: wait, then no copy
            self._cond.wait()
        nbytes = rec.spec.nbytes
        while (may_wait and key in snap.pending and snap.copy_bytes + nbytes > snap.copy_limit
               and snap.copy_bytes > 0):
            snap.copy_waits += 1
            self._cond.wait()
        snap.wait_s += time.perf_counter() - start
        if key not in snap.pending:  # read out (or the snapshot closed) meanwhile
            return
        home = rec.copies[rec.home]
        if home.data is None or home.state in TRANSIENT:
            raise OffloadError(f"internal: snapshot of {key!r}: its home copy is "
                               f"{home.state.value}")
        buf = self._alloc.empty(nbytes).view(rec.spec.dtype)
        buf.copy_(home.data)
        self._acct.add_outside(SNAPSHOT_PURPOSE, nbytes)
        snap.copies[key] = buf
        snap.copy_bytes += nbytes
        snap.copies_made += 1
        snap.pending.discard(key)
