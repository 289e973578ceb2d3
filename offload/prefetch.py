"""Prefetch queue: the recorded order of upcoming uses and the look-ahead windows.

The engine records the order in which it fetches shards (first step) and hands
it over with ``TierManager.set_order``. Each ``fetch`` advances a cursor. After
every call the manager asks :meth:`Prefetcher.wanted` what should be in flight
and issues those transfers in order, stopping at the first that does not fit:

- device window: the next ``prefetch.device_bytes`` of entries that target the
  device get their host -> device copies started;
- NVMe window: the next ``prefetch.nvme_bytes`` of entries whose shard lives on
  NVMe get their NVMe -> host reads started, further ahead than the device
  window because NVMe is the slowest link.

A new order replaces the old one: nothing of the old windows is issued any
more (transfers already running finish and stay as ordinary, evictable caches).
The same order tells eviction which cached shard is next used furthest away.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence

from .settings import PrefetchSettings, Tier

log = logging.getLogger(__name__)


class Prefetcher:
    """The upcoming (key, tier) uses, a cursor into them, and the windows."""

    def __init__(self, settings: PrefetchSettings) -> None:
        self.settings = settings
        self._entries: list[tuple[str, Tier]] = []
        self._positions: dict[str, list[int]] = {}  # key -> sorted indices in the order
        self.cursor = 0
        self.mismatches = 0  # fetches that did not follow the recorded order
        # unlisted keys overwritten since set_order (fresh gradients): their later fetches
        # are re-uses of what was just written, not departures from the order
        self._overwritten: set[str] = set()

    def set_order(self, entries: Sequence[tuple[str, Tier]]) -> None:
        self._entries = list(entries)
        self._positions = {}
        for i, (key, _tier) in enumerate(self._entries):
            self._positions.setdefault(key, []).append(i)
        self.cursor = 0
        self._overwritten.clear()

    def overwritten(self, key: str) -> None:
        """An unlisted ``key`` was fetched to be overwritten (nothing to read ahead)."""
        self._overwritten.add(key)

    @property
    def active(self) -> bool:
        return self.cursor < len(self._entries)

    def consume(self, key: str, tier: Tier) -> None:
        """Advance past ``key``'s next use; note a mismatch if it was not next.

        A key whose every use in the order is already behind the cursor, or an unlisted
        key overwritten since the order was set, is being used again (e.g. the optimizer
        reading a gradient shard the reduce just wrote): that does not depart from the
        order, so it neither counts nor moves the cursor."""
        if not self.active:
            return
        if self._entries[self.cursor] == (key, tier):
            self.cursor += 1
            return
        pos = self._next_index(key)
        positions = self._positions.get(key)
        if pos is None and ((positions and positions[0] < self.cursor)
                            or key in self._overwritten):
            return
        self.mismatches += 1
        if pos is not None:
            log.debug("fetch of %s/%s skipped %d entries of the recorded order",
                      key, tier, pos - self.cursor)
            self.cursor = pos + 1

    def lists(self, key: str) -> bool:
        """Whether the order given by set_order() uses ``key`` at all."""
        return key in self._positions

    def next_use(self, key: str) -> float:
        """Distance (in entries) to ``key``'s next use; inf when not upcoming."""
        pos = self._next_index(key)
        return math.inf if pos is None else float(pos - self.cursor)

    def _next_index(self, key: str) -> int | None:
        positions = self._positions.get(key)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor)
        return positions[i] if i < len(positions) else None

    def wanted(
        self, nbytes: Callable[[str], int], on_nvme: Callable[[str], bool]
    ) -> list[tuple[str, Tier]]:
        """Transfers that should be in flight now, nearest first, device copies first."""
        device: list[tuple[str, Tier]] = []
        host: list[tuple[str, Tier]] = []
        seen_dev: set[str] = set()
        seen_host: set[str] = set()
        dev_bytes = host_bytes = 0
        dev_open = host_open = True
        for key, tier in self._entries[self.cursor :]:
            size = nbytes(key)
            if dev_open and tier == "device" and key not in seen_dev:
                if dev_bytes + size > self.settings.device_bytes:
                    dev_open = False
                else:
                    dev_bytes += size
                    seen_dev.add(key)
                    device.append((key, "device"))
            if host_open and on_nvme(key) and key not in seen_host:
                if host_bytes + size > self.settings.nvme_bytes:
                    host_open = False
                else:
                    host_bytes += size
                    seen_host.add(key)
                    host.append((key, "host"))
            if not (dev_open or host_open):
                break
        return device + host
