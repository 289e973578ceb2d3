"""logging.wall_clock_breakdown: the engine's per-step wall-clock log (DeepSpeed's key).

With the key on, rank 0 logs every `logging.steps_per_print` optimizer steps one line
with the wall seconds of that step's phases, summed over its micro-steps: forward,
backward and step() as the caller saw them, the unit gathers inside forward and
backward (NVMe reads and copies included), forward's waits for a deferred optimizer
update ([Note: deferred step]), the optimizer worker's seconds hidden under compute,
and the time any thread stalled on a tier transfer. Off (the default) nothing is timed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "step")


class WallClock:
    def __init__(self, *, enabled: bool, every: int, rank: int,
                 counters: Callable[[], dict[str, float]]) -> None:
        """counters: cumulative seconds by name (gathers, deferred-update waits, ...),
        logged as their change over the step."""
        self.enabled = enabled
        self._every = max(1, every)
        self._rank = rank
        self._counters = counters
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._micro = 0
        self._steps = 0
        self._last = counters() if enabled else {}
        self.last_line: str | None = None  # the last line logged (for tests)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] += time.perf_counter() - t0
            self._micro += name == "forward"

    def step_done(self) -> None:
        """An optimizer step (boundary) ended: log its breakdown when it is due."""
        if not self.enabled:
            return
        self._steps += 1
        now = self._counters()
        if self._rank == 0 and self._steps % self._every == 0:
            parts = [f"{name} {1e3 * s:.1f}" for name, s in self._phases.items()]
            parts += [f"{name} {1e3 * (now[name] - self._last.get(name, 0.0)):.1f}"
                      for name in now]
            self.last_line = (f"wall clock, optimizer step {self._steps} (ms, "
                              f"{self._micro} micro-step(s)) | " + " | ".join(parts))
            log.info("%s", self.last_line)
        self._last = now
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._micro = 0
