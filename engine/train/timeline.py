"""Timeline of a training step as Chrome / Perfetto trace events, and the unit probes.

[Note: trace event kinds] Spans are Chrome "X" (complete) events, `cat` = the
kind, `name` = the unit or phase, `ts`/`dur` in microseconds since the run
started. Kinds recorded by the training job:
  step       one optimizer step (all micro-steps)
  forward    the engine's forward over the whole model (root gather included)
  gather     a unit's parameters being gathered before its forward (the wait)
  compute    a unit's own forward
  release    a unit's parameters being released after its forward
  backward   the whole backward (re-gathers and reductions included)
  optimizer  the engine's optimizer step (Adam over the shards)
The tier manager's transfers (nvme_read, nvme_write, copy) are recorded with
`Timeline.add` on their own lanes once it is wired into the engine; the
engine does not move shards between tiers yet, so none appear today.

Lanes (`tid`): 0 = the training thread; named in "M" metadata events.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

KINDS = ("step", "forward", "gather", "compute", "release", "backward", "optimizer")
LANES = {0: "training thread", 1: "nvme reads", 2: "nvme writes", 3: "copies"}


@dataclass
class Timeline:
    """Spans recorded while `recording` is on; cheap no-ops otherwise."""

    origin: float = field(default_factory=time.perf_counter)
    recording: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, kind: str, name: str, start: float, end: float, *, lane: int = 0,
            args: dict[str, Any] | None = None) -> None:
        """One span from perf_counter() times `start` to `end`."""
        if not self.recording:
            return
        event: dict[str, Any] = {
            "ph": "X", "cat": kind, "name": name, "pid": 0, "tid": lane,
            "ts": round((start - self.origin) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
        }
        if args:
            event["args"] = args
        self.events.append(event)

    @contextmanager
    def span(self, kind: str, name: str, args: dict[str, Any] | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, name, start, time.perf_counter(), args=args)

    def document(self) -> dict[str, Any]:
        """The JSON object Chrome's about://tracing and ui.perfetto.dev load."""
        meta = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
                 "args": {"name": "tierzero train"}}]
        meta += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": lane, "args": {"name": n}}
                 for lane, n in LANES.items()]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.document(), f)


class UnitProbes:
    """Forward hooks around each block unit: time spent gathering, computing, releasing.

    Registered after the engine's hooks: the `prepend=True` ones run before the
    engine gathers (pre-hook) or releases (post-hook), the others after, so
    each phase is bracketed without touching the engine. Hooks live on the
    module's hook dicts only; `close()` removes them. `wait_s` accumulates
    the forward gather time of every step (not only the traced ones).
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], timeline: Timeline) -> None:
        self.timeline = timeline
        self.wait_s = 0.0
        self._marks: dict[int, float] = {}
        self._handles: list[RemovableHandle] = []
        for name, module in units:
            self._register(name, module)

    def _register(self, name: str, module: nn.Module) -> None:
        key = id(module)

        def before_gather(_m: nn.Module, _a: Any) -> None:
            self._marks[key] = time.perf_counter()

        def after_gather(_m: nn.Module, _a: Any) -> None:
            now = time.perf_counter()
            start = self._marks.get(key, now)
            self.wait_s += now - start
            self.timeline.add("gather", name, start, now)
            self._marks[key] = now

        def before_release(_m: nn.Module, _a: Any, _o: Any) -> None:
            now = time.perf_counter()
            self.timeline.add("compute", name, self._marks.get(key, now), now)
            self._marks[key] = now

        def after_release(_m: nn.Module, _a: Any, _o: Any) -> None:
            now = time.perf_counter()
            self.timeline.add("release", name, self._marks.pop(key, now), now)

        self._handles += [
            module.register_forward_pre_hook(before_gather, prepend=True),
            module.register_forward_pre_hook(after_gather),
            module.register_forward_hook(before_release, prepend=True),
            module.register_forward_hook(after_release),
        ]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
