"""Where a traced step's time goes: the drive's busy and idle time, and each thread's.

Reads a trace the engine recorded (swap/trace.py's Recorder: `tierzero train --trace`, or
scale_bench.py --trace) and reports, over the traced window:

- the drive: seconds with at least one NVMe read in flight, one write, either; the idle
  rest, split by what the training thread (lane 0) was doing meanwhile (its innermost
  span: compute, gather, stall, adam, ...), so an idle drive under a step that should be
  the drive's time names its cause;
- each thread (lane): seconds by its innermost span's kind (nested spans count once, for
  the innermost), and the seconds in none;
- the CPU, where the trace sampled it (`cpu` counters: `tierzero train --trace`,
  scale_bench --trace): the cores the process ran on and the cores the hypervisor took
  (steal), on average over the window and over each of the training thread's forward,
  backward and optimizer spans (and the rest), so a step that is neither the drive's nor
  its own CPU work's time shows whether the machine's cores were there at all.

    .venv/bin/python benchmarks/trace_summary.py trace.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from typing import Any

Interval = tuple[float, float]  # seconds, [start, end)


def _union(spans: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[Interval]) -> float:
    return sum(b - a for a, b in spans)


def _complement(spans: list[Interval], window: Interval) -> list[Interval]:
    out, at = [], window[0]
    for a, b in spans:
        if a > at:
            out.append((at, min(a, window[1])))
        at = max(at, b)
    if at < window[1]:
        out.append((at, window[1]))
    return [(a, b) for a, b in out if b > a]


def _innermost(events: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """One lane's time cut into segments, each labelled with the kind of the innermost
    span open then (the latest started; the shorter on a tie); no label where none is."""
    spans = sorted(((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["cat"]) for e in events),
                   key=lambda s: (s[0], -(s[1] - s[0])))
    cuts = sorted({t for s in spans for t in s[:2]})
    out: list[tuple[float, float, str]] = []
    active: list[tuple[float, float, str]] = []
    i = 0
    for a, b in itertools.pairwise(cuts):
        while i < len(spans) and spans[i][0] <= a:
            active.append(spans[i])
            i += 1
        active = [s for s in active if s[1] > a]
        if active:
            inner = max(active, key=lambda s: (s[0], -(s[1] - s[0])))
            out.append((a, b, inner[2]))
    return out


PHASES = ("forward", "backward", "optimizer")  # the training thread's top-level spans


def _cpu(doc: dict[str, Any], window: Interval,
         main_spans: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Time-weighted means of the `cpu` counters' values over the window and over each
    phase's spans (the rest: "other"); None when the trace has no such counters."""
    counters = sorted((e for e in doc["traceEvents"]
                       if e.get("ph") == "C" and e.get("name") == "cpu"), key=lambda e: e["ts"])
    if not counters:
        return None
    # each value holds from its event to the next one (the last event closes the track)
    steps = [(a["ts"] / 1e6, b["ts"] / 1e6, a["args"]) for a, b in itertools.pairwise(counters)]
    phases = {p: _union([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                         for e in main_spans if e["cat"] == p]) for p in PHASES}
    phases["other"] = _complement(_union([iv for p in PHASES for iv in phases[p]]), window)
    phases["window"] = [window]
    out: dict[str, dict[str, float]] = {}
    for name, spans in phases.items():
        sums: dict[str, float] = defaultdict(float)
        covered = 0.0
        for a, b, values in steps:
            for lo, hi in spans:
                overlap = min(b, hi) - max(a, lo)
                if overlap > 0:
                    covered += overlap
                    for key, v in values.items():
                        sums[key] += v * overlap
        if covered >= 1e-3:  # a phase shorter than a millisecond has no mean worth printing
            out[name] = {"s": round(covered, 3),
                         **{f"{k}_cores": round(v / covered, 3) for k, v in sorted(sums.items())}}
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    if not events:
        return {"window_s": 0.0}
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    window = (min(e["ts"] for e in events) / 1e6,
              max(e["ts"] + e["dur"] for e in events) / 1e6)
    io = {op: _union([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
                      if e["cat"] == f"nvme_{op}"]) for op in ("read", "write")}
    busy = _union(io["read"] + io["write"])
    idle = _complement(busy, window)
    by_lane: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_lane[e["tid"]].append(e)
    lanes: dict[str, dict[str, float]] = {}
    segments: dict[int, list[tuple[float, float, str]]] = {}
    for tid, evs in sorted(by_lane.items()):
        segs = _innermost(evs)
        segments[tid] = segs
        kinds: dict[str, float] = defaultdict(float)
        for a, b, k in segs:
            kinds[k] += b - a
        kinds["none"] = (window[1] - window[0]) - sum(kinds.values())
        lanes[f"{tid}:{names.get(tid, '?')}"] = {k: round(v, 3) for k, v in
                                                 sorted(kinds.items(), key=lambda kv: -kv[1])}
    idle_by: dict[str, float] = defaultdict(float)
    main = segments.get(0, [])
    for a, b in idle:
        covered = 0.0
        for s, e, k in main:
            lo, hi = max(a, s), min(b, e)
            if hi > lo:
                idle_by[k] += hi - lo
                covered += hi - lo
        idle_by["none"] += (b - a) - covered
    cpu = _cpu(doc, window, by_lane.get(0, []))
    return {"window_s": round(window[1] - window[0], 3),
            **({"cpu": cpu} if cpu is not None else {}),
            "drive": {"read_busy_s": round(_length(io["read"]), 3),
                      "write_busy_s": round(_length(io["write"]), 3),
                      "busy_s": round(_length(busy), 3),
                      "idle_s": round(_length(idle), 3),
                      "idle_by_training_thread": {k: round(v, 3) for k, v in sorted(
                          idle_by.items(), key=lambda kv: -kv[1])}},
            "lanes": lanes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a trace JSON the engine wrote")
    args = ap.parse_args()
    with open(args.trace) as f:
        print(json.dumps(summarize(json.load(f)), indent=1))


if __name__ == "__main__":
    main()
