"""The tracing seam: a process-wide, optional recorder of Chrome / Perfetto trace events.

Lowest package, so swap/, offload/ and engine/ all record through it (imports
point down). Off by default: every call site does one attribute check and
gets back a shared no-op context manager, so nothing is allocated, timed or
stored. `tierzero train --trace FILE` turns a `Recorder` on for the traced
steps (`recording(rec)`), then writes `rec.document()` as JSON.

    with trace.span("nvme_read", key, bytes=n):   # a span on the calling thread
        ...
    trace.begin("compute", name); ...; trace.end("compute", name)   # across calls
    trace.instant("prefetch", key, tier="device")                   # a decision

[Note: trace event kinds] Spans are "X" (complete) events; `cat` is the kind:
  step       one optimizer step, all micro-steps (training thread)
  forward    the engine's forward over the whole model
  backward   the whole backward, re-gathers and reductions included
  optimizer  the engine's optimizer step (clipping, Adam over every shard)
  gather     a unit's parameters fetched and all-gathered (forward or backward)
  release    a unit's gathered parameters freed
  compute    a unit's own forward, or its backward up to its gradient reduction
  reduce     a unit's gradients reduce-scattered into its fp32 shard
  adam       the CPU Adam on one shard (args: numel)
  nvme_read  one block read from a swap file (args: bytes); an I/O thread's lane
  nvme_write one block written to a swap file (args: bytes)
  copy       a tier copy: host->device, device->host (tier manager threads) or
             between the optimizer's buffers and the tier manager's views
  stall      a caller blocked on a transfer it needed (I/O not hidden)
and counter ("C") events, when the recorder samples the CPU (`cpu_interval_s`):
  cpu        from its `ts` to the next cpu event, the cores this process ran on
             (`process`: its CPU seconds, every thread, per second) and the cores the
             hypervisor took from the CPUs it may run on (`steal`: /proc/stat's steal
             column; absent where the kernel has none); the last event, zeros, marks
             where sampling stopped. Drawn as a track beside the lanes
and instant ("i") events, zero-length marks of a decision:
  prefetch   the tier manager started bringing a shard ahead of its use
  evict      a cache was chosen to be dropped (made room, or asked for)
  writeback  a dirty cache began its write one tier down
Every event carries `tid`: the thread it ran on, named in "M" metadata, so a
viewer draws the training thread, the swap I/O threads and the copy threads
as separate lanes and shows whether I/O runs under compute.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from tierzero.swap.safe_files import write_atomic

__all__ = ["INSTANT_KINDS", "KINDS", "SPAN_KINDS", "Recorder", "active", "begin", "end", "instant",
           "recording", "span", "steal_seconds", "steal_ticks"]

SPAN_KINDS = ("step", "forward", "backward", "optimizer", "gather", "release", "compute",
              "reduce", "adam", "nvme_read", "nvme_write", "copy", "stall")
INSTANT_KINDS = ("prefetch", "evict", "writeback")
KINDS = SPAN_KINDS + INSTANT_KINDS

_NULL: AbstractContextManager[None] = nullcontext()  # what span() returns when off


def steal_ticks(cpus: set[int], stat_text: str) -> int | None:
    """The steal column (the eighth number of a `cpuN` line of /proc/stat, clock ticks)
    summed over `cpus`; None when one of them has no line or no such column."""
    total, found = 0, 0
    for line in stat_text.splitlines():
        head, _, rest = line.partition(" ")
        if head.startswith("cpu") and head[3:].isdigit() and int(head[3:]) in cpus:
            cols = rest.split()
            if len(cols) < 8:
                return None
            total += int(cols[7])
            found += 1
    return total if found == len(cpus) else None


def steal_seconds(cpus: set[int]) -> float | None:
    """Seconds the hypervisor has taken from `cpus` since boot (steal_ticks of
    /proc/stat); None where it cannot be read or is not counted."""
    try:
        with open("/proc/stat") as f:
            ticks = steal_ticks(cpus, f.read())
    except OSError:
        return None
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


class _CpuSampler:
    """From start() to stop(): every `interval` seconds, the process's CPU seconds (all
    threads) and the steal of the CPUs it may run on, recorded as one `cpu` counter event
    for the interval just ended ([Note: trace event kinds]); stop() records the interval
    it cut short and a last event of zeros where sampling ends, so each value holds
    exactly over the interval it was measured in."""

    def __init__(self, rec: Recorder, interval: float) -> None:
        self._rec = rec
        self._interval = interval
        self._stop = threading.Event()
        self._cpus = os.sched_getaffinity(0)
        self._last: tuple[int, float, float | None] = (0, 0.0, None)
        self._thread = threading.Thread(target=self._run, name="tierzero-trace-cpu",
                                        daemon=True)

    def _read(self) -> tuple[int, float, float | None]:
        return self._rec.now(), time.process_time(), steal_seconds(self._cpus)

    def _sample(self) -> None:
        last, now = self._last, self._read()
        wall = (now[0] - last[0]) / 1e9
        if wall > 0:
            args = {"process": (now[1] - last[1]) / wall}
            if now[2] is not None and last[2] is not None:
                args["steal"] = (now[2] - last[2]) / wall
            self._rec.count("cpu", last[0], args)
        self._last = now

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def start(self) -> None:
        self._last = self._read()  # the first interval starts with the recording
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._rec.count("cpu", self._last[0], {"process": 0.0} if self._last[2] is None
                        else {"process": 0.0, "steal": 0.0})


@dataclass
class Recorder:
    """Trace events of this process; thread-safe. Times are microseconds since `origin`.
    `cpu_interval_s` > 0: while recording, a thread samples the process's CPU use and
    the hypervisor's steal that often (`cpu` counter events)."""

    process: str = "tierzero"
    cpu_interval_s: float = 0.0
    origin_ns: int = field(default_factory=time.perf_counter_ns)
    events: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: dict[int, tuple[int, str]] = field(default_factory=dict)  # ident -> (tid, name)
    # (cat, name) -> (start, args, thread ident) of spans opened by begin()
    _open: dict[tuple[str, str], tuple[int, dict[str, Any], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._tid()  # the thread that made the recorder (the training thread) is lane 0

    def now(self) -> int:
        return time.perf_counter_ns()

    def _tid(self, ident: int | None = None) -> int:
        """Small, stable lane numbers in order of first appearance; 0 is the first thread."""
        ident = threading.get_ident() if ident is None else ident
        lane = self._threads.get(ident)
        if lane is None:
            lane = (len(self._threads), threading.current_thread().name)
            self._threads[ident] = lane
        return lane[0]

    def complete(self, cat: str, name: str, start_ns: int, end_ns: int, *,
                 args: dict[str, Any] | None = None, ident: int | None = None) -> None:
        """A finished span on the calling thread (or on thread `ident`)."""
        event: dict[str, Any] = {"ph": "X", "cat": cat, "name": name, "pid": 0,
                                 "ts": (start_ns - self.origin_ns) / 1e3,
                                 "dur": max(0, end_ns - start_ns) / 1e3}
        if args:
            event["args"] = args
        with self._lock:
            event["tid"] = self._tid(ident)
            self.events.append(event)

    def mark(self, cat: str, name: str, args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"ph": "i", "s": "t", "cat": cat, "name": name, "pid": 0,
                                 "ts": (self.now() - self.origin_ns) / 1e3}
        if args:
            event["args"] = args
        with self._lock:
            event["tid"] = self._tid()
            self.events.append(event)

    def count(self, name: str, at_ns: int, values: dict[str, float]) -> None:
        """A counter's values from `at_ns` on (until its next event)."""
        event = {"ph": "C", "name": name, "pid": 0, "tid": 0,
                 "ts": (at_ns - self.origin_ns) / 1e3, "args": values}
        with self._lock:
            self.events.append(event)

    def open(self, cat: str, name: str, args: dict[str, Any]) -> None:
        """Start span (cat, name) on this thread; a second open of it restarts it."""
        with self._lock:
            self._open[(cat, name)] = (self.now(), args, threading.get_ident())

    def close(self, cat: str, name: str) -> None:
        """End span (cat, name), from any thread; drawn on the thread that opened it."""
        end_ns = self.now()
        with self._lock:
            started = self._open.pop((cat, name), None)
        if started is not None:
            self.complete(cat, name, started[0], end_ns, args=started[1], ident=started[2])

    def close_all(self) -> None:
        """End every span still open (a step ended with some begin() unmatched)."""
        with self._lock:
            pending = list(self._open.items())
            self._open.clear()
        end_ns = self.now()
        for (cat, name), (start, args, ident) in pending:
            self.complete(cat, name, start, end_ns, args=args, ident=ident)

    def kinds(self) -> set[str]:
        with self._lock:
            return {e["cat"] for e in self.events if "cat" in e}

    def document(self) -> dict[str, Any]:
        """The JSON object ui.perfetto.dev and chrome://tracing load."""
        with self._lock:
            meta: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0,
                                           "tid": 0, "args": {"name": self.process}}]
            meta += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                      "args": {"name": name}} for tid, name in self._threads.values()]
            meta += [{"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid,
                      "args": {"sort_index": tid}} for tid, _ in self._threads.values()]
            return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms"}

    def write(self, path: str, mode: int = 0o600) -> None:
        """Write the trace JSON to `path`, never through a planted link."""
        write_atomic(path, json.dumps(self.document()).encode(), mode)


class _State:
    """Holds the one active recorder. Process-wide on purpose: the threads that do I/O
    and copies are created deep below the code that decides to trace."""

    recorder: Recorder | None = None


_STATE = _State()


def active() -> Recorder | None:
    return _STATE.recorder


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Record into `recorder` inside the block (one recorder at a time)."""
    if _STATE.recorder is not None and _STATE.recorder is not recorder:
        raise RuntimeError("a trace recorder is already active in this process; "
                           "stop it before starting another")
    sampler = (_CpuSampler(recorder, recorder.cpu_interval_s)
               if recorder.cpu_interval_s > 0 else None)
    _STATE.recorder = recorder
    if sampler is not None:
        sampler.start()
    try:
        yield recorder
    finally:
        _STATE.recorder = None
        if sampler is not None:
            sampler.stop()
        recorder.close_all()


def span(cat: str, name: str, **args: Any) -> AbstractContextManager[None]:
    """A span on the calling thread; the shared no-op context when no recorder is on."""
    rec = _STATE.recorder
    if rec is None:
        return _NULL
    return _span(rec, cat, name, args)


@contextmanager
def _span(rec: Recorder, cat: str, name: str, args: dict[str, Any]) -> Iterator[None]:
    start = rec.now()
    try:
        yield
    finally:
        end_ns = rec.now()  # before the check: a span that passes it ended before the stop
        if _STATE.recorder is rec:  # stopped meanwhile: the event is outside the window
            rec.complete(cat, name, start, end_ns, args=args)


def begin(cat: str, name: str, **args: Any) -> None:
    """Open a span that `end(cat, name)` closes (e.g. across two hooks; any thread)."""
    rec = _STATE.recorder
    if rec is not None:
        rec.open(cat, name, args)


def end(cat: str, name: str) -> None:
    rec = _STATE.recorder
    if rec is not None:
        rec.close(cat, name)


def instant(cat: str, name: str, **args: Any) -> None:
    rec = _STATE.recorder
    if rec is not None:
        rec.mark(cat, name, args)
