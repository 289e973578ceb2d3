"""Speculated writes: shards written by an optimizer update that may still be undone.

[Note: speculated shards] An optimizer update run before its step is known to be exact
([Note: speculated step] in engine/step/speculation.py) writes moments, masters and
params that step() may have to take back. `TierManager.speculate(keys)` opens a
speculation over NVMe-homed keys; from then on the first write of each of them keeps the
region it replaces ([Note: kept regions] in swap/kept.py: writes are copy-on-write, so
the old data stays where it was and no byte is copied or moved). Then either

- `commit_speculation()`: the holds are released; a replaced region is freed as any
  other; or
- `undo_speculation()`: every key written since points back at its kept region (the
  newer region is freed), its caches in host and device memory are dropped unwritten
  (they hold the undone data) and its version is bumped, so a read taken out before
  (the stream's read-ahead: TierManager.version) is read again.

Only the first write of a key keeps a region: the data from before the speculation.
`speculate` writes a dirty cache of a key down first (the stream writes past the caches,
so there is rarely one), and a region is kept only once the write before it has landed
(writes of a key are one at a time), so the kept region holds the newest data from
before. The regions kept are at most the keys' own size; the
swap file grows by that much once (`reserve_speculation`) and reuses the room in every
later step, and only where the nvme budget has that room beside the swap file's own
growth (offload/placement.py, [Note: swap file growth]). Keys homed in host or device
memory are never speculated (their home would need a copy): the caller runs the exact
update instead.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from tierzero.swap import KeptRegion, SwapError
from tierzero.swap.request import region_bytes

from .errors import OffloadError
from .residency import TRANSIENT, ShardRecord, State
from .settings import Tier
from .snapshot import SnapshotCore

log = logging.getLogger(__name__)


class SpeculationSpaceError(OffloadError):
    """The swap directory cannot hold the regions a speculation keeps."""


@dataclass(eq=False)
class Speculation:
    """An open speculation's bookkeeping (under the manager's lock)."""

    keys: frozenset[str]
    kept: dict[str, KeptRegion] = field(default_factory=dict)  # written keys: the old region


class SpeculationCore(SnapshotCore):
    """Speculation mechanics under TierManager (see the Note); lock rules as ResidencyCore."""

    _spec: Speculation | None = None

    def speculation_bytes(self, keys: Collection[str]) -> int:
        """Swap bytes a speculation over `keys` keeps at most (one region per key)."""
        with self._lock:
            return sum(region_bytes(self._rec(k, placed=False).spec.nbytes) for k in keys)

    def reserve_speculation(self, keys: Collection[str]) -> None:
        """Grow the swap file so that a speculation over `keys` needs no more disk; raises
        SpeculationSpaceError (how much, and why the disk refused) when it cannot."""
        need = self.speculation_bytes(keys)
        with self._lock:
            grown, budget = self.plan.swap_file_bytes() + need, self.plan.budgets.nvme
            if grown > budget:
                raise SpeculationSpaceError(
                    f"a speculated optimizer step keeps {need} bytes of swap regions until "
                    f"step(): the swap file would grow to {grown} bytes, past the nvme "
                    f"budget of {budget} (offload.budgets.nvme_bytes, or the swap "
                    "directory's free space less offload.budgets.nvme_reserve_fraction)")
            try:
                self._mover.reserve_free(need)
            except SwapError as exc:
                raise SpeculationSpaceError(
                    f"a speculated optimizer step keeps {need} bytes of swap regions until "
                    f"step() and the swap directory cannot give as many: {exc}") from exc

    def speculate(self, keys: Collection[str]) -> None:
        """Open a speculation over `keys` (NVMe homes): their next writes can be undone."""
        with self._lock:
            if self._spec is not None:
                raise OffloadError("a speculation is open already; commit or undo it first")
            off = sorted(k for k in keys if self._rec(k).home != "nvme")
            if off:
                raise OffloadError(f"speculate: shards {off[:3]} are not homed on NVMe; only "
                                   "NVMe homes keep the data a write replaces")
            for key in keys:  # data from before in a dirty cache: down to the region first
                rec = self._rec(key)
                if any(rec.copies[t].state is State.DIRTY for t in rec.cache_tiers()):
                    self._flush_above(rec, "nvme", drop=False)
            self._spec = Speculation(frozenset(keys))

    @property
    def speculating(self) -> bool:
        return self._spec is not None

    def commit_speculation(self) -> int:
        """The speculated writes stand; returns how many keys were written."""
        with self._lock:
            spec, self._spec = self._spec, None
            if spec is None:
                return 0
            for region in spec.kept.values():
                self._mover.release_kept(region)
            return len(spec.kept)

    def undo_speculation(self) -> list[str]:
        """Every key written since speculate() holds its data from before again (see the
        Note); returns those keys. Its caches must not be held or pinned; writes of it still
        in flight are waited for."""
        with self._lock:
            spec, self._spec = self._spec, None
            if spec is None:
                return []
            self._settle_failed()
            restored: list[str] = []
            try:
                for key, region in spec.kept.items():
                    self._restore(self._rec(key), region)
                    restored.append(key)
            finally:
                for key, region in spec.kept.items():
                    if key not in restored:
                        self._mover.release_kept(region)
                self._pump()
                self._cond.notify_all()
            return restored

    def _restore(self, rec: ShardRecord, region: KeptRegion) -> None:
        self._discard_caches(rec, f"undo_speculation({rec.spec.key!r})",
                             "holds the undone data", wait=self._wait_failed)
        self._wait_failed(rec, "nvme")  # the speculated write has landed (or failed)
        self._mover.restore(region)
        rec.lost = None  # back at the data from before, which its failed write never replaced
        rec.version += 1
        self._advance(rec)

    # An undo often follows a failed write of the update (that is why it is undone): the
    # failure was raised to whoever waited for it, and the swap store left the key's
    # region as it was. Settling it again must not stop the undo halfway.
    def _settle_failed(self) -> None:
        """(Lock held.) `_settle_all`, a failed transfer logged instead of raised."""
        for _ in range(len(self._records) + 1):  # each failure is raised once
            try:
                self._settle_all()
                return
            except Exception as exc:  # logged: the undo goes on
                log.warning("undo of a speculated update: %s", exc)
        self._settle_all()

    def _wait_failed(self, rec: ShardRecord, tier: Tier) -> None:
        """(Lock held.) `_wait_settled`, a failed transfer logged instead of raised."""
        while rec.copies[tier].state in TRANSIENT:
            try:
                self._wait_transfer(self._need(rec.copies[tier].transfer))
            except Exception as exc:  # logged: the undo goes on
                log.warning("undo of a speculated update: %s", exc)

    def _preserve(self, rec: ShardRecord, *, may_wait: bool = True) -> None:
        """The home copy of `rec` is about to change: a speculated key's first write keeps
        its landed region ([Note: speculated shards]); then a snapshot's rules."""
        spec = self._spec
        key = rec.spec.key
        if spec is not None and key in spec.keys and key not in spec.kept:
            spec.kept[key] = self._mover.keep(key)
        super()._preserve(rec, may_wait=may_wait)
