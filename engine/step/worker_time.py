"""The optimizer's worker thread beside compute: the kernel threads it takes while backward
runs, and how much of its time ran hidden under compute (measured, not assumed).

Used by the in-place CPU Adam (engine/step/in_place.py), whose worker updates groups during
backward and, with clipping or fp16, during the next forward.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch


def threads_during_backward(threads: int) -> int:
    """Kernel threads for a group updated while backward runs: the rank's CPUs (`threads`)
    less those torch's intra-op pool computes backward on, at least one.

    Why: backward and the worker run at the same time; kernel threads beyond the cores
    backward leaves idle slow backward down by more than they speed the kernel up (both
    are memory-bound loops). Once backward is over (`finish()`) the kernel takes all of
    `threads` again (benchmarks/RESULTS.md, "Measurements behind design choices")."""
    return max(1, min(threads, threads - torch.get_num_threads()))


class OverlapClock:
    """How much of the optimizer worker's time ran hidden under compute, measured.

    The worker records each interval it runs optimizer work (a group's update or
    measurement); the training thread records each interval it blocks on the worker
    (finish, settle, a deferred group before its gather, drain). Worker seconds that
    fall inside no such wait ran while the training thread did something else
    (forward, backward, data): hidden. The rest were waited for: exposed. The split is
    the intersection of the two sets of intervals, not an assumption about which phase
    the worker ran in.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._busy: list[tuple[float, float]] = []  # closed worker intervals, not counted yet
        self._waits: list[tuple[float, float]] = []  # closed waits that may still overlap
        self._running: float | None = None  # start of the worker interval in progress
        self._depth = 0  # nested waits count once
        self._wait_t0 = 0.0
        self.busy_s = 0.0  # worker seconds counted so far (cumulative)
        self.waited_busy_s = 0.0  # of those, seconds the training thread waited through

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around optimizer work on the worker thread."""
        t0 = self._now()
        with self._lock:
            self._running = t0
        try:
            yield
        finally:
            t1 = self._now()
            with self._lock:
                self._running = None
                self._busy.append((t0, t1))

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around the training thread blocking on the worker."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._wait_t0 = self._now()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._waits.append((self._wait_t0, self._now()))

    def totals(self) -> tuple[float, float]:
        """(worker seconds, of which hidden under compute), cumulative over the closed
        worker intervals; one still running is counted once it ends."""
        with self._lock:
            busy, self._busy = self._busy, []
            waits = list(self._waits)
            if self._depth:  # a wait in progress (another thread asks) counts up to now
                waits.append((self._wait_t0, self._now()))
            for b0, b1 in busy:
                self.busy_s += b1 - b0
                self.waited_busy_s += sum(max(0.0, min(b1, w1) - max(b0, w0))
                                          for w0, w1 in waits if w1 > b0 and w0 < b1)
            # a wait can still overlap the interval running now, never an earlier one
            keep_from = self._running
            self._waits = ([] if keep_from is None
                           else [w for w in self._waits if w[1] > keep_from])
            return self.busy_s, self.busy_s - self.waited_busy_s
