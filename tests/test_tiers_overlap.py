"""Prefetch hides I/O: a consumer doing fixed CPU work per NVMe-resident shard
finishes well under the serial time (compute + I/O), measured in the same run.

The NVMe latency is injected (DelayIO sleeps 20 ms before every block read), so
the I/O time is known and the ratio does not depend on this machine's disk. The
exact overlap efficiency is measured by benchmarks/prefetch_bench.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tiers_util import DelayIO, cpu_settings, data_for

from tierzero.offload import ShardSpec, TierManager
from tierzero.swap import SwapStore

SHARDS = 12
NUMEL = 16384  # 64 KiB fp32: one 64 KiB block per shard, so one injected delay per read
READ_DELAY = 0.02
WORK = 0.02  # seconds of CPU work per shard


def consume(mgr: TierManager, keys: list[str], refs: dict[str, float], *, prefetch: bool) -> float:
    """Fetch every shard to host, check it, spin WORK seconds on it; return elapsed time."""
    if prefetch:
        mgr.set_order([(k, "host") for k in keys])
    start = time.perf_counter()
    for key in keys:
        view = mgr.fetch(key, "host").wait()
        assert float(view.sum()) == refs[key]
        end = time.perf_counter() + WORK
        while time.perf_counter() < end:  # fixed CPU work, independent of machine load
            view.abs().max()
        mgr.release(key)
    elapsed = time.perf_counter() - start
    mgr.set_order([])
    for key in keys:  # next run reads from NVMe again
        mgr.evict(key)
    mgr.synchronize()
    return elapsed


def test_prefetch_overlaps_nvme_reads_with_compute(tmp_path: Path) -> None:
    specs = [ShardSpec(f"s{i}", "master", NUMEL, torch.float32) for i in range(SHARDS)]
    settings = cpu_settings({"master": "nvme"}, device=0, host=64 << 20, buffer_count=6,
                            nvme_ahead=4 * NUMEL * 4, device_ahead=0)
    with SwapStore(tmp_path, block_size=1 << 16, fileio=DelayIO(read_delay=READ_DELAY)) as store, \
            TierManager(specs, settings, swap=store) as mgr:
        refs = {}
        for i, spec in enumerate(specs):
            data = data_for(spec, i)
            refs[spec.key] = float(data.sum())
            mgr.place(spec.key, data).wait()
        mgr.synchronize()
        keys = [s.key for s in specs]
        serial, overlapped = [], []
        for _ in range(2):  # interleaved repeats; best of each
            serial.append(consume(mgr, keys, refs, prefetch=False))
            overlapped.append(consume(mgr, keys, refs, prefetch=True))
        rep = mgr.memory_report()
    ideal_serial = SHARDS * (READ_DELAY + WORK)
    # no prefetch: every shard pays its read then its work
    assert min(serial) >= 0.95 * ideal_serial, (serial, ideal_serial)
    # prefetch: reads run under the work of earlier shards; ideal is ~half of serial
    ratio = min(overlapped) / min(serial)
    assert ratio < 0.8, f"prefetch did not hide I/O: {overlapped} vs serial {serial}"
    assert rep.prefetches >= 2 * (SHARDS - 1)
    assert rep.pool_peak_in_use <= 6
