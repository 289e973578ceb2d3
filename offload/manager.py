"""TierManager: the one owner of where every shard lives.

    plan = specs + settings -> homes, budgets, pool        (offload.placement)
    mgr = TierManager(specs, settings, swap=SwapStore(path))
    mgr.place(key, tensor).wait()          # initial data to the home tier
    mgr.set_order([(key, "device"), ...])  # upcoming uses: drives prefetch + eviction
    view = mgr.fetch(key, "device").wait() # 1D tensor of the shard, valid until release
    mgr.release(key)                       # the caller is done with the view
    mgr.evict(key)                         # drop caches, writing dirty data down first
    mgr.expect_writes(keys)                # about to be overwritten: no read-ahead of them
    mgr.memory_report()

Residency follows [Note: residency model] in offload/residency.py.

Budgets are enforced when room is taken. A demand fetch evicts the unused,
unpinned cache whose next use (in the order given to set_order) is furthest
away, least recently used first among ties; a dirty victim is written down
first. If nothing is evictable it waits for in-flight write-backs and for any cache
copy's transfer in flight on the tier (a transfer that lands notifies nobody, so it
is waited for directly), then for other threads to release, and raises BudgetError
after ``wait_timeout_s``
naming the holders. A single shard larger than a tier fails at once. Prefetch
never waits: it takes free room or evicts clean caches used later than its own
shard, and stops issuing for a tier at the first shard that does not fit.

Accounting: device bytes are device copies; host bytes are host-homed shards
plus the whole NVMe staging pool (host caches of NVMe shards live inside it);
nvme bytes are NVMe-homed shards.

Write-backs chain one tier at a time (device -> host -> nvme); each next step
is issued by the manager call that sees the previous one land, and
``synchronize()`` drives every chain to the end. A failed transfer raises
TransferError from its ``wait()`` and, once, from the manager call that settles
it; a cache it was filling is dropped, a write-back's source stays dirty.

Threads: every public method takes one lock; waits on transfers and for room
release it. Views returned by fetch are valid until the matching release().
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from types import TracebackType

import torch

from tierzero.swap import trace

from .audit import check_records
from .errors import OffloadError
from .report import MemoryReport
from .residency import Copy, Op, Role, ShardRecord, State, transition
from .settings import TIERS, Tier
from .speculation import SpeculationCore
from .transfer import TierTransfer

log = logging.getLogger(__name__)


class TierManager(SpeculationCore):
    """Places, fetches, releases and evicts shards across device, host and NVMe."""

    # ---------------------------------------------------------------- public API
    def home_of(self, key: str) -> Tier:
        return self._rec(key).home

    def pool_spans(self, key: str) -> tuple[int, int]:
        """(pool buffers a host cache of the shard takes, buffers in the pool): how much of
        the staging pool holding that cache keeps from the other fetches."""
        return self._pool.slots_for(self._rec(key, placed=False).spec.nbytes), self._pool.count

    def host_empty(self, numel: int, dtype: torch.dtype, *, purpose: str = "buffers"
                   ) -> torch.Tensor:
        """A 1D host tensor allocated like the manager's own: aligned, pinned when it pins.
        Counted in memory_report().outside[purpose] until host_free() (outside the host
        budget, which its caller took out of it first)."""
        itemsize = dtype.itemsize
        out = self._alloc.empty(numel * itemsize).view(dtype)
        with self._lock:
            self._acct.add_outside(purpose, numel * itemsize)
            self._outside[id(out)] = (purpose, numel * itemsize)
        return out

    def host_free(self, tensor: torch.Tensor) -> None:
        """The caller drops a host_empty() tensor: it is no longer counted."""
        with self._lock:
            entry = self._outside.pop(id(tensor), None)
            if entry is None:
                raise OffloadError("host_free() of a tensor host_empty() did not hand out")
            self._acct.add_outside(entry[0], -entry[1])

    def place(self, key: str, data: torch.Tensor) -> TierTransfer:
        """Copy a shard's first data to its home tier; wait() before reusing ``data``."""
        with self._lock:
            rec = self._rec(key, placed=False)
            spec = rec.spec
            if data.numel() != spec.numel or data.dtype != spec.dtype:
                raise OffloadError(f"place({key!r}): got {data.numel()} x {data.dtype}, the "
                                   f"shard is {spec.numel} x {spec.dtype}")
            home = rec.copies[rec.home]
            if home.state is not State.ABSENT:
                raise OffloadError(f"place({key!r}): the shard is already placed on {rec.home}")
            src = data.detach().reshape(-1)
            if rec.home == "nvme":  # stage through a pool buffer, then write down
                self._room("host", rec, demand=True)
                cache = self._new_dirty_host(rec)
                self._need_data(cache).copy_(src)
                cache.drop_when_clean = True
                return self._store(rec, "host")
            transition(rec, rec.home, Op.PLACE)
            self._acct.add(rec.home, spec.cls, spec.nbytes)
            if rec.home == "host":
                home.data = self._alloc.empty(spec.nbytes).view(spec.dtype)
                home.data.copy_(src)
                transition(rec, rec.home, Op.FILLED)
                return TierTransfer.completed(home.data)
            home.data = self._mover.empty_device(spec.numel, spec.dtype)
            home.transfer = self._mover.copy(src, home.data, "host_to_device")
            self._busy.add(key)
            return home.transfer

    def fetch(self, key: str, tier: Tier, *, writable: bool = False,
              discard: bool = False, ordered: bool = True) -> TierTransfer:
        """Bring the shard to ``tier``; ``wait()`` gives a 1D view, valid until release().
        ``ordered=False``: a use outside the order given to set_order (the optimizer
        reading a gradient beside forward), which neither advances nor departs from it.
        A shard whose write is expected (expect_writes) is fetched once that write is issued.

        ``writable=True`` marks a cache dirty (it is written down before being
        dropped) and first drops faster caches, which would turn stale. Until all
        holders of a copy fetched writable have released it, it is never the
        source of another copy: fetching the shard to a faster tier, or a slower
        one that needs it flushed, raises OffloadError (prefetch skips it).

        ``discard=True`` (with ``writable``): the caller overwrites every element, so
        the old data is not needed. A host cache of an NVMe-homed shard is then made
        from a free pool buffer (a span for a large shard) without reading the swap
        file, dirty from the start: loading a checkpoint reads the checkpoint only,
        not the state it replaces too. The view's contents are undefined until written.
        """
        return _demanded(self._fetch(key, tier, writable=writable, discard=discard,
                                     ordered=ordered, replacing=False), key)

    def fetch_ahead(self, key: str, tier: Tier) -> TierTransfer | None:
        """fetch(key, tier, ordered=False) for a caller reading ahead while it holds other
        shards: None, holding nothing, when the copy would need room it cannot get at
        once (a free buffer, or a clean cache used later); it never waits for room, so it
        cannot wait on what its caller holds ([Note: shard inputs read ahead])."""
        return self._fetch(key, tier, writable=False, discard=False, ordered=False,
                           replacing=False, ahead=True)

    def _fetch(self, key: str, tier: Tier, *, writable: bool, discard: bool, ordered: bool,
               replacing: bool, ahead: bool = False) -> TierTransfer | None:
        """fetch(); `replacing`: the caller is the expected write's own writer (read_into);
        `ahead`: fetch_ahead (None where room is not free now)."""
        if discard and not writable:
            raise OffloadError(f"fetch({key!r}, discard=True) needs writable=True: the "
                               "view's old contents are not read")
        with self._lock:
            rec = self._rec(key)
            self._check_tier(rec, tier, "fetch")
            if not replacing:
                self._wait_expected(key, "fetch")
            self._settle_all()
            if not discard:  # a discarding fetch overwrites it whole
                self._check_lost(rec, "fetch")
            # a fetch that overwrites a shard the order does not list (a fresh gradient:
            # nothing to read ahead) does not depart from the order
            if discard and not self._pf.lists(key):
                self._pf.overwritten(key)
            elif ordered:
                self._pf.consume(key, tier)
            if writable and tier == rec.home:  # an open snapshot may still read it there
                self._preserve(rec)
            self._flush_above(rec, tier, drop=writable)
            copy = rec.copies[tier]
            # [Note: reading a cache while it is written down] A cache being written one
            # tier down (STORING) holds the newest data and the write only reads it: a
            # read-only holder takes it at once (its hold keeps the buffer past the write,
            # and voids an eviction that started the write); a writable one waits, as a
            # write must not change bytes being written. A copy FILLING has no data yet.
            if copy.state is State.FILLING or (copy.state is State.STORING and writable):
                self._wait_settled(rec, tier)
            if copy.state is State.ABSENT and discard and tier == "host" and rec.home == "nvme":
                self._acct.misses += 1
                self._fresh_host(rec)
            elif copy.state is State.ABSENT:
                if not self._bring(rec, tier, demand=not ahead):
                    return None  # fetch_ahead: no room now
                self._acct.misses += 1
            else:
                self._acct.hits += 1
            copy.users += 1
            if discard and copy.state is not State.LOADING:
                # its holder overwrites the copy it now holds ([Note: a lost write]); a
                # copy still loading could fail and leave the home as the data: marked on
                rec.lost = None
            for t in TIERS[TIERS.index(tier):]:  # used again: a pending eviction is void
                rec.copies[t].drop_when_clean = False
            copy.touch()
            copy.write_held = copy.write_held or writable
            rec.version += writable
            if writable and copy.role is Role.CACHE:
                if copy.state is State.LOADING:
                    copy.modify_on_load = True
                else:
                    transition(rec, tier, Op.MODIFY)
            out = self._user_transfer(copy)
            self._pump()
            return out

    def release(self, key: str, tier: Tier | None = None) -> None:
        """End one fetch() hold (the fastest held copy when ``tier`` is None)."""
        with self._lock:
            rec = self._rec(key)
            held = [t for t in TIERS if rec.copies[t].users > 0 and tier in (None, t)]
            if not held:
                raise OffloadError(f"release({key!r}, {tier!r}): the shard is not held there; "
                                   "call release() once per fetch()")
            copy = rec.copies[held[0]]
            rec.version += copy.write_held
            copy.users -= 1
            copy.write_held = copy.write_held and copy.users > 0
            self._settle_all()
            self._pump()
            self._cond.notify_all()

    def version(self, key: str) -> int:
        """A counter bumped whenever the shard's data may change; a copy taken out by
        read_into() at version v is current while version() still returns v."""
        with self._lock:
            return self._rec(key).version

    def read_into(self, key: str, out: torch.Tensor, *, background: bool = False,
                  replacing: bool = False) -> TierTransfer:
        """Copy the shard's newest data into the caller's host buffer ``out``; no cache is
        made. A shard homed on NVMe with no host cache is read straight from the swap file
        into ``out`` (page-aligned: O_DIRECT, no pool buffer, no extra copy; the swap store
        orders it after earlier writes of the key); otherwise ``out`` is copied from the
        fastest present copy at once. Keep ``out`` alive until ``wait()``.
        background=True: read-ahead, wanted later; its NVMe read goes behind every other
        read (parameter fetches first; SwapStore.read).
        replacing=True: the caller is the one whose write of the key was announced
        (expect_writes) and reads the data it is about to replace (a bf16 master is the
        param): it does not wait for its own write, and its read is not a use of the
        prefetch order."""
        with self._lock:
            rec = self._rec(key)
            self._check_out(rec, out, "read_into")
            if not replacing:
                self._wait_expected(key, "read_into")
            self._settle_all()
            if rec.home == "nvme" and rec.copies["host"].state is State.ABSENT:
                self._wait_settled(rec, "nvme")  # a write of the key lands first
                self._check_lost(rec, "read_into")
                t = self._mover.read(key, out.reshape(-1), background=background)
                self._acct.moved_bytes(t.direction, rec.spec.cls, t.nbytes)
                return t
        tier: Tier = "device" if rec.home == "device" else "host"
        view = _demanded(self._fetch(key, tier, writable=False, discard=False,
                                     ordered=not replacing, replacing=replacing), key).wait()
        try:
            out.reshape(-1).copy_(view)
        finally:
            self.release(key, tier)
        return TierTransfer.completed(out)

    def write_from(self, key: str, src: torch.Tensor, *, keep_host: bool = False
                   ) -> TierTransfer:
        """Overwrite the whole shard with the caller's host buffer ``src``.

        A shard homed on NVMe is written straight from ``src`` to the swap file (no pool
        buffer); its caches are discarded first (they would be stale), so none may be held
        or pinned. The home copy stays in flight until the write lands: fetches wait for it
        and a failure is raised by the transfer and the manager call that settles it.
        Other homes are copied into at once. Keep ``src`` unchanged until ``wait()``.

        ``keep_host=True`` (NVMe homes; a request, honoured when a pool buffer is free now or
        made free as prefetch makes room: by dropping a clean cache whose next use comes
        later, never waiting): ``src`` is copied into a pool buffer that becomes a
        dirty host cache and is written down from there like any write-back, then stays
        as a clean cache. A fetch soon after reads it in host memory instead of waiting for
        the write and reading the bytes back; the cache is evictable like any other.
        """
        with self._lock:
            rec = self._rec(key)
            self._check_out(rec, src, "write_from")
            if rec.home == "nvme":
                self._settle_all()
                self._discard_caches(rec, f"write_from({key!r})", "would turn stale")
                self._wait_settled(rec, "nvme")  # one write of the key in flight at a time
                self._preserve(rec)  # a snapshot's landed region is kept before it is replaced
                rec.version += 1
                if (keep_host and self._pool.slots_for(rec.spec.nbytes) <= self._pool.count
                        and self._room("host", rec, demand=False)):
                    out = self._write_through(rec, src)
                else:
                    home = rec.copies["nvme"]
                    transition(rec, "nvme", Op.RECEIVE)
                    out = home.transfer = self._mover.write(key, src.reshape(-1))
                    self._acct.moved_bytes(out.direction, rec.spec.cls, out.nbytes)
                    self._acct.writebacks += 1
                    self._busy.add(key)
                self._written(key)  # issued: a reader is ordered after it from here on
                return out
            self._written(key)  # the writable fetch below is the write
        tier: Tier = "device" if rec.home == "device" else "host"
        view = self.fetch(key, tier, writable=True).wait()
        try:
            view.copy_(src.reshape(-1))
        finally:
            self.release(key, tier)
        return TierTransfer.completed(src)

    def expect_writes(self, keys: Collection[str], expected: bool = True) -> None:
        """These shards will soon be overwritten whole by write_from (an optimizer update
        deferred into forward writes each group's param just before its gather): until
        then prefetch does not read their data, which is about to be replaced, and a fetch
        or read_into of one waits for its write. `expected` False: no longer (the write
        will not come, or came another way)."""
        with self._lock:
            for key in keys:
                self._rec(key, placed=False)
            if expected:
                self._expected.update(keys)
            else:
                self._expected.difference_update(keys)
                self._cond.notify_all()

    def _written(self, key: str) -> None:
        """(Lock held.) `key`'s expected write is issued: its readers may go on."""
        if key in self._expected:
            self._expected.discard(key)
            self._cond.notify_all()

    def _wait_expected(self, key: str, what: str) -> None:
        """(Lock held.) Wait while `key`'s expected write has not been issued."""
        deadline = time.monotonic() + self.settings.wait_timeout_s
        while key in self._expected:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OffloadError(f"{what}({key!r}): its expected write (expect_writes) was "
                                   f"not issued within {self.settings.wait_timeout_s} s; "
                                   "whoever announced it must write it or withdraw it")
            self._cond.wait(left)

    def _fresh_host(self, rec: ShardRecord) -> None:
        """fetch(discard=True): a dirty host cache of an NVMe shard, its old bytes unread."""
        self._wait_settled(rec, "nvme")  # an earlier write of the key lands first
        self._room("host", rec, demand=True)
        if rec.copies["host"].state is State.ABSENT:  # else loaded while we waited
            self._new_dirty_host(rec)

    def _write_through(self, rec: ShardRecord, src: torch.Tensor) -> TierTransfer:
        """write_from(keep_host=True): new data as a dirty host cache, stored at once."""
        self._need_data(self._new_dirty_host(rec)).copy_(src.reshape(-1))
        return self._store(rec, "host")  # dirty -> storing -> clean; stays cached

    def _new_dirty_host(self, rec: ShardRecord) -> Copy:
        """An absent host cache made from a free pool buffer (room already made), dirty:
        newer than the home copy. Its contents are the caller's to write."""
        cache = rec.copies["host"]
        slot = self._take(rec.spec.nbytes)
        transition(rec, "host", Op.WRITE)
        cache.slot, cache.data = slot, slot.view(rec.spec)
        cache.touch()
        return cache

    def _check_out(self, rec: ShardRecord, buf: torch.Tensor, what: str) -> None:
        spec = rec.spec
        host = "meta" if self.device.type == "meta" else "cpu"  # a dry run's host is meta
        if buf.numel() != spec.numel or buf.dtype != spec.dtype or buf.device.type != host:
            raise OffloadError(f"{what}({spec.key!r}): got {buf.numel()} x {buf.dtype} on "
                               f"{buf.device}; the shard is {spec.numel} x {spec.dtype} and "
                               "the buffer must be in host memory")

    def evict(self, key: str, tier: Tier | None = None) -> None:
        """Drop the cache on ``tier`` (all caches when None), writing dirty data down.

        Returns at once; write-backs run in the background and the copy is
        dropped when they land. A cache on host also drops its device cache
        (caches are inclusive).
        """
        with self._lock:
            rec = self._rec(key)
            if tier is not None:
                self._check_tier(rec, tier, "evict")
                if tier == rec.home:
                    raise OffloadError(f"evict({key!r}, {tier!r}): that is the shard's home "
                                       "(authoritative copy); only caches can be evicted")
            tiers = rec.cache_tiers() if tier is None else TIERS[: TIERS.index(tier) + 1]
            for t in tiers:
                copy = rec.copies[t]
                if copy.state is State.ABSENT:
                    continue
                if copy.users or copy.pinned:
                    why = f"held by {copy.users} fetch(es)" if copy.users else "pinned"
                    raise OffloadError(f"evict({key!r}): the {t} copy is {why}; release/unpin "
                                       "it first")
            for t in tiers:
                if rec.copies[t].state is not State.ABSENT:
                    rec.copies[t].drop_when_clean = True
                    self._acct.evictions += 1
                    trace.instant("evict", key, tier=t)
            self._advance(rec)

    def discard(self, key: str) -> bool:
        """Drop the shard's caches without writing them down: the caller will not read the
        current data again (it overwrites the whole shard first). The home copy keeps older
        data. The engine discards a gradient the optimizer step has consumed ([Note: gradient
        home] in engine/shards/tier_config.py), so a dirty host cache of an NVMe-homed gradient
        is freed without a write. Returns False, changing nothing, when a cache is held or
        pinned (then it stays, and is written down when evicted, as any dirty cache)."""
        with self._lock:
            rec = self._rec(key)
            self._settle_all()
            caches = [rec.copies[t] for t in rec.cache_tiers()]
            if any(c.users or c.pinned or c.write_held for c in caches):
                return False
            dropped = False
            for t in rec.cache_tiers():  # fastest first: caches are inclusive
                self._wait_settled(rec, t)
                if rec.copies[t].state is not State.ABSENT:
                    self._drop(rec, t, Op.DISCARD)
                    dropped = True
            rec.version += dropped
            rec.lost = None  # the caller overwrites the whole shard before reading it
            self._advance(rec)
            self._pump()
            return True

    def pin(self, key: str, tier: Tier = "device") -> TierTransfer:
        """Fetch to ``tier`` and keep the copy there (persistent) until unpin()."""
        out = self.fetch(key, tier)
        with self._lock:
            rec = self._rec(key)
            rec.copies[tier].pinned = True
            rec.copies[tier].users -= 1  # the pin holds it, not a fetch
        return out

    def unpin(self, key: str, tier: Tier = "device") -> None:
        with self._lock:
            self._rec(key).copies[tier].pinned = False
            self._cond.notify_all()

    def set_order(self, entries: Sequence[tuple[str, Tier]]) -> None:
        """The upcoming uses, in order; replaces the previous order and starts prefetch."""
        with self._lock:
            for key, tier in entries:
                self._check_tier(self._rec(key), tier, "set_order")
            self._pf.set_order(entries)
            self._settle_all()
            self._pump()

    def synchronize(self) -> None:
        """Wait until no transfer is in flight and every requested eviction is done."""
        with self._lock:
            while True:
                self._settle_all()
                pending = next((self._records[k] for k in sorted(self._busy)), None)
                if pending is None:
                    return
                waiting = next((c.transfer for c in pending.copies.values()
                                if c.transfer is not None), None)
                if waiting is None:
                    raise OffloadError(f"internal: shard {pending.spec.key!r} is marked busy "
                                       "with nothing in flight")
                self._wait_transfer(waiting, stall=False)

    def memory_report(self) -> MemoryReport:
        with self._lock:
            self._settle_all()
            return self._acct.report(
                mismatches=self._pf.mismatches,
                pool=(self._pool.count, self._pool.buffer_bytes, self._pool.in_use,
                      self._pool.peak_in_use))

    def audit(self) -> None:
        """Re-derive byte counts from the records and check every invariant; raise if broken
        (offload/audit.py)."""
        with self._lock:
            check_records(self._records, self._pool, self._acct)

    def close(self) -> None:
        """Finish in-flight work, stop the workers and free the pool."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:  # a failed transfer is raised, but the workers still stop
            self._mover.close()
            self._pool.close()

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _demanded(t: TierTransfer | None, key: str) -> TierTransfer:
    """A demand fetch's transfer (it waits for room, so it always has one)."""
    if t is None:
        raise OffloadError(f"internal: a demand fetch of {key!r} returned no transfer")
    return t
