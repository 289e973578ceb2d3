"""A background checkpoint's view of the shard store: shards as they were at the save.

[Note: snapshot parts] `ShardStore.snapshot_parts(key, kind)` says where a background
checkpoint reads a shard later: the tier manager's keys (with element count and dtype)
whose bytes, in order, are the shard as the checkpoint stores it (a master or moment kept
in pieces: every piece; a compressed moment: its stored bytes), or None when the shard
is copied at the save instead (the plain store's resident shards, device-pinned optimizer
state: those live within device memory, and a copy is what a resident snapshot costs).
`ShardStore.open_snapshot(keys, copy_limit)` then records all of them at once
([Note: shard snapshots] in offload/snapshot.py), and the checkpoint's writer takes each
part once, in file order, into a host buffer of one part (`take`), while training goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierzero.offload import TierManager
from tierzero.offload.snapshot import ShardSnapshot

Part = tuple[str, int, torch.dtype]  # (manager key, elements, dtype)
READ_PURPOSE = "checkpoint_read"  # memory_report().outside key of the writer's part buffer


@dataclass(eq=False)
class StoreSnapshot:
    """An open snapshot of a tiered store's shards; `close()` releases what is left."""

    manager: TierManager
    snap: ShardSnapshot

    def take(self, part: Part) -> torch.Tensor:
        """The part's bytes at the save, in a host buffer of the manager's (aligned: an NVMe
        region is read straight into it); hand it back with `free()`."""
        key, numel, dtype = part
        buf = self.manager.host_empty(numel, dtype, purpose=READ_PURPOSE)
        try:
            self.manager.snapshot_take(self.snap, key, buf)
        except BaseException:
            self.manager.host_free(buf)
            raise
        return buf

    def free(self, buf: torch.Tensor) -> None:
        self.manager.host_free(buf)

    def landed(self, keys: list[str], error: str | None) -> None:
        """The update these awaiting parts waited for has ended (`error`: it failed)."""
        self.manager.snapshot_landed(self.snap, keys, error)

    def close(self) -> None:
        self.manager.snapshot_close(self.snap)

    @property
    def await_s(self) -> float:
        """Seconds `take` waited so far for awaited updates to land ([Note: shard
        snapshots] in offload/snapshot.py)."""
        return self.snap.await_s

    @property
    def kept_bytes(self) -> int:
        """NVMe bytes kept (regions the training may replace while the save runs)."""
        return self.snap.kept_bytes

    def stats(self) -> dict[str, float]:
        """What the snapshot cost the training so far: copies of host/device-homed shards
        taken before they changed, writers that waited for the save, their wait; the
        reader's wait for awaited updates to end (not the training's)."""
        s = self.snap
        return {"copies": s.copies_made, "copy_waits": s.copy_waits, "wait_s": s.wait_s,
                "kept_bytes": s.kept_total, "await_s": s.await_s}
