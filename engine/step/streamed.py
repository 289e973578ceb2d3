"""The CPU Adam step on optimizer state homed off the host: offload.AdamStream by group key.

`StreamedStep` is the `ShardUpdater` ([Note: shard updaters] in offload/shard_updater.py)
that OffloadedStep holds when the state is on NVMe (or placed by the planner): it builds
the one `AdamStream` of the run from the store's keys and pieces and speaks of group keys
where the stream speaks of shard positions. The stream updates on the caller's thread,
in a step order; with clipping or fp16 it measures gradients beside backward ([Note:
gradients measured where they are reduced]) and, with overlap_step, hands the update on
to a worker that runs it during the next forward (`defer`, DeferredStream in
step/deferred_stream.py: [Note: deferred streamed step]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.deferred_stream import DeferredStream
from tierzero.engine.step.measure import MeasureJobs
from tierzero.engine.step.precision import GradStat, grad_stat
from tierzero.offload import AdamHyper, AdamStream, AdamThreads, PipelineStats
from tierzero.offload.settings import STEP_CLASSES
from tierzero.offload.step_seam import DeferredWatch, GradMeasure

log = logging.getLogger(__name__)

# [Note: gradients measured where they are reduced]
# Clipping's global norm and fp16's overflow check need every gradient before the first
# update, so with state on NVMe the update runs after backward (with overlap_step, during
# the next forward: [Note: deferred streamed step]). Each group's GradStat is
# taken when its gradient shard turns final during backward (`measure`, called from the
# scheduler right after the reduction), on a worker thread while the training thread goes
# on with the next unit's backward (the deferred update's worker idles then, so on a
# two-core machine the norm takes the other core instead of the training thread's time).
# At most MEASURE_BACKLOG measurements are unfinished at once: the shard is measured soon
# after its reduction, while it is still in host memory (its home, or the cache the
# reduction just filled in the staging pool), so measuring it does not wait for the disk.
# Measured in step() instead, a gradient homed on NVMe that was written down under pool
# pressure meanwhile is read back for the norm and again by the update
# (benchmarks/RESULTS.md, run 3 of the 2.07B all-NVMe rows). The measurement is the same
# function on the same final bytes, summed in the same order by ZeroEngine._clip, so the
# norm and every update are bit for bit those of the measurement in step(); a group
# reduced again after its measurement (a late gradient) is measured again in
# `grad_stats`. An update run during backward (a speculated step, the early step) reads
# the gradient while the worker measures it: both only read it, and the stream waits for
# the measurement only before it lets the gradient go (AdamStream.grad_readers), so the
# training thread updates instead of waiting for the norm of the group it just reduced.
# A dry run (tierzero plan, on meta) measures on the training thread: its counted bytes
# must not depend on when a worker ran.
MEASURE_BACKLOG = 2

# group key -> its param shard where the engine holds a current copy of it, or None
# ([Note: a param held in host memory] in offload/shard_inputs.py)
HeldParam = Callable[[str], "torch.Tensor | None"]


class StreamedStep:
    """One AdamStream over every trainable group; see [Note: streamed optimizer step]."""

    # capabilities ([Note: shard updaters])
    measures = True
    defers = True
    has_order = True
    speculates = True  # where the layout allows: reserve_speculation

    def __init__(self, store: TieredShardStore, keys: Sequence[str], *, order: Sequence[str],
                 buffer_bytes: int, shadow: torch.dtype | None, threads: AdamThreads,
                 held: HeldParam | None = None) -> None:
        """order: the first step order (every key once); buffer_bytes: the host ring
        (StateLayout.ring_bytes()); shadow, threads: as InPlaceStep's; held: where the
        engine holds a group's param ([Note: a param held in host memory])."""
        manager = store.manager
        if manager is None:
            raise RuntimeError("StreamedStep needs a finalized TieredShardStore")
        self._store = store
        self._mgr = manager
        # [Note: gradients measured where they are reduced]; no worker on meta
        self._measured = MeasureJobs(self._measure_one, backlog=MEASURE_BACKLOG)
        self._measure_worker: ThreadPoolExecutor | None = None
        self._keys = list(keys)
        self._index = {k: i for i, k in enumerate(self._keys)}
        layout = store.layout  # keys and pieces, as the store keeps them
        # a bf16 master is the param itself ([Note: bf16 master weights]): no shadow
        bf16 = layout.master_precision == "bf16"
        self.stream = AdamStream(
            manager, [{n: layout.manager_key(k, n) for n in STEP_CLASSES} for k in self._keys],
            [layout.numel(k) for k in self._keys], order=self._indices(order),
            buffer_bytes=buffer_bytes,
            # master and moments in pieces of offload.optimizer.chunk_numel ([Note: optimizer
            # state in chunks] in offload/adam_stream.py): one list of pieces per group
            chunks=[layout.stream_pieces(k) for k in self._keys],
            shadow=None if bf16 else shadow, threads=threads,
            # zero_grad() follows every step: a consumed gradient is never read again
            # ([Note: gradient home] in engine/shards/tier_config.py)
            consume_grads=True, state=layout.state_precision,
            master=layout.master_precision,
            salts=[layout.master_salt(k) for k in self._keys] if bf16 else None)
        # the param writes a deferred update announces (expect_writes): no read-ahead of a
        # param about to be replaced; a bf16 master's update reads its own param first
        # (AdamStream reads it as the announced writer: TierManager.read_into replacing)
        announced = [layout.manager_key(k, "param") if layout.has(k, "param") else None
                     for k in self._keys]
        self._deferred = DeferredStream(self.stream, self._keys, announced, manager, threads,
                                        worker=store.device.type != "meta")
        # [Note: speculated step]: the keys its update writes, when every one is on NVMe
        writes = {key for k in self._keys for _, _, piece in layout.stream_pieces(k)
                  for key in piece.values()} | {a for a in announced if a is not None}
        self._spec_keys = (sorted(writes) if all(manager.home_of(k) == "nvme" for k in writes)
                           and store.device.type != "meta" else None)
        self._own_keep = self.stream.kept  # the construction's param caches (not the deferred's)
        # [Note: a param held in host memory]: offered to the stream while it updates on
        # this (the training) thread, where the engine's gathered copies are released;
        # never on the deferred worker, beside forward's gathers and releases. Not on a
        # dry run (its counted bytes stay the read's: an upper bound).
        self._source = (None if held is None or store.device.type == "meta"
                        else lambda index: held(self._keys[index]))
        self._grad_keys = [layout.manager_key(k, "grad") for k in self._keys]

    @property
    def _all(self) -> frozenset[int]:
        return frozenset(range(len(self._keys)))

    def _indices(self, keys: Sequence[str]) -> list[int]:
        return [self._index[k] for k in keys]

    # -- the step ---------------------------------------------------------------------------
    def run_all(self, hyper: AdamHyper, step: float, grad_scale: float) -> PipelineStats:
        self._deferred.drain()  # one thread drives the stream (the driver drained already)
        self._grads_zeroed()
        self._drive_here()
        return self.stream.step(hyper, step, grad_scale)

    def _grads_zeroed(self) -> None:
        """The stream reads gradients through the tier manager, past the store's use():
        the store writes the zeros of those zero_grad() marked first (a step with no
        backward since; [Note: gradients zeroed on first use] in shards/store.py)."""
        self._store.write_zeroed_grads(self._keys)

    def begin(self, hyper: AdamHyper, step: float) -> None:
        self._deferred.drain()
        self._drive_here()
        self.stream.begin(hyper, step)

    def groups_final(self, keys: Sequence[str]) -> None:
        """Updated now, on this thread, in step order as far as the final groups reach; a
        group measured beside its update is let go once measured ([Note: gradients
        measured where they are reduced])."""
        self.stream.mark_final(self._indices(keys))

    def _drive_here(self) -> None:
        """The stream runs on this (the training) thread until `defer` hands it on: it may
        copy the params the engine holds ([Note: a param held in host memory] in
        offload/shard_inputs.py) and waits for a group's measurement before it lets the
        group's gradient go."""
        self.stream.param_source = self._source
        self.stream.grad_readers = self._measured_one

    def _measured_one(self, index: int) -> None:
        self._measured.wait([self._keys[index]])

    def finish(self) -> PipelineStats:
        self._grads_zeroed()
        return self.stream.finish()

    def abort(self) -> int:
        return self.stream.abort()

    @property
    def order(self) -> list[str]:
        return [self._keys[i] for i in self.stream.order]

    def set_order(self, keys: Sequence[str]) -> bool:
        """A change drains the stream once (AdamStream.set_order)."""
        self._deferred.drain()
        return self.stream.set_order(self._indices(keys))

    def settle(self) -> None:
        """Nothing to wait for but a deferred update, which goes on (`drain` ends it)."""

    def flush(self) -> None:
        """A deferred update runs to its end, then every write lands."""
        self._deferred.drain()
        self.stream.flush()

    # -- the update during the next forward: [Note: deferred streamed step] ----------------
    def defer(self, hyper: AdamHyper, step: float, grad_scale: float,
              order: Sequence[str]) -> None:
        """Hand the update to the worker, in `order` (the next forward's)."""
        self._grads_zeroed()  # the worker reads gradients past the store's use()
        if self.stream.kept != self._all:  # each param is gathered right after its update
            self.stream.keep_params(self._all)
        # the worker's: no engine copies (forward gathers and releases them meanwhile); the
        # measurements were collected
        self.stream.param_source = None
        self.stream.grad_readers = None
        self._deferred.start(hyper, step, grad_scale, order)

    @property
    def deferred(self) -> bool:
        return self._deferred.pending

    def wait_groups(self, keys: Sequence[str]) -> PipelineStats | None:
        return self._deferred.wait_groups(keys)

    def drain(self) -> PipelineStats | None:
        return self._deferred.drain()

    def watch_deferred(self) -> DeferredWatch | None:
        return self._deferred.watch()

    # -- the update speculated into backward: [Note: speculated step] --------------------
    def reserve_speculation(self) -> bool:
        """Swap room for the regions a speculated step keeps (SpeculationSpaceError); False
        where a key the update writes is homed off NVMe (its home would need a copy) or on
        a dry run."""
        if self._spec_keys is None:
            return False
        self._mgr.reserve_speculation(self._spec_keys)
        return True

    def begin_speculation(self, hyper: AdamHyper, step: float, grad_scale: float, *,
                          order: Sequence[str]) -> None:
        """Backward starts a step whose update runs as gradients turn final, undoably, in
        `order` (backward's: a deferred update left the next forward's)."""
        if self._spec_keys is None:
            raise RuntimeError("StreamedStep: this layout cannot speculate its update")
        self._deferred.drain()
        self.stream.set_order(self._indices(order))  # a change drains the stream once
        self._mgr.speculate(self._spec_keys)
        self.stream.grads_used = "write"  # each is needed again if the step is undone
        self.stream.keep_params(self._own_keep)  # the next forward is not the update's
        self._drive_here()
        self.stream.begin(hyper, step, grad_scale)
        self.begin_measure()

    def commit_speculation(self) -> PipelineStats:
        """The speculated update stands: the groups not updated yet are updated now (same
        factor), the kept regions are released and the gradients dropped unread."""
        self.stream.grads_used = "discard"  # decided: the rest are consumed as they are used
        stats = self.finish()
        self._mgr.commit_speculation()  # the commit point: nothing after it raises
        for key in self._grad_keys:  # consumed, as the update drops each ([Note: gradient home])
            self._discard_committed(key)
        return stats

    def _discard_committed(self, key: str) -> None:
        """Drop a consumed gradient once the step stands. A manager call raises a failed
        transfer it settles, whichever key's: here that is logged, not raised, as the step
        is committed; nothing is lost unsaid ([Note: a lost write] in offload/core.py: a
        failed write-down stays dirty and is written again, a lost write is refused
        wherever its shard is read)."""
        for _ in range(2):  # a settled failure is raised once: the second call discards
            try:
                self._mgr.discard(key)
                return
            except Exception as exc:
                log.warning("after the speculated optimizer step committed: %s", exc)

    def undo_speculation(self) -> int:
        """Every group back to its state before the speculated update (the writes in flight
        land first); the gradients stay for the exact update. Returns the groups that had
        been updated."""
        done = self.stream.abort()
        self.stream.grads_used = "discard"
        self._mgr.undo_speculation()
        return done

    # -- clipping / fp16: [Note: gradients measured where they are reduced] ----------------
    def begin_measure(self) -> None:
        """Backward begins on a boundary whose step needs every gradient first."""
        self.forget_measured()
        if self._measure_worker is None and self._store.device.type != "meta":
            self._measure_worker = ThreadPoolExecutor(1, thread_name_prefix="tierzero-measure")
            self._measured.worker = self._measure_worker

    def measure(self, keys: Sequence[str]) -> None:
        """These groups' gradient shards are final: measured on the worker."""
        self._measured.submit(keys)

    def _measure_one(self, key: str) -> GradStat:
        return grad_stat(self._store, key)

    def forget_measured(self) -> None:
        """Drop every measurement (the gradients changed since): waits for those running."""
        self._measured.forget()

    def grad_stats(self, redo: set[str]) -> Mapping[str, GradMeasure]:
        """Every group's GradStat, in group order: the one taken during backward, else
        (never final during backward, or in `redo`: reduced again since) measured here.
        Consumes the measurements."""
        return self._measured.collect(self._keys, redo)

    def worker_times(self) -> tuple[float, float]:
        """The deferred update's worker: (seconds, of which hidden under compute)."""
        return self._deferred.clock.totals()

    def close(self) -> None:
        try:
            self._deferred.close()
        finally:
            try:
                if self._measure_worker is not None:
                    self._measured.forget()
                    self._measure_worker.shutdown(wait=True)
                    self._measure_worker = None
            finally:
                self.stream.close()
