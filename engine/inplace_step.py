"""The CPU Adam step on optimizer state homed in host memory: in place, begun during backward.

[Note: in-place early step]
With master, moments and gradient shards in host memory (offload.optimizer.device
= cpu) the kernel updates each group where it lives ("master", "exp_avg",
"exp_avg_sq" and the compute-dtype "param16" written in the same pass), group by
group. `run_all()` does that for every group after backward. The step can also
begin while backward runs (offload.optimizer.overlap_step, see EarlyStep in
offload_step.py):

    backward (compute thread)   ... unit 5 | reduce 5 | unit 4 | reduce 4 | ...
    worker thread                          | adam 5 ...........| adam 4 ....
    step()                      wait for the worker, then the groups never handed over

`begin()` takes the hyper-parameters; `submit(keys)` hands the groups of a unit whose
gradient shards are final (Scheduler.on_final) to one worker thread, which runs the
same kernel on them in submission order; `finish()` waits for the worker, raises its
failure (naming the group), and updates on the caller's thread whatever was not handed
over. The kernel is elementwise, so which thread updates a group, and when, changes no
bit of the result.

Who else touches a group between its reduce and `finish()`, and why it is safe:
- backward itself: a unit's gradient shard is final once reduced and handed over (a
  group that may get late gradients, reduced again at the end of backward, is never
  handed over: [Note: late gradients]) and its param16 is not gathered again this
  pass; a persistent
  unit's gathered copy is its own buffer (the tiered store always copies out of the
  shard), gathered again by Scheduler.after_step once the step is done and the worker
  settled ([Note: persistent units after the step] in schedule.py);
- every shard access goes through TierManager, which takes one lock per call;
- forward, zero_grad and close (engine.py) call `settle()` first, which waits for the
  worker, so nobody reads a group the kernel is writing; checkpoints are refused while
  the step is open (ZeroEngine._check_checkpointable).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tierzero.engine.offload_bridge import TieredShardStore
from tierzero.offload import AdamHyper, AdamThreads, PipelineStats, adam_update
from tierzero.swap import trace

log = logging.getLogger(__name__)


def threads_during_backward(threads: int) -> int:
    """Kernel threads for a group updated while backward runs: the rank's CPUs (`threads`)
    less those torch's intra-op pool computes backward on, at least one.

    Why: backward and the worker run at the same time; kernel threads beyond the cores
    backward leaves idle slow backward down by more than they speed the kernel up (both
    are memory-bound loops). Once backward is over (`finish()`) the kernel takes all of
    `threads` again. Measured on the 2-core dev VM with torch at 1 thread (step_bench, hf
    cpu): 1 kernel thread during backward beat 2 (see benchmarks/RESULTS.md)."""
    return max(1, min(threads, threads - torch.get_num_threads()))


class InPlaceStep:
    """Adam in place over host-homed groups; see [Note: in-place early step]."""

    def __init__(self, store: TieredShardStore, keys: Sequence[str], *,
                 shadow: torch.dtype | None, threads: AdamThreads) -> None:
        """shadow: the compute dtype when it is bf16/fp16 (param16 is written as the kernel's
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

    # -- the whole step after backward -------------------------------------------------
    def run_all(self, hyper: AdamHyper, step: float, grad_scale: float) -> PipelineStats:
        t0 = time.perf_counter()
        compute = sum(self.update(k, hyper, step, grad_scale, self._threads)
                      for k in self._keys)
        return PipelineStats(len(self._keys), time.perf_counter() - t0, compute, 0.0, 0.0, 0)

    def update(self, key: str, hyper: AdamHyper, step: float, grad_scale: float,
               threads: AdamThreads | None) -> float:
        """One group in place: master and moments where they live; param16 in host memory
        written as the kernel's shadow, on the device copied from the master after.
        Returns the kernel's seconds."""
        store = self._store
        with contextlib.ExitStack() as held:
            master, exp_avg, exp_avg_sq = (
                held.enter_context(store.use(key, kind, writable=True))
                for kind in ("master", "exp_avg", "exp_avg_sq"))
            grad = held.enter_context(store.use(key, "grad"))
            p16 = held.enter_context(store.use(key, "param16", writable=True, compute=False))
            shadow = p16 if self._shadow is not None and p16.device.type == "cpu" else None
            t = time.perf_counter()
            with trace.span("adam", key, numel=master.numel()):
                adam_update(master, exp_avg, exp_avg_sq, grad, hyper=hyper, step=step,
                            grad_scale=grad_scale, shadow=shadow, threads=threads)
            seconds = time.perf_counter() - t
            if shadow is None:
                p16.copy_(master)  # rounds to the compute dtype; host->device on CUDA
        return seconds

    # -- a step begun during backward ----------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._open is not None

    def begin(self, hyper: AdamHyper, step: float) -> None:
        if self._closed:
            raise RuntimeError("InPlaceStep.begin() after close()")
        if self._open is not None:
            raise RuntimeError("InPlaceStep.begin() while a step is open; finish() or "
                               "abort() it first")
        if self._worker is None:
            # One thread runs the groups backward finalises, beside the compute thread.
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tierzero-adam-early")
        during = threads_during_backward(self._threads.threads)
        if during == self._threads.threads:
            self._during = self._threads
        elif during > 1 and (self._during is None or self._during.threads != during):
            self._close_during()
            self._during = AdamThreads(during)
        elif during == 1:
            self._close_during()
        self._open = (hyper, step, time.perf_counter())
        self._submitted.clear()
        self._done.clear()
        self._jobs.clear()
        self._failure = None
        self._finishing = False

    def submit(self, keys: Sequence[str]) -> None:
        """These groups' gradients are final: the worker updates them, in this order."""
        if self._open is None or self._worker is None:
            raise RuntimeError("InPlaceStep.submit() without begin()")
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
                threads = self._threads if self._finishing else self._during
            try:
                compute += self.update(key, hyper, step, 1.0, threads)
            except BaseException as exc:
                err = RuntimeError(f"the optimizer step begun during backward failed on "
                                   f"shard group {key!r}: {exc}")
                err.__cause__ = exc
                with self._lock:
                    self._failure = err
                return compute
            with self._lock:
                self._done.add(key)
        return compute

    def settle(self) -> None:
        """Wait until the worker has run every group handed to it so far."""
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
            if self._open is not None:
                done = self.abort()
                log.warning("closed with an optimizer step open: %d of %d groups had been "
                            "updated", done, len(self._keys))
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self._close_during()
