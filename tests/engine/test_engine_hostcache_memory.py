"""Memory: with params on NVMe, offload.params.max_in_cpu_bytes costs about the parameter
bytes it keeps in host memory and no more. The same ~50M-parameter model (bf16 param
~100 MB) trains twice in fresh child processes (tests/engine_memory_child.py), without and
with a 64 MiB cache; the peak RSS growth of the cached run exceeds the uncached one's by the
bytes homed in host memory (eng.memory_report()["tiers"]["params_in_cpu"]: the first 7
blocks, 59 MB) within SLACK.

SLACK = 12 MiB: both runs hold the same pool, CPU Adam ring and gathered units; what
differs besides the cached shards is allocator noise (MALLOC_MMAP_THRESHOLD_ = 1 MiB, see
test_engine_offload_memory) and the timing of transient buffers. Measured here (two
repeats): growth 382.5 / 383.2 MiB without the cache, 439.1 / 439.1 MiB with it; 56.0 MiB
kept, so the cache cost its bytes +0.5 / -0.2 MiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from memory_child import MiB, run_memory_child

BLOCKS, DIM = 12, 724  # 12 x (2 x 724 x 2896 + biases) + head = 50.3M parameters
HOST_BUDGET = 512 * MiB  # fp32 grad shards 201 MB, staging pool, the CPU Adam's ring
DEVICE_BUDGET = 64 * MiB
CACHE = 64 * MiB
SLACK = 12 * MiB


@pytest.mark.multiproc
def test_cache_costs_its_bytes_in_rss(tmp_path: Path) -> None:
    runs = {}
    for cache in (0, CACHE):
        swap = tmp_path / f"c{cache}"
        swap.mkdir()
        # the cache is counted against the host budget: give it that much more
        runs[cache] = run_memory_child("engine_memory_child.py", swap, BLOCKS, DIM,
                                       HOST_BUDGET + cache, DEVICE_BUDGET, cache)
    kept = runs[CACHE]["tiers"]["params_in_cpu"]
    assert runs[0]["tiers"]["params_in_cpu"] == 0
    assert CACHE - 10 * MiB < kept <= CACHE  # 7 of 12 block shards (8.4 MB each)
    growth = {c: r["train_peak_rss"] - r["model_rss"] for c, r in runs.items()}
    extra = growth[CACHE] - growth[0]
    assert abs(extra - kept) <= SLACK, (
        f"the cache kept {kept / MiB:.1f} MiB of parameters in host memory; peak RSS grew "
        f"{extra / MiB:.1f} MiB more than without it (allowed: within {SLACK / MiB:.0f} MiB)",
        growth)
    # the cached bytes are not on NVMe, and the run wrote that much less per step there
    assert runs[0]["tiers"]["current"]["nvme"] - runs[CACHE]["tiers"]["current"]["nvme"] == kept
    for r in runs.values():
        for t in ("host", "device"):
            assert r["tiers"]["peak"][t] <= r["tiers"]["budget"][t]
    assert runs[CACHE]["losses"] == runs[0]["losses"]  # the same training, bitwise
