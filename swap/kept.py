"""Regions kept from release: the swap store's half of a snapshot.

[Note: kept regions] Writes are copy-on-write (swap/store.py): a new region is
filled, then the key points at it and the old region is freed. A snapshot of
a key (`SwapStore.keep`) holds its committed region: when a later write or a
delete replaces it, the region is *retired* instead of freed, stays readable
through `SwapStore.read_kept`, and is freed when its last hold is released
(`SwapStore.release_kept`). `SwapStore.restore` points the key back at a kept
region and frees the region the key had moved to (an undone optimizer update:
[Note: speculated shards] in offload/speculation.py). Space the snapshot needs
is bounded by the bytes it keeps, and freed regions are reused, so repeated
snapshots do not grow the file beyond the state plus one snapshot's regions
(`reserve_free`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.swap.request import Entry

__all__ = ["KeptRegion", "KeptRegions"]


@dataclass(frozen=True)
class KeptRegion:
    """One key's committed region at `SwapStore.keep` time; readable until released."""

    key: str
    entry: Entry

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


class KeptRegions:
    """Hold counts per region offset and the retired regions among them (under the
    store's lock). A region's offset is unique while the region exists: a held region
    is never freed, so its offset cannot be handed out again until it is."""

    def __init__(self) -> None:
        self._holds: dict[int, int] = {}  # region offset -> holds
        self._retired: dict[int, int] = {}  # held regions their key no longer points at -> bytes

    def hold(self, entry: Entry) -> None:
        self._holds[entry.offset] = self._holds.get(entry.offset, 0) + 1

    def held(self, entry: Entry) -> bool:
        return entry.offset in self._holds

    def retire(self, entry: Entry) -> bool:
        """The key moved off `entry` (replaced or deleted): True when it may be freed now."""
        if entry.offset in self._holds:
            self._retired[entry.offset] = entry.region_bytes
            return False
        return True

    def unhold(self, entry: Entry) -> bool:
        """One hold released: True when the region is retired and unheld (free it now)."""
        left = self._holds.get(entry.offset, 0) - 1
        if left < 0:
            raise ValueError(f"region at offset {entry.offset} released more than kept")
        if left:
            self._holds[entry.offset] = left
            return False
        del self._holds[entry.offset]
        return self._retired.pop(entry.offset, None) is not None

    def reinstate(self, entry: Entry) -> None:
        """The key points at `entry` again (SwapStore.restore): no longer retired; one hold
        released (the restorer's)."""
        self._retired.pop(entry.offset, None)
        left = self._holds.get(entry.offset, 0) - 1
        if left < 0:
            raise ValueError(f"region at offset {entry.offset} restored but not kept")
        if left:
            self._holds[entry.offset] = left
        else:
            del self._holds[entry.offset]

    @property
    def regions(self) -> int:
        return len(self._holds)

    @property
    def retired_bytes(self) -> int:
        """File bytes only a snapshot still needs (regions replaced since they were kept)."""
        return sum(self._retired.values())
