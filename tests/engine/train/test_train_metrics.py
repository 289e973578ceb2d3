"""The step's CPU counters of `tierzero train`'s metrics (engine/train/metrics.py)."""

from __future__ import annotations

import time

from tierzero.engine.train.metrics import CpuCounter


def test_cpu_counter_counts_the_process_cpu_between_two_calls() -> None:
    """delta() gives the process's CPU seconds (every thread) since the last call: at
    least the CPU the work between them took and no more than the process spent around
    it; the steal since the last call is None where /proc/stat has no steal column,
    otherwise not negative."""
    counter = CpuCounter()
    counter.delta()
    around0 = time.process_time()
    inside0 = time.process_time()
    deadline = time.perf_counter() + 0.05
    while time.perf_counter() < deadline:
        pass
    inside = time.process_time() - inside0
    cpu, steal = counter.delta()
    around = time.process_time() - around0
    assert inside <= cpu <= around + 1e-3, (inside, cpu, around)
    assert steal is None or steal >= 0.0
    cpu2, _ = counter.delta()  # a new interval, not the running total
    assert 0.0 <= cpu2 < cpu
