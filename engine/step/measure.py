"""Gradient measurements taken on a worker thread while backward goes on.

Clipping's global norm and fp16's overflow check need a GradStat of every gradient shard
before the first update. Each shard is measured when it turns final during backward; both
shard updaters ([Note: shard updaters] in offload/shard_updater.py) hand that work to a
worker thread, so the training thread goes on to the next unit's backward. `MeasureJobs`
keeps those jobs by group key and collects them at the step: a job the worker has not
started is taken back and measured on the caller's thread (it would only wait for it),
in the fixed key order ZeroEngine._clip sums them in, so the norm is bit for bit the one
measured on the training thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierzero.engine.step.precision import GradStat


class MeasureJobs:
    """Measurements by group key, each a job on `worker` (set by the owner; None: each is
    taken when submitted, on the caller's thread).

    `measure_one(key)` takes one GradStat on the worker, `measure_here(key)` (default: the
    same) on the caller's thread, for a job taken back or never submitted; `waiting()`
    wraps each wait of the caller's thread (the owner's clock). `backlog` (>= 1): `submit`
    first waits for the oldest jobs until, with the new one, at most this many are
    unfinished, so a shard is measured
    soon after its reduction, while it is still in host memory ([Note: gradients measured
    where they are reduced] in step/streamed.py); None: no bound.
    """

    def __init__(self, measure_one: Callable[[str], GradStat], *,
                 measure_here: Callable[[str], GradStat] | None = None,
                 waiting: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
                 backlog: int | None = None) -> None:
        self._measure_one = measure_one
        self._measure_here = measure_here or measure_one
        self._waiting = waiting or contextlib.nullcontext
        self._backlog = backlog
        self._jobs: dict[str, Future[GradStat]] = {}
        self.worker: ThreadPoolExecutor | None = None

    def __contains__(self, key: str) -> bool:
        return key in self._jobs

    def submit(self, keys: Sequence[str]) -> None:
        """Measure these groups' final gradient shards on the worker (once per key until
        forgotten); with no worker, now, on the caller's thread."""
        for key in keys:
            if key in self._jobs:
                continue
            if self.worker is None:
                done: Future[GradStat] = Future()
                done.set_result(self._measure_here(key))
                self._jobs[key] = done
                continue
            if self._backlog is not None:  # with this one, at most `backlog` unfinished
                self._bound(self._backlog - 1)
            self._jobs[key] = self.worker.submit(self._measure_one, key)

    def _bound(self, most: int) -> None:
        """Wait until at most `most` jobs are unfinished (oldest first); a failed job's
        error is raised at the step (`collect`)."""
        running = [job for job in self._jobs.values() if not job.done()]
        with self._waiting():
            for job in running[:max(0, len(running) - most)]:
                with contextlib.suppress(Exception):
                    job.result()

    def wait(self, keys: Sequence[str]) -> None:
        """The measurements of `keys` (those submitted) have ended: their shards may change
        now (an update that consumes the gradient). A failure is raised at the step."""
        with self._waiting():
            for key in keys:
                job = self._jobs.get(key)
                if job is not None and not job.cancelled():
                    job.exception()

    def forget(self) -> None:
        """Drop every measurement (the gradients changed since): waits for those running."""
        with self._waiting():
            for job in self._jobs.values():
                if not job.cancelled():  # taken back by collect
                    job.exception()
        self._jobs.clear()

    def collect(self, keys: Sequence[str], redo: set[str]) -> dict[str, GradStat]:
        """Every key's GradStat, in `keys` order: the worker's, else (never submitted, or in
        `redo`: reduced again after it was measured) measured here. Consumes the jobs."""
        out: dict[str, GradStat] = {}
        try:
            # jobs the worker has not started are taken back from the back of its queue
            # (it works from the front): the caller would only wait for them
            for key in reversed(keys):
                job = self._jobs.get(key)
                if job is not None and key not in redo and job.cancel():
                    out[key] = self._measure_here(key)
            for key in keys:
                if key in out:
                    continue
                job = self._jobs.get(key)
                if job is None or key in redo:
                    out[key] = self._measure_here(key)
                    continue
                try:
                    with self._waiting():
                        out[key] = job.result()
                except Exception as exc:
                    raise RuntimeError(f"measuring the gradient of shard group {key!r} "
                                       f"during backward failed: {exc}") from exc
        finally:
            self.forget()
        return {key: out[key] for key in keys}

