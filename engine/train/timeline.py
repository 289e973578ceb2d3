"""The trace window of `tierzero train --trace`.

Events come from where the work happens, through the tracing seam swap.trace
([Note: trace event kinds] in swap/trace.py): the scheduler (gather, release,
reduce, per-unit compute), the CPU Adam (adam), the tier manager's threads
(copy, prefetch, evict, writeback, stall) and the swap I/O threads (nvme_read,
nvme_write); the recorder samples the CPU's use every CPU_INTERVAL_S (cpu counters).
`TraceWindow` turns a recorder on for the traced steps only and adds one "step" span
per step; the training loop adds forward, backward and
optimizer. Every event of the file lies inside one of the step spans: the
window's times are taken outside the recording (start before it starts, end
after it stops), and a span still running when recording stops is dropped.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from tierzero.swap import trace

CPU_INTERVAL_S = 0.1  # how often the trace samples the CPU (`cpu` counter events)


class TraceWindow:
    """Records steps first .. first + count - 1 (1-based) when a path is given."""

    def __init__(self, path: str | None, first: int, count: int, *, process: str) -> None:
        self.path = path
        self.first, self.last = first, first + count - 1
        # the CPU's track too: the cores the process ran on and those the hypervisor took
        self.recorder = (trace.Recorder(process=process, cpu_interval_s=CPU_INTERVAL_S)
                         if path else None)
        self._on = ExitStack()
        self._start_ns = 0
        self._end_ns = 0  # end of the previous traced step = start of the next

    def before(self, step: int) -> None:
        rec = self.recorder
        if rec is None or not self.first <= step <= self.last:
            return
        if step == self.first:
            self._start_ns = rec.now()
            self._on.enter_context(trace.recording(rec))
        else:
            self._start_ns = self._end_ns

    def after(self, step: int) -> None:
        rec = self.recorder
        if rec is None or not self.first <= step <= self.last:
            return
        if step == self.last:
            self._on.close()  # stop recording before the step's end is taken
        end = rec.now()
        rec.complete("step", f"step {step}", self._start_ns, end, args={"step": step})
        self._end_ns = end

    def close(self) -> None:
        self._on.close()

    @property
    def events(self) -> list[dict[str, Any]]:
        return [] if self.recorder is None else self.recorder.events

    def write(self) -> None:
        if self.recorder is not None and self.path:
            self.recorder.write(self.path)
