"""The CPU Adam step on optimizer state homed in host memory: in place, begun during backward.

[Note: in-place early step]
With master, moments and gradient shards in host memory (offload.optimizer.device
= cpu) the kernel updates each group where it lives ("master", "exp_avg",
"exp_avg_sq" and the compute-dtype "param" written in the same pass), group by
group. `run_all()` does that for every group after backward. The step can also
begin while backward runs (offload.optimizer.overlap_step, see OffloadedStep in
step/offloaded.py):

    backward (compute thread)   ... unit 5 | reduce 5 | unit 4 | reduce 4 | ...
    worker thread                          | adam 5 ...........| adam 4 ....
    step()                      wait for the worker, then the groups never handed over

`begin()` takes the hyper-parameters; `groups_final(keys)` hands the groups of a unit
whose gradient shards are final (OffloadedStep.groups_final) to one worker thread, which
runs the same kernel on them in submission order; `finish()` waits for the worker, raises
its failure (naming the group), and updates on the caller's thread whatever was not
handed over. The kernel is elementwise, so which thread updates a group, and when, changes no
bit of the result.

Who else touches a group between its reduce and `finish()`, and why it is safe:
- backward itself: a unit's gradient shard is final once reduced and handed over (a
  group that may get late gradients, reduced again at the end of backward, is never
  handed over: [Note: late gradients]) and its param is not gathered again this
  pass; a persistent
  unit's gathered copy is its own buffer (the tiered store always copies out of the
  shard), gathered again by Scheduler.after_step once the step is done and the worker
  settled ([Note: persistent units after the step] in schedule.py);
- every shard access goes through TierManager, which takes one lock per call;
- forward, zero_grad and close (engine.py) call `settle()` first, which waits for the
  worker, so nobody reads a group the kernel is writing; checkpoints are refused while
  the step is open (ZeroEngine._check_checkpointable). (The deferred step below is
  waited for per unit instead: [Note: deferred step].)

[Note: deferred step]
Gradient clipping needs the global norm and fp16 loss scaling needs the overflow
check, both over every gradient, before any group may be updated. With
overlap_step on, the step keeps its exact semantics and still runs beside
compute, in two parts on the same worker:

    backward (compute)   unit 5 | reduce 5 | unit 4 | reduce 4 | ... | end
    worker               measure 5 (norm, finite) | measure 4 | ...
    step()               sum the norms in fixed order (+ the groups not measured),
                         all-reduce, overflow -> skip; else defer(grad_scale, order)
    next forward         root | unit 0 | unit 1 | ...
    worker               adam root | adam 0 | adam 1 | ...       (in forward order)

`measure()` computes each final group's GradStat (precision.grad_stat, the same
function step() uses otherwise, summed in the same order: bit for bit the same
norm); a group reduced again afterwards (a late gradient) is measured again in
step(). `defer()` hands every group to the worker in the next forward's order with
the clipping and unscaling factor; the scheduler waits for a unit's groups before it
gathers it (Scheduler.wait_updates), so no forward reads a shard before its update,
and the update of unit k runs while forward computes the units before it. Whoever
else reads or writes shards drains first (ZeroEngine: backward, step(),
save/load_checkpoint, close, module.state_dict(); load_pretrained and
GatheredParameters wait for their units): nothing observes a half-updated step. A
background save waits for nothing: it reads each group once its update has ended
(`watch_deferred`, [Note: saving a deferred step] in engine/checkpoint/deferred.py).
The lr and other hyper-parameters are those of step(), as without deferral.
A training thread that waits (for the measurements in step(), for a unit's update
before its gather) takes over the groups the worker has not started, from the back
of the queue, so a unit of several groups runs on both threads at once. The root
unit needs this most: it holds the embedding and the head, is measured last in
backward and updated first before forward, so its work cannot hide under compute.

The split of the worker's time into hidden and exposed that `tierzero train` logs
comes from OverlapClock (engine/step/worker_time.py): measured intervals, not the phase
a job was queued in.

State on NVMe (the streamed step, AdamStream) is deferred the same way: its gradients are
measured during backward on the training thread ([Note: gradients measured where they are
reduced] in step/streamed.py), and step() hands the stream to a worker that runs it in
the next forward's order, with the same per-unit waits, drains and watch ([Note:
deferred streamed step] in step/deferred_stream.py). There the stream is one pipeline
(read ahead, kernel, write behind), so a waiting training thread takes it over in order
instead of from the back. It hides at most the forward's share of compute (about a
third of forward + backward), but step() no longer holds the training thread for the
whole stream, and each param is gathered from the host cache its update just wrote
(benchmarks/RESULTS.md, "The streamed step deferred into the next forward").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tierzero.engine.shards.tiered import TieredShardStore
from tierzero.engine.step.group_update import update_group
from tierzero.engine.step.measure import MeasureJobs
from tierzero.engine.step.precision import GradStat, grad_stat
from tierzero.engine.step.worker_time import OverlapClock, threads_during_backward
from tierzero.offload import AdamHyper, AdamThreads, PipelineStats
from tierzero.offload.shard_updater import unsupported
from tierzero.offload.step_seam import DeferredEnds, DeferredWatch, TrainingStateError

log = logging.getLogger(__name__)


class InPlaceStep:
    """Adam in place over host-homed groups; see [Note: in-place early step]. A
    `ShardUpdater` ([Note: shard updaters] in offload/shard_updater.py) that measures and
    defers, with no step order of its own."""

    # capabilities ([Note: shard updaters])
    measures = True
    defers = True
    has_order = False  # construction order after backward, handed-over order during it
    speculates = False  # state in host memory would need a copy to undo its update

    def __init__(self, store: TieredShardStore, keys: Sequence[str], *,
                 shadow: torch.dtype | None, threads: AdamThreads) -> None:
        """shadow: the compute dtype when it is bf16/fp16 (param is written as the kernel's
        low-precision shadow), else None; threads: the rank's kernel threads."""
        self._store = store
        self._keys = list(keys)
        self._shadow = shadow
        self._threads = threads
        self._worker: ThreadPoolExecutor | None = None
        self._during: AdamThreads | None = None  # kernel threads while backward runs (>1)
        self._lock = threading.Lock()  # guards the fields the worker writes
        self._open: tuple[AdamHyper, float, float] | None = None  # hyper, step, t0
        self._submitted: set[str] = set()
        self._done: set[str] = set()
        self._jobs: list[Future[float]] = []
        self._failure: BaseException | None = None
        self._finishing = False  # backward is over: queued groups get every kernel thread
        self._closed = False
        # [Note: deferred step]: gradients measured on the worker during backward, the
        # update run on it during the next forward
        self._deferred: dict[str, Future[float]] = {}  # group -> its pending update
        self._deferred_t0 = 0.0
        self._deferred_args: tuple[AdamHyper, float, float] | None = None  # of defer()
        # from defer() until its last update ran: every update() is a deferred one (all
        # other work drains it first)
        self._in_deferred = False
        self._deferred_compute = 0.0  # kernel seconds of the deferred step so far
        self._deferred_failure: BaseException | None = None
        self._ends = DeferredEnds()  # groups whose deferred update ended; a save's watch
        self.clock = OverlapClock()  # the worker's seconds, hidden under compute or waited for
        self._measured = MeasureJobs(self._measure_one, measure_here=self._measure_here,
                                     waiting=self.clock.waiting)

    # -- the whole step after backward -------------------------------------------------
    def run_all(self, hyper: AdamHyper, step: float, grad_scale: float) -> PipelineStats:
        """Every group, in construction order, on the caller's thread."""
        t0 = time.perf_counter()
        compute = sum(self.update(k, hyper, step, grad_scale, self._threads)
                      for k in self._keys)
        return PipelineStats(len(self._keys), time.perf_counter() - t0, compute, 0.0, 0.0, 0)

    def update(self, key: str, hyper: AdamHyper, step: float, grad_scale: float,
               threads: AdamThreads | None) -> float:
        """One group in place (step/group_update.py); returns the kernel's seconds."""
        return update_group(self._store, key, hyper, step, grad_scale=grad_scale,
                            threads=threads, shadow=self._shadow, as_reduced=self._in_deferred)

    # -- a step begun during backward ----------------------------------------------------
    def begin(self, hyper: AdamHyper, step: float) -> None:
        if self._closed:
            raise RuntimeError("InPlaceStep.begin() after close()")
        if self._open is not None:
            raise RuntimeError("InPlaceStep.begin() while a step is open; finish() or "
                               "abort() it first")
        self._start_worker()
        self._open = (hyper, step, time.perf_counter())
        self._submitted.clear()
        self._done.clear()
        self._jobs.clear()
        self._failure = None
        self._finishing = False

    def _start_worker(self) -> ThreadPoolExecutor:
        """The worker thread; sets the kernel threads it may use beside compute."""
        if self._worker is None:
            # One thread runs the groups backward finalises (and, under clipping or fp16,
            # measures them and updates them during the next forward), beside compute.
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tierzero-adam-early")
        during = threads_during_backward(self._threads.threads)
        if during == self._threads.threads:
            self._during = self._threads
        elif during > 1 and (self._during is None or self._during.threads != during):
            self._close_during()
            self._during = AdamThreads(during)
        elif during == 1:
            self._close_during()
        return self._worker

    def groups_final(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final: the worker updates them, in this order."""
        if self._open is None or self._worker is None:
            raise RuntimeError("InPlaceStep.groups_final() without begin()")
        fresh = [k for k in keys if k not in self._submitted]
        if not fresh:
            return
        self._submitted.update(fresh)
        hyper, step, _ = self._open
        self._jobs.append(self._worker.submit(self._run, fresh, hyper, step))

    def _run(self, keys: list[str], hyper: AdamHyper, step: float) -> float:
        """On the worker: update `keys`; after a failure nothing more is updated. The
        failure is kept (chained, naming the group) for finish() / abort()."""
        compute = 0.0
        for key in keys:
            with self._lock:
                if self._failure is not None:
                    return compute
                beside = not self._finishing  # backward still runs beside it
                threads = self._during if beside else self._threads
            try:
                with self.clock.busy():
                    seconds = self.update(key, hyper, step, 1.0, threads)
            except BaseException as exc:
                err = RuntimeError(f"the optimizer step begun during backward failed on "
                                   f"shard group {key!r}: {exc}")
                err.__cause__ = exc
                with self._lock:
                    self._failure = err
                return compute
            compute += seconds
            with self._lock:
                self._done.add(key)
        return compute

    @property
    def order(self) -> list[str]:
        """Construction order: `run_all`'s (and `finish`'s for the groups not handed over)."""
        return list(self._keys)

    def set_order(self, keys: Sequence[str]) -> bool:
        """No step order to change (`has_order` False): False."""
        return False

    # -- [Note: speculated step]: not here (`speculates` False) ---------------------------
    def _no_speculation(self, call: str) -> TrainingStateError:
        return unsupported("InPlaceStep", call, "speculates",
                           "state in host memory runs the deferred update instead")

    def reserve_speculation(self) -> bool:
        raise self._no_speculation("reserve_speculation()")

    def begin_speculation(self, hyper: AdamHyper, step: float, grad_scale: float, *,
                          order: Sequence[str]) -> None:
        raise self._no_speculation("begin_speculation()")

    def commit_speculation(self) -> PipelineStats:
        raise self._no_speculation("commit_speculation()")

    def undo_speculation(self) -> int:
        raise self._no_speculation("undo_speculation()")

    def flush(self) -> None:
        """Nothing to wait for: every update writes its shards before it returns."""

    def worker_times(self) -> tuple[float, float]:
        """The worker's cumulative (seconds, of which hidden under compute): OverlapClock."""
        return self.clock.totals()

    def settle(self) -> None:
        """Wait until the worker has run every group handed to it so far."""
        with self.clock.waiting():
            for job in list(self._jobs):
                job.exception()  # _run keeps its failures; this only waits

    def finish(self) -> PipelineStats:
        """Wait for the worker, raise its failure, update the groups not handed over."""
        if self._open is None:
            raise RuntimeError("InPlaceStep.finish() without begin()")
        hyper, step, t0 = self._open
        with self._lock:
            self._finishing = True
        try:
            with self.clock.waiting():
                compute = sum(job.result() for job in self._jobs)
            if self._failure is not None:
                raise self._failure
            compute += sum(self.update(k, hyper, step, 1.0, self._threads)
                           for k in self._keys if k not in self._submitted)
        finally:
            self._open = None
            self._jobs.clear()
        return PipelineStats(len(self._keys), time.perf_counter() - t0, compute, 0.0, 0.0, 0)

    def abort(self) -> int:
        """Close an open step without updating the rest (its backward failed); returns how
        many groups were updated, each whole. A worker failure is logged."""
        if self._open is None:
            return 0
        try:
            self.settle()
            if self._failure is not None:
                log.error("%s", self._failure)
            return len(self._done)
        finally:
            self._open = None
            self._jobs.clear()

    # -- clipping / fp16: measured during backward, updated during the next forward ----
    def begin_measure(self) -> None:
        """Backward begins on a boundary whose step needs every gradient first: groups
        handed to `measure` get their GradStat on the worker while backward goes on."""
        if self._closed:
            raise RuntimeError("InPlaceStep.begin_measure() after close()")
        self._start_worker()
        self.forget_measured()

    def measure(self, keys: Sequence[str]) -> None:
        """These groups' gradient shards are final: measure them on the worker."""
        if self._worker is None:
            raise RuntimeError("InPlaceStep.measure() without begin_measure()")
        self._measured.worker = self._worker
        self._measured.submit(keys)

    def _measure_one(self, key: str) -> GradStat:
        with self.clock.busy():
            return grad_stat(self._store, key)

    def _measure_here(self, key: str) -> GradStat:
        return grad_stat(self._store, key)

    def forget_measured(self) -> None:
        """Drop every measurement (the gradients changed since): waits for those running."""
        self._measured.forget()

    def grad_stats(self, redo: set[str]) -> dict[str, GradStat]:
        """Every group's GradStat: the worker's, else (not handed over, or in `redo`:
        reduced again after it was measured) measured here. Consumes the measurements."""
        return self._measured.collect(self._keys, redo)

    @property
    def deferred(self) -> bool:
        """A deferred update is pending (or ran and was not yet waited for)."""
        return bool(self._deferred)

    def defer(self, hyper: AdamHyper, step: float, grad_scale: float,
              order: Sequence[str]) -> None:
        """Hand every group to the worker, in `order` (the next forward's), to be updated
        with `grad_scale` while the caller goes on; `wait_groups` before a group's values
        are used, `drain` before anything else reads or writes shards."""
        if self._closed:
            raise RuntimeError("InPlaceStep.defer() after close()")
        if self._deferred or self._open is not None:
            raise RuntimeError("InPlaceStep.defer() while an update is pending")
        worker = self._start_worker()
        keys = list(dict.fromkeys([*[k for k in order if k in self._keys], *self._keys]))
        self._deferred_t0 = time.perf_counter()
        self._deferred_args = (hyper, step, grad_scale)
        self._in_deferred = True
        self._deferred_compute = 0.0
        self._deferred_failure = None
        with self._lock:
            self._finishing = False
        self._ends.begin(keys)
        for key in keys:
            self._deferred[key] = worker.submit(self._run_deferred, key, hyper, step,
                                                grad_scale)

    def watch_deferred(self) -> DeferredWatch | None:
        """A watch on the groups whose deferred update has not ended (DeferredWatch)."""
        return self._ends.watch()

    def _run_deferred(self, key: str, hyper: AdamHyper, step: float,
                      grad_scale: float, *, on_worker: bool = True) -> float:
        """One group of the deferred step: on the worker, or (`on_worker` False) taken over
        by the training thread waiting for it (see wait_groups); skipped after a failure,
        which is kept (naming the group) for the next wait. Either way its end is reported
        (DeferredEnds) before this returns, so before any wait for the group is over."""
        with self._lock:
            failed = self._deferred_failure
            beside = not self._finishing  # nobody is waiting for the whole step yet
            # taken over: the worker may be running another group at the same time
            threads = self._during if beside or not on_worker else self._threads
        if failed is not None:
            self._ends.ended(key, f"not updated after an earlier failure: {failed}")
            return 0.0
        try:
            with self.clock.busy() if on_worker else contextlib.nullcontext():
                seconds = self.update(key, hyper, step, grad_scale, threads)
        except BaseException as exc:
            err = RuntimeError(f"the optimizer update deferred into the next forward "
                               f"(gradient clipping / fp16 with overlap_step) failed on "
                               f"shard group {key!r}: {exc}; the groups queued after it "
                               f"were not updated in this step (unless the training "
                               f"thread had taken them over already)")
            err.__cause__ = exc
            with self._lock:
                self._deferred_failure = err
            self._ends.ended(key, str(err))
            return 0.0
        with self._lock:
            self._deferred_compute += seconds
        self._ends.ended(key, None)
        return seconds

    def wait_groups(self, keys: Sequence[str]) -> PipelineStats | None:
        """Wait until these groups' deferred updates have run. Returns the step's stats
        once every group's has (None before, or when none was pending); a failure of
        the worker is raised (once), after everything queued has finished."""
        if not self._deferred:
            return None
        with self.clock.waiting():
            jobs = [(k, j) for k in keys if (j := self._deferred.pop(k, None)) is not None]
            # Groups the worker has not started are taken over from the back of the list
            # (the worker runs the queue from the front), so a unit of several groups
            # (the root: embedding and head) is updated by both threads at once; each
            # group whole by one of them, the same kernel: the same bits.
            for key, job in reversed(jobs):
                if self._deferred_args is not None and job.cancel():
                    self._run_deferred(key, *self._deferred_args, on_worker=False)
            for _, job in jobs:
                if not job.cancelled():
                    job.result()  # _run_deferred keeps its failures; this only waits
        if self._deferred_failure is not None:
            self._drain_jobs()
            err, self._deferred_failure = self._deferred_failure, None
            self._ends.raised()
            raise err
        if self._deferred:
            return None
        self._in_deferred = False
        return PipelineStats(len(self._keys), time.perf_counter() - self._deferred_t0,
                             self._deferred_compute, 0.0, 0.0, 0)

    def drain(self) -> PipelineStats | None:
        """Wait for every deferred update (the rest take all kernel threads)."""
        if not self._deferred:
            return None
        with self._lock:
            self._finishing = True
        return self.wait_groups(list(self._deferred))

    def _drain_jobs(self) -> None:
        with self.clock.waiting():
            for job in self._deferred.values():
                job.exception()
        self._deferred.clear()
        self._in_deferred = False

    def _close_during(self) -> None:
        if self._during is not None and self._during is not self._threads:
            self._during.close()
        self._during = None

    def close(self) -> None:
        """Wait for the worker and stop it (an open step is abandoned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.forget_measured()
            if self._deferred:
                self._drain_jobs()
                if self._deferred_failure is not None:
                    log.error("%s", self._deferred_failure)
            if self._open is not None:
                done = self.abort()
                log.warning("closed with an optimizer step open: %d of %d groups had been "
                            "updated", done, len(self._keys))
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self._close_during()
