"""The mechanics under TierManager: settle finished transfers, load, store,
drop, make room by eviction, and issue prefetches.

Every method here runs with ``self._lock`` held (waits release it); only
TierManager's public methods call in. See [Note: residency model] in
offload/residency.py for the states and offload/manager.py for the API.
"""


from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from tierzero.swap import trace

from . import numa
from .budget import resolve_budgets
from .errors import BudgetError, OffloadError, PlanError
from .placement import plan_placement
from .pool import BufferPool, HostAllocator, PoolBuffer
from .prefetch import Prefetcher
from .report import Accounting
from .residency import TRANSIENT, Copy, Op, Role, ShardRecord, ShardSpec, State, transition
from .settings import TIERS, Tier, TierSettings
from .transfer import Mover, SwapBackend, TierTransfer

log = logging.getLogger(__name__)

# dirty host caches written ahead at once ([Note: host caches cleaned ahead])
CLEAN_AHEAD_WRITES = 2
_FINISH = {State.LOADING: Op.LOADED, State.STORING: Op.STORED, State.FILLING: Op.FILLED}


def _device_of(settings: TierSettings) -> torch.device:
    if settings.device == "meta":  # a dry run: every buffer on meta, bytes only counted
        return torch.device("meta")
    if settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise PlanError("settings.device = 'cuda' but torch sees no CUDA device")
        return torch.device("cuda", settings.device_index)
    return torch.device("cpu")


class ResidencyCore:
    """State and mechanics shared by the TierManager's public methods."""

    def __init__(
        self, specs: Sequence[ShardSpec], settings: TierSettings, *,
        swap: SwapBackend | None = None,
    ) -> None:
        self.settings = settings
        self.device = _device_of(settings)
        needs_nvme = swap is not None or "nvme" in settings.homes.values()
        swap_path = settings.swap_path
        store_file = getattr(swap, "path", None)  # SwapStore.path: its scratch file
        if swap_path is None and isinstance(store_file, (str, os.PathLike)):
            swap_path = os.path.dirname(os.fspath(store_file))
        budgets = resolve_budgets(settings.budgets, self.device, swap_path,
                                  needs_nvme=needs_nvme)
        self.plan = plan_placement(specs, settings, budgets, self.device)
        if self.plan.pool_count and swap is None:
            on_nvme = [k for k, t in self.plan.homes.items() if t == "nvme"][:3]
            raise PlanError(f"shards {on_nvme}... are homed on nvme but no SwapStore was given; "
                            "pass swap=SwapStore(path) or set budgets.nvme = 0")
        node = None
        if settings.pool.numa_local and self.device.type == "cuda" and numa.node_count() > 1:
            node = numa.cuda_device_node(self.device.index or 0)
        self._alloc = HostAllocator(pin=self.plan.pin, node=node, meta=self.device.type == "meta")
        self._pool = BufferPool(self.plan.pool_count, self.plan.pool_buffer_bytes, self._alloc)
        self._outside: dict[int, tuple[str, int]] = {}  # id of a host_empty tensor -> use
        self._mover = Mover(self.device, swap)
        self._records = {k: ShardRecord(s, self.plan.homes[k]) for k, s in self.plan.specs.items()}
        self._acct = Accounting(budget={t: budgets.of(t) for t in TIERS},
                                base={"device": 0, "host": self._pool.nbytes, "nvme": 0})
        self._pf = Prefetcher(settings.prefetch)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # notified when room may have appeared
        self._stat_lock = threading.Lock()  # stall time is added from callers' threads
        self._busy: set[str] = set()  # keys with a transient copy
        self._expected: set[str] = set()  # to be overwritten soon: not read ahead (expect_writes)
        # the largest dirty host cache a demand had to write down to make room, 0: none yet
        # ([Note: host caches cleaned ahead])
        self._dirty_pressure = 0
        self._closed = False

    def _rec(self, key: str, *, placed: bool = True) -> ShardRecord:
        rec = self._records.get(key)
        if rec is None:
            sample = sorted(self._records)[:3]
            raise OffloadError(f"unknown shard key {key!r}; the plan has {len(self._records)} "
                               f"shards, e.g. {sample}")
        if placed and rec.copies[rec.home].state is State.ABSENT:
            raise OffloadError(f"shard {key!r} has no data yet; call place() first")
        return rec

    def _check_tier(self, rec: ShardRecord, tier: str, what: str) -> None:
        if tier not in ("device", "host"):
            raise OffloadError(f"{what}({rec.spec.key!r}, {tier!r}): expected tier 'device' or "
                               "'host' (NVMe copies are not addressable)")
        if TIERS.index(tier) > TIERS.index(rec.home):
            raise OffloadError(f"{what}({rec.spec.key!r}, {tier!r}): the shard lives on "
                               f"{rec.home}; use {rec.home} or a faster tier")

    @staticmethod
    def _need(t: TierTransfer | None) -> TierTransfer:
        if t is None:
            raise OffloadError("internal: a transient copy has no transfer")
        return t

    def _add_stall(self, seconds: float) -> None:
        with self._stat_lock:
            self._acct.stall_s += seconds

    def _user_transfer(self, copy: Copy) -> TierTransfer:
        view = copy.data
        if view is None:
            raise OffloadError(f"internal: {copy.tier} copy has no buffer")
        if view.is_cuda:  # [Note: device buffers]
            view.record_stream(torch.cuda.current_stream(view.device))
        t = copy.transfer
        if copy.state is State.LOADING and t is not None:
            out = TierTransfer(view, t.nbytes, t.direction, t.wait, t.done)
        else:
            out = TierTransfer.completed(view)
        out.on_stall = self._add_stall
        return out

    def _wait_transfer(self, t: TierTransfer, *, stall: bool = True) -> None:
        """Wait for ``t`` with the lock released, then settle what finished."""
        start = time.perf_counter()
        self._lock.release()
        failure: Exception | None = None
        try:
            t.wait()  # records its "stall" trace span itself when it blocks
        except Exception as exc:
            failure = exc
        finally:
            self._lock.acquire()
            if stall:
                self._add_stall(time.perf_counter() - start)
        self._settle_all()  # `t` too: raised to us here, its failure is not raised again
        if failure is not None:
            raise failure

    # [Note: a lost write] Writes to an NVMe home are copy-on-write: one that fails leaves
    # the key at its old region, readable. Where a dirty cache was being written down, the
    # cache keeps the new data (STORING -> DIRTY) and it is written again later. A write
    # straight from a caller's buffer (write_from: the optimizer's update) leaves no copy
    # of what it wrote: the home now holds older data than its writer gave, and its other
    # keys (the moments and param of the same group) may hold the new data. The failure
    # is raised once, to whoever settles the transfer first, which may be a thread that
    # cannot stop the run (a read-ahead). So the record remembers it, and every read of
    # the key (fetch, read_into, a snapshot) raises, naming the key and the failure, until
    # the key is written whole again (a write lands; `discard`; a fetch with discard=True,
    # whose holder overwrites every element in a cache above the home, as a checkpoint's
    # load does), or an undone speculation points it back at its kept region: a
    # checkpoint never saves, and a step never computes from, a shard whose last write was
    # lost.
    def _check_lost(self, rec: ShardRecord, what: str) -> None:
        """(Lock held.) Raise where the last write of `rec`'s home was lost."""
        if rec.lost is not None:
            raise OffloadError(
                f"{what}({rec.spec.key!r}): the last write of this shard failed and left "
                f"older data in the swap file ({rec.lost}); it is not read until written "
                "again: load a checkpoint to go on")

    def _wait_settled(self, rec: ShardRecord, tier: Tier) -> None:
        while rec.copies[tier].state in TRANSIENT:
            self._wait_transfer(self._need(rec.copies[tier].transfer))

    def _settle_all(self) -> None:
        for key in list(self._busy):
            self._advance(self._records[key])

    def _advance(self, rec: ShardRecord) -> None:
        """Apply finished transfers, then continue pending evictions of ``rec``."""
        changed = True
        while changed:
            changed = False
            for tier in reversed(TIERS):
                copy = rec.copies[tier]
                t = copy.transfer
                if t is None or not t.done():
                    continue
                copy.transfer = None
                changed = True
                told = t.raised  # its waiter (the writer) was told already
                try:
                    t.wait()
                except Exception as exc:
                    copy.drop_when_clean = False
                    if copy.state is State.LOADING:
                        self._drop(rec, tier, Op.FAILED)
                    else:
                        transition(rec, tier, Op.FAILED)
                        # the cache it was written down from keeps the data (STORING ->
                        # DIRTY) and settles with it: the failure is raised once
                        above = [c for c in rec.cache_tiers() if rec.copies[c].transfer is t]
                        for c in above:
                            rec.copies[c].transfer = None
                            transition(rec, c, Op.FAILED)
                        if tier == rec.home and not above:  # [Note: a lost write]
                            rec.lost = str(exc)
                    if told:
                        continue
                    raise
                if tier == rec.home and copy.state is State.FILLING:
                    rec.lost = None  # written whole again
                transition(rec, tier, _FINISH[copy.state])
                if copy.modify_on_load:
                    copy.modify_on_load = False
                    transition(rec, tier, Op.MODIFY)
            for tier in rec.cache_tiers():
                copy = rec.copies[tier]
                if not copy.drop_when_clean or copy.state not in (State.CLEAN, State.DIRTY):
                    continue
                if copy.users or copy.pinned:
                    copy.drop_when_clean = False
                    continue
                faster = [rec.copies[t] for t in TIERS[: TIERS.index(tier)]
                          if rec.copies[t].state is not State.ABSENT]
                if faster:  # inclusive: faster copies go first, unless they stay
                    if not any(c.drop_when_clean for c in faster):
                        copy.drop_when_clean = False
                    continue
                if copy.state is State.CLEAN:
                    self._drop(rec, tier)
                    changed = True
                elif rec.copies[rec.below(tier)].state not in TRANSIENT:
                    self._store(rec, tier)
                    changed = True
        if any(c.transfer is not None for c in rec.copies.values()) or any(
                c.drop_when_clean for c in rec.copies.values()):
            self._busy.add(rec.spec.key)
        else:
            self._busy.discard(rec.spec.key)

    def _drop(self, rec: ShardRecord, tier: Tier, op: Op = Op.DROP) -> None:
        copy = rec.copies[tier]
        transition(rec, tier, op)
        if copy.slot is not None:
            self._pool.release(copy.slot)
        else:
            self._acct.add(tier, rec.spec.cls, -rec.spec.nbytes)
        copy.slot = copy.data = None
        copy.drop_when_clean = copy.modify_on_load = False
        self._cond.notify_all()

    def _discard_caches(self, rec: ShardRecord, what: str, why: str,
                        wait: Callable[[ShardRecord, Tier], None] | None = None) -> None:
        """Drop every cache of `rec` unwritten, fastest first (caches are inclusive); none
        may be held or pinned (OffloadError: `what`, the tier and `why`). `wait` settles a
        cache's transfer first (default `_wait_settled`)."""
        for t in rec.cache_tiers():
            copy = rec.copies[t]
            if copy.users or copy.pinned or copy.write_held:
                raise OffloadError(f"{what}: its {t} cache is held or pinned and {why}; "
                                   "release it first")
        for t in rec.cache_tiers():
            (wait or self._wait_settled)(rec, t)
            if rec.copies[t].state is not State.ABSENT:
                self._drop(rec, t, Op.DISCARD)

    def _preserve(self, rec: ShardRecord, *, may_wait: bool = True) -> None:
        """The home copy of ``rec`` is about to change (offload/snapshot.py keeps an open
        snapshot's data); nothing to do without snapshots."""

    def _store(self, rec: ShardRecord, tier: Tier) -> TierTransfer:
        """Write the dirty cache on ``tier`` one tier down."""
        copy = rec.copies[tier]
        below = rec.below(tier)
        if below == rec.home:  # NVMe writes are copy-on-write: only a landed region is kept
            self._preserve(rec, may_wait=False)
        dst = rec.copies[below]
        if copy.data is None:
            raise OffloadError(f"internal: storing {rec.spec.key!r} from an empty {tier} copy")
        transition(rec, tier, Op.STORE)
        trace.instant("writeback", rec.spec.key, to=below, bytes=rec.spec.nbytes)
        if dst.state is State.ABSENT:
            transition(rec, below, Op.PLACE)
            self._acct.add(below, rec.spec.cls, rec.spec.nbytes)
        else:
            transition(rec, below, Op.RECEIVE)
        if below == "nvme":
            t = self._mover.write(rec.spec.key, copy.data)
        else:
            t = self._mover.copy(copy.data, self._need_data(dst), "device_to_host",
                                 key=rec.spec.key)
        copy.transfer = dst.transfer = t
        self._acct.moved_bytes(t.direction, rec.spec.cls, t.nbytes)
        self._acct.writebacks += 1
        self._busy.add(rec.spec.key)
        return t

    @staticmethod
    def _need_data(copy: Copy) -> torch.Tensor:
        if copy.data is None:
            raise OffloadError(f"internal: {copy.tier} copy has no buffer")
        return copy.data

    def _flush_above(self, rec: ShardRecord, tier: Tier, *, drop: bool) -> None:
        """Make ``tier`` hold the newest data: write faster dirty caches down to it."""
        for t in TIERS[: TIERS.index(tier)]:
            copy = rec.copies[t]
            if copy.state is State.ABSENT:
                continue
            if copy.write_held:
                raise OffloadError(f"fetch({rec.spec.key!r}, {tier!r}): the {t} copy is held "
                                   "writable and may be half written; release it first")
            self._wait_settled(rec, t)
            if copy.state is State.DIRTY:
                self._wait_settled(rec, rec.below(t))
                self._store(rec, t)
                self._wait_settled(rec, t)
            if drop:
                if copy.users or copy.pinned:
                    raise OffloadError(f"fetch({rec.spec.key!r}, {tier!r}, writable=True): the "
                                       f"{t} cache is held or pinned and would turn stale; "
                                       "release/unpin it first")
                if copy.state is State.CLEAN:
                    self._drop(rec, t)

    def _bring(self, rec: ShardRecord, tier: Tier, *, demand: bool) -> bool:
        """Start loading ``rec`` into ``tier`` (and the tiers between); False if no room."""
        copy = rec.copies[tier]
        if copy.state is not State.ABSENT:
            return True
        below = rec.below(tier)
        src = rec.copies[below]
        if src.state is State.ABSENT and not self._bring(rec, below, demand=demand):
            return False
        if src.write_held:  # its holder may still be writing: a copy now would be stale
            if not demand:
                return False
            raise OffloadError(f"fetch({rec.spec.key!r}, {tier!r}): the {below} copy is held "
                               "writable; release it before fetching the shard to a faster tier")
        if below == "nvme" and src.state is State.FILLING:  # a write-back is landing
            if not demand:
                return False
            self._wait_settled(rec, "nvme")
        src.users += 1  # keep the source while waiting for room
        try:
            if not self._room(tier, rec, demand=demand):
                return False
        finally:
            src.users -= 1
        if copy.state is not State.ABSENT:  # another thread loaded it while we waited
            return True
        spec = rec.spec
        transition(rec, tier, Op.LOAD)
        if tier == "host":
            slot = self._take(spec.nbytes)
            copy.slot, copy.data = slot, slot.view(spec)
            t = self._mover.read(spec.key, copy.data)
        else:
            copy.data = self._mover.empty_device(spec.numel, spec.dtype)
            self._acct.add(tier, spec.cls, spec.nbytes)
            after = src.transfer if src.state in (State.LOADING, State.FILLING) else None
            t = self._mover.copy(self._need_data(src), copy.data, "host_to_device", after=after,
                                 key=spec.key)
        copy.transfer = t
        self._acct.moved_bytes(t.direction, spec.cls, t.nbytes)
        self._busy.add(spec.key)
        return True

    def _take(self, nbytes: int) -> PoolBuffer:
        slot = self._pool.try_acquire(nbytes)  # a span of buffers if larger than one
        if slot is None:
            raise OffloadError("internal: no free pool buffer after room was made")
        return slot

    def _fits(self, tier: Tier, nbytes: int) -> bool:
        if tier == "host":  # host caches and staging live in the pool ([Note: pool spans])
            return self._pool.can_take(nbytes)
        return self._acct.current(tier) + nbytes <= self._acct.budget[tier]

    def _room(self, tier: Tier, rec: ShardRecord, *, demand: bool) -> bool:
        """Make room for ``rec`` on ``tier``: evict, wait for write-backs and releases."""
        nbytes = rec.spec.nbytes
        if tier == "device":
            cap = self._acct.budget["device"] - self.plan.home_bytes("device")
            if nbytes > cap:
                raise BudgetError(f"shard {rec.spec.key!r} ({nbytes} bytes) is larger than the "
                                  f"device tier's cache room ({cap} bytes); raise the budget")
        elif self._pool.slots_for(nbytes) > self._pool.count:
            raise BudgetError(f"shard {rec.spec.key!r} ({nbytes} bytes) is larger than the "
                              f"whole NVMe staging pool ({self._pool.count} x "
                              f"{self._pool.buffer_bytes} bytes); raise pool.buffer_count")
        deadline = time.monotonic() + self.settings.wait_timeout_s
        while True:
            self._settle_all()
            if self._fits(tier, nbytes):
                return True
            victim = self._victim(tier, rec, demand=demand)
            if victim is not None:
                trace.instant("evict", victim.spec.key, tier=tier, to_fit=rec.spec.key)
                if demand and tier == "host" and victim.copies[tier].state is State.DIRTY:
                    self._dirty_pressure = max(self._dirty_pressure, victim.spec.nbytes)
                for t in TIERS[: TIERS.index(tier) + 1]:
                    if victim.copies[t].state is not State.ABSENT:
                        victim.copies[t].drop_when_clean = True
                self._acct.evictions += 1
                self._advance(victim)  # clean: dropped now; dirty: its write-back starts
                pending = self._freeing(tier) if demand else None
                if pending is not None:  # wait for it before choosing another victim
                    self._wait_transfer(pending)
                continue
            if not demand:
                return False
            pending = self._freeing(tier)
            if pending is not None:
                self._wait_transfer(pending)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise BudgetError(self._full_message(tier, rec))
            # A copy in flight on this tier is no victim until its transfer lands, and a
            # transfer landing notifies nobody (its completion is settled by the next
            # manager call): wait for one directly, else for a release (notified).
            pending = self._in_flight(tier)
            if pending is not None:
                self._wait_transfer(pending)
                continue
            self._cond.wait(left)

    def _victim(self, tier: Tier, rec: ShardRecord | None, *, demand: bool
                ) -> ShardRecord | None:
        """The evictable cache on ``tier`` used furthest in the future (then least recently),
        to make room for ``rec`` (None: for whoever asks next).

        Prefetch may only take clean caches whose next use is after its own shard's.
        """
        limit = -math.inf if demand or rec is None else self._pf.next_use(rec.spec.key)
        best: ShardRecord | None = None
        best_score = (-math.inf, 0.0)
        for other in self._records.values():
            copy = other.copies[tier]
            if (other is rec or copy.role is Role.HOME or copy.drop_when_clean
                    or copy.state not in (State.CLEAN, State.DIRTY)):
                continue
            chain = [other.copies[t] for t in TIERS[: TIERS.index(tier) + 1]]
            chain = [c for c in chain if c.state is not State.ABSENT]
            if any(c.users or c.pinned or c.state in TRANSIENT for c in chain):
                continue
            if not demand and any(c.state is State.DIRTY for c in chain):
                continue
            # a cache of data about to be replaced (expect_writes) has no use left
            nxt = (math.inf if other.spec.key in self._expected
                   else self._pf.next_use(other.spec.key))
            if nxt <= limit:
                continue
            score = (nxt, -float(copy.last_use))
            if best is None or score > best_score:
                best, best_score = other, score
        return best

    def _freeing(self, tier: Tier) -> TierTransfer | None:
        """An in-flight transfer whose completion lets an eviction free room on ``tier``."""
        for key in sorted(self._busy):
            rec = self._records[key]
            if not rec.copies[tier].drop_when_clean:
                continue
            for t in TIERS[: TIERS.index(tier) + 1]:
                if rec.copies[t].transfer is not None:
                    return rec.copies[t].transfer
            below = rec.copies[rec.below(tier)]
            if below.transfer is not None:
                return below.transfer
        return None

    def _in_flight(self, tier: Tier) -> TierTransfer | None:
        """A transfer in flight into or out of a cache copy on ``tier``: once it lands the
        copy may be evicted (a write-back done, a read-ahead arrived)."""
        for key in sorted(self._busy):
            copy = self._records[key].copies[tier]
            if (copy.role is not Role.HOME and copy.state in TRANSIENT
                    and copy.transfer is not None):
                return copy.transfer
        return None

    def _full_message(self, tier: Tier, rec: ShardRecord) -> str:
        held = [k for k, r in self._records.items() if r.copies[tier].users]
        pinned = [k for k, r in self._records.items() if r.copies[tier].pinned]
        room = (f"{self._pool.in_use}/{self._pool.count} pool buffers taken" if tier == "host"
                else f"{self._acct.current(tier)} of {self._acct.budget[tier]} bytes used")
        return (f"tier {tier} has no room for shard {rec.spec.key!r} ({rec.spec.nbytes} bytes) "
                f"after {self.settings.wait_timeout_s} s: {room}; held by fetches: {held[:8]}, "
                f"pinned: {pinned[:8]}. Release shards sooner, or raise the {tier} budget"
                + (" / pool.buffer_count" if tier == "host" else ""))

    def _pump(self) -> None:
        """Issue the prefetch queue's wanted transfers in order, never waiting; then keep
        one dirty cache's worth of the pool ready to take ([Note: host caches cleaned
        ahead]), counting the room those prefetches have just taken."""
        if self._pf.active:
            self._prefetch()
        self._clean_ahead()

    def _prefetch(self) -> None:
        stopped: set[Tier] = set()
        wanted = self._pf.wanted(lambda k: self._records[k].spec.nbytes,
                                 lambda k: self._records[k].home == "nvme")
        for key, tier in wanted:
            rec = self._records[key]
            if (tier in stopped or TIERS.index(tier) >= TIERS.index(rec.home)
                    or key in self._expected):  # its data now is about to be replaced
                continue
            if rec.copies[tier].state is not State.ABSENT:
                continue
            if self._bring(rec, tier, demand=False):
                self._acct.prefetches += 1
                trace.instant("prefetch", key, tier=tier)
            else:
                stopped.add(tier)

    # [Note: host caches cleaned ahead]
    # A dirty host cache of an NVMe-homed shard (a gradient reduced into the staging pool)
    # is written down only when its buffer is needed: the caller that needs the room (the
    # next reduction) then waits for the whole write (at 2.07B about 0.1 s per unit, 2 s of
    # a backward). So once a demand has had to write a dirty cache down, whenever the pool
    # has no room for the largest such cache and the cache the next demand would evict
    # (_victim: used furthest ahead) is dirty, its write starts now and it stays cached,
    # clean: the demand drops it without waiting. At most CLEAN_AHEAD_WRITES such writes
    # in flight, one started per call: a backward reduces a unit's gradient while the
    # previous unit's is still being written ahead, and with one in flight that
    # reduction's victim was the next dirty gradient, written whole while it waited. Each
    # is a write that eviction would have made, except for a gradient the step would have
    # consumed and dropped unwritten. A run whose dirty caches all fit (never evicted
    # dirty) writes nothing ahead: its caches stay dirty as before. Called from every
    # _pump after its prefetches: a read-ahead that takes the last free room (a backward's
    # next param, issued as the unit before it is gathered) starts the write at once,
    # so it lands beside the read instead of under the next reduction that needs the
    # room. The checks before the victim scan look at the pool and the transfers in
    # flight only.
    def _clean_ahead(self) -> None:
        need = self._dirty_pressure
        if not need or self._pool.can_take(need):
            return
        ahead = 0
        for key in self._busy:  # a cache being written ahead is in flight (transient)
            copy = self._records[key].copies["host"]
            if (copy.state is State.STORING and copy.role is Role.CACHE
                    and not copy.drop_when_clean):
                ahead += 1
                if ahead >= CLEAN_AHEAD_WRITES:
                    return
        victim = self._victim("host", None, demand=True)
        if (victim is not None and victim.copies["host"].state is State.DIRTY
                and victim.copies["device"].state is State.ABSENT
                and victim.copies[victim.below("host")].state not in TRANSIENT):
            self._store(victim, "host")
