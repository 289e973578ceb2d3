"""The streamed CPU Adam's update of one step, run during the next forward on a worker.

[Note: deferred streamed step]
With optimizer state on NVMe, clipping or fp16, and offload.optimizer.overlap_step, the
update cannot start before step() knows the global norm and the overflow check, and run
in step() it holds the training thread for the whole stream (reads, kernel, writes). So
step() hands it on, as the in-place step does ([Note: deferred step] in
engine/step/in_place.py): `DeferredStream.start` opens the AdamStream's step with the
clipping and unscaling factor, in the order the next forward gathers the groups, and
one worker drives it group by group while forward computes:

    step()           start: the stream's order is the forward's; each group's param
                     write is announced (TierManager.expect_writes: no read-ahead of
                     the param that is about to be replaced)
    next forward     root | unit 0 | unit 1 | ...      (the scheduler waits for each
    worker           adam root | adam 0 | adam 1 | ...  unit's groups before its gather)

One thread drives the stream at a time (`_drive`): the worker, one group per turn, with
the kernel threads backward would leave free (threads_during_backward); or the training
thread when it waits for a group (`wait_groups`, `drain`): it claims the stream, the
worker stops after the group it is in, and the training thread runs the groups up to
the one it needs itself, with every kernel thread, in the same order. Either way each
group is one `mark_final` of the same stream in the same order with the same factor:
the bits are those of the update run in step().

Each group's new param is written as a host cache (AdamStream.keep_params, [Note: param
kept in host memory] in offload/stream_parts.py): its gather comes right after, and
finds it in host memory instead of waiting for the write and reading it back.

Ends: after a group's `mark_final` has returned, its writes are issued to the manager
(AdamStream._write issues every state and param write before returning), and its end is
reported (DeferredEnds: a background save keeps its swap regions once they land, [Note:
saving a deferred step] in engine/checkpoint/deferred.py) before anyone waiting for it
sees it done. A failure is kept, naming the group, and raised at the next wait; the
groups after it are reported not updated, and the stream's step is closed (every group
before it whole, it and the rest untouched, up to the piece in which the failure came:
a group in several pieces, [Note: optimizer state in chunks], writes piece by piece).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierzero.engine.step.worker_time import OverlapClock, threads_during_backward
from tierzero.offload import AdamHyper, AdamStream, AdamThreads, PipelineStats, TierManager
from tierzero.offload.step_seam import DeferredEnds, DeferredWatch

log = logging.getLogger(__name__)


class DeferredStream:
    """The deferred update of `stream`'s shards (group `keys[i]` is shard i, its param
    manager key `params[i]`); see [Note: deferred streamed step]."""

    def __init__(self, stream: AdamStream, keys: Sequence[str], params: Sequence[str | None],
                 manager: TierManager, threads: AdamThreads, *, worker: bool = True) -> None:
        """worker False (a dry run: [Note: plan from the engine]): no worker; the training
        thread runs each group when it waits for it, right before the group's gather, so
        the bytes counted do not depend on how far a worker ran ahead."""
        self._stream = stream
        self._use_worker = worker
        self._keys = list(keys)
        self._index = {k: i for i, k in enumerate(self._keys)}
        self._params = list(params)
        self._mgr = manager
        self._threads = threads
        self._during: AdamThreads | None = None  # kernel threads beside compute
        self._worker: ThreadPoolExecutor | None = None
        self._drive = threading.Lock()  # held by the one thread that drives the stream
        self._cond = threading.Condition()  # guards the fields below; notified on progress
        self._claims = 0  # training threads waiting to drive: the worker yields to them
        self._order: list[str] = []  # the pending update's groups, in update order
        self._pos: dict[str, int] = {}
        self._done = 0  # groups of _order ended (updated, failed or skipped)
        self._failure: BaseException | None = None
        self._job: Future[None] | None = None
        self._expected: list[str] = []  # param keys announced to the manager
        self._stats: PipelineStats | None = None
        self._closed = False
        self._ends = DeferredEnds()
        self.clock = OverlapClock()  # the worker's seconds, hidden under compute or waited for

    @property
    def pending(self) -> bool:
        """An update was started and not yet waited for to its end."""
        return bool(self._order)

    def start(self, hyper: AdamHyper, step: float, grad_scale: float,
              order: Sequence[str]) -> None:
        """Open the stream's step with `grad_scale` and hand every group to the worker in
        `order` (the next forward's; groups it leaves out follow in construction order)."""
        if self._closed:
            raise RuntimeError("DeferredStream.start() after close()")
        if self._order:
            raise RuntimeError("DeferredStream.start() while an update is pending")
        keys = list(dict.fromkeys([*[k for k in order if k in self._index], *self._keys]))
        self._stream.set_order([self._index[k] for k in keys])  # a change drains it once
        worker = self._start_worker() if self._use_worker else None
        self._expected = [p for k in keys if (p := self._params[self._index[k]]) is not None]
        self._mgr.expect_writes(self._expected)
        try:
            self._stream.begin(hyper, step, grad_scale, grads_final=True)  # after backward
        except BaseException:
            self._mgr.expect_writes(self._expected, False)
            raise
        with self._cond:
            self._order, self._done, self._failure = keys, 0, None
            self._pos = {k: i for i, k in enumerate(keys)}
        self._stats = None
        self._ends.begin(keys)
        if worker is not None:
            self._job = worker.submit(self._work)

    def _start_worker(self) -> ThreadPoolExecutor:
        if self._worker is None:
            # One thread drives the deferred update beside the next forward.
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tierzero-adam-deferred")
        during = threads_during_backward(self._threads.threads)
        if during == self._threads.threads:
            self._close_during()
            self._during = self._threads
        elif self._during is None or self._during.threads != during:
            self._close_during()
            self._during = AdamThreads(during)
        return self._worker

    def _work(self) -> None:
        """The worker: one group per turn, yielding the stream to a waiting training thread."""
        while True:
            with self._cond:
                while self._claims and self._done < len(self._order):
                    self._cond.wait()
                if self._done >= len(self._order):
                    return
            with self._drive:
                if self._done < len(self._order):
                    with self.clock.busy():
                        self._one(self._done, self._during or self._threads)

    def _one(self, pos: int, threads: AdamThreads) -> None:
        """(`_drive` held.) Update the group at `pos`; report its end (after its writes
        were issued) before it counts as done; keep a failure for the next wait."""
        key = self._order[pos]
        last = pos + 1 == len(self._order)
        self._stream.threads = threads
        try:
            self._stream.mark_final([self._index[key]])
        except BaseException as exc:
            self._fail(pos, exc)
            return
        param = self._params[self._index[key]]
        if param is not None:  # written by now (unless the shard is empty): readers go on
            self._mgr.expect_writes([param], False)
        self._ends.ended(key, None)
        if last:
            try:
                self._stats = self._stream.finish()  # and the next step's read-ahead
            except BaseException as exc:
                err = RuntimeError(f"the deferred optimizer update (state on NVMe) updated "
                                   f"every group and then failed: {exc}")
                err.__cause__ = exc
                with self._cond:
                    self._failure = err
        with self._cond:
            self._done = pos + 1
            self._cond.notify_all()

    def _fail(self, pos: int, exc: BaseException) -> None:
        key = self._order[pos]
        err = RuntimeError(f"the optimizer update deferred into the next forward (state on "
                           f"NVMe; gradient clipping / fp16 with overlap_step) failed on "
                           f"shard group {key!r}: {exc}; the groups after it in the update "
                           f"order were not updated in this step")
        err.__cause__ = exc
        self._mgr.expect_writes(self._expected, False)
        self._ends.ended(key, str(err))
        for rest in self._order[pos + 1:]:
            self._ends.ended(rest, f"not updated after an earlier failure: {err}")
        with self._cond:
            self._failure = err
            self._done = len(self._order)
            self._cond.notify_all()

    def watch(self) -> DeferredWatch | None:
        """A watch on the groups whose update has not ended (DeferredWatch)."""
        return self._ends.watch()

    def wait_groups(self, keys: Sequence[str]) -> PipelineStats | None:
        """These groups' updates have run: the training thread runs those the worker has
        not reached itself. Returns the step's stats once every group's has (None before,
        or when nothing is pending); a failure is raised (once), naming its group."""
        if not self._order:
            return None
        target = max((self._pos[k] + 1 for k in keys if k in self._pos), default=0)
        with self.clock.waiting():
            if self._done < target:
                self._drive_to(target)
            if self._done < len(self._order) and self._failure is None:
                return None
            if self._job is not None:
                self._job.result()  # the worker has nothing left: it returns
        return self._end()

    def drain(self) -> PipelineStats | None:
        """Every group's update has run (see wait_groups)."""
        return self.wait_groups(self._order)

    def _drive_to(self, target: int) -> None:
        with self._cond:
            self._claims += 1
        try:
            with self._drive:
                while self._done < target and self._failure is None:
                    self._one(self._done, self._threads)
        finally:
            with self._cond:
                self._claims -= 1
                self._cond.notify_all()

    def _end(self) -> PipelineStats | None:
        """Every group has ended: the update is no longer pending; raise its failure."""
        with self._cond:
            failure, self._failure = self._failure, None
            self._order, self._pos, self._done, self._job = [], {}, 0, None
        if failure is not None:
            self._ends.raised()
            raise failure
        return self._stats

    def close(self) -> None:
        """Run a pending update to its end (a failure is logged) and stop the worker."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._order:
                try:
                    self.drain()
                except Exception as exc:
                    log.error("%s", exc)
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self._close_during()

    def _close_during(self) -> None:
        if self._during is not None and self._during is not self._threads:
            self._during.close()
        self._during = None
