"""A background save taken while the step's optimizer update is still deferred.

[Note: saving a deferred step]
With clipping or fp16 and offload.optimizer.overlap_step, the CPU Adam runs step N's update
on a worker during the next forward: in place for state in host memory ([Note: deferred
step] in engine/step/in_place.py), streamed for state on NVMe ([Note: deferred streamed
step] in engine/step/deferred_stream.py). `save_checkpoint(background=True)` right after step()
must save the state after that update, yet waiting for it on the training thread would
hold the caller for work the next forward hides. So the save does not wait:

    calling thread   checks and collectives (tag, temp dir); `watch_deferred()`: the
                     groups whose update has not ended (DeferredWatch); the store's
                     snapshot opened with those groups' parts *awaiting* ([Note: shard
                     snapshots] in offload/snapshot.py), agreed over the ranks; each
                     group's end attached to `StoreSnapshot.landed`; returns
    worker (or the   update group g, then report its end: g's parts leave "awaiting" and
    training thread  are protected from here on like any other part (host-resident:
    taking g over)   copied before they next change; on NVMe: the region g's write
                     left, kept once that write has landed, [Note: shard snapshots])
    writer thread    take a part of g: waits until g's update has ended, then reads it

Why the checkpoint is the state after the step, bit for bit:
- until g's update ends nothing else writes g's master and moments: whatever does first
  waits for g (wait_groups: a forward's gather, GatheredParameters, load_pretrained) or
  for every group (drain: backward, step, load_checkpoint, close, module.state_dict()),
  and the end is reported before such a wait returns. Meanwhile the snapshot preserves
  nothing of g, so the update's own writes are not taken for "before" values;
- from its end on, g is an ordinary snapshot key: the next write of it (the next step's
  update) copies the saved bytes out first;
- everything else the checkpoint holds (counters, lr schedule, the optimizer's step
  count, RNG states) was the step's already when step() returned.
A group whose update failed (or was skipped after another's failure), before the call or
during the save, makes the writer's read fail: the save fails on every rank (a synchronous
save would have raised the failure), and the failure is raised on the training thread at
its next wait as before; once raised there, the groups it left are saved as they are, as
a synchronous save would. When the ranks fall back to a synchronous save (no swap room
for the snapshot), or a part of a watched group would be copied at the call (none is,
for state in host memory or on NVMe), the update is waited for on the calling thread first and
that wait is `SaveStats.settle_s`. Also a module.state_dict() call would wait (its engine
hook drains), so the save finds the persistent buffers without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierzero.engine.checkpoint.layout import CheckpointError, GroupLayout

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine
    from tierzero.engine.shards.snapshot import StoreSnapshot
    from tierzero.offload.step_seam import DeferredWatch


@dataclass
class DeferredCapture:
    """The groups a background save reads once their deferred update has ended."""

    watch: DeferredWatch | None  # None: nothing awaited (no update pending, or waited for)
    parts: dict[str, list[str]] = field(default_factory=dict)  # group -> its snapshot parts
    settle_s: float = 0.0  # the caller's thread waiting for the update instead

    @property
    def awaiting(self) -> list[str]:
        """Every awaited snapshot part (the store's keys)."""
        return [key for keys in self.parts.values() for key in keys]

    def settle(self, eng: ZeroEngine) -> None:
        """Wait for the deferred update on the calling thread (a synchronous save reads
        every shard at once); nothing is awaited afterwards."""
        if self.watch is None:
            return
        start = time.perf_counter()
        eng.step_driver.settle()
        self.settle_s += time.perf_counter() - start
        self.watch, self.parts = None, {}

    def attach(self, snapshot: StoreSnapshot | None) -> None:
        """Each watched group's end releases its parts in `snapshot` to the writer."""
        if self.watch is None:
            return
        if snapshot is None:
            raise CheckpointError("internal: parts await a deferred update, but the save "
                                  "opened no snapshot")
        parts = self.parts

        def landed(group: str, error: str | None) -> None:
            # on the thread that ran the update: a failure here fails the save, not the step
            keys = parts.get(group, [])
            try:
                snapshot.landed(keys, error)
            except Exception as exc:
                snapshot.landed(keys, f"capturing it for the checkpoint failed: {exc}")

        self.watch.attach(landed)


def capture_deferred(eng: ZeroEngine, layouts: list[GroupLayout]) -> DeferredCapture:
    """The trainable groups whose deferred update has not ended, and their parts in the
    store's snapshot ([Note: saving a deferred step]); waits for the update instead when
    a watched group has a shard the save would copy at the call."""
    capture = DeferredCapture(eng.step_driver.watch_deferred())
    watch = capture.watch
    if watch is None:
        return capture
    for lay in layouts:
        if lay.key not in watch.keys:
            continue
        found = [eng.store.snapshot_parts(lay.key, kind)  # type: ignore[arg-type]
                 for kind in lay.kinds]
        if any(parts is None for parts in found):  # read now: the update must have run
            capture.settle(eng)
            return capture
        capture.parts[lay.key] = [part[0] for parts in found if parts for part in parts]
    return capture
