"""Prefetch hides I/O: with a unit order set, the manager issues NVMe reads of the
next shards while the consumer still holds an earlier one, so they overlap its work.

Asserted on what is guaranteed, not on wall time (a busy machine stretches any
ratio): the read of a later shard starts while the consumer holds shard 0 and has not
asked for them, and without an order nothing is read ahead. The reads go through
DelayIO (a fixed latency per block) so they are in flight long enough to be seen.
How much time the overlap saves is measured by benchmarks/prefetch_bench.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from tiers_util import DelayIO, cpu_settings, data_for

from tierzero.offload import ShardSpec, TierManager, TierSettings
from tierzero.swap import SwapStore

SHARDS = 12
NUMEL = 16384  # 64 KiB fp32: one 64 KiB block per shard, so one read call per shard
READ_DELAY = 0.005
AHEAD = 4  # shards the NVMe read-ahead may cover (nvme_ahead bytes)
PATIENCE_S = 60.0  # how long to wait for something that must happen; never a bound


class CountingIO(DelayIO):
    """Counts data-block reads as they start, and lets a test wait for a count. The
    swap store's checksum check (nvme.verify) also reads each record's header; those
    small reads are not counted."""

    def __init__(self) -> None:
        super().__init__(read_delay=READ_DELAY)
        self.started = 0
        self._cond = threading.Condition()

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        with self._cond:
            if len(buf) == NUMEL * 4:
                self.started += 1
                self._cond.notify_all()
        return super().pread(fd, buf, offset)

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.started >= count, timeout)


def _setup() -> tuple[list[ShardSpec], dict[str, float], TierSettings]:
    specs = [ShardSpec(f"s{i}", "master", NUMEL, torch.float32) for i in range(SHARDS)]
    refs = {s.key: float(data_for(s, i).sum()) for i, s in enumerate(specs)}
    return specs, refs, cpu_settings({"master": "nvme"}, device=0, host=64 << 20,
                                     buffer_count=6, nvme_ahead=AHEAD * NUMEL * 4,
                                     device_ahead=0)


def test_prefetch_reads_ahead_of_use(tmp_path: Path) -> None:
    io = CountingIO()
    specs, refs, settings = _setup()
    with SwapStore(tmp_path, block_size=1 << 16, fileio=io) as store, \
            TierManager(specs, settings, swap=store) as mgr:
        for i, spec in enumerate(specs):
            mgr.place(spec.key, data_for(spec, i)).wait()
        mgr.synchronize()
        keys = [s.key for s in specs]
        for key in keys:  # start from NVMe
            mgr.evict(key)
        mgr.synchronize()

        # No order: holding shard 0, nothing else is read.
        base = io.started
        view = mgr.fetch(keys[0], "host").wait()
        assert float(view.sum()) == refs[keys[0]]
        assert not io.wait_for(base + 2, timeout=0.3)
        mgr.release(keys[0])
        mgr.evict(keys[0])
        mgr.synchronize()

        # With the order: while shard 0 is held, the read of the next shard starts.
        mgr.set_order([(k, "host") for k in keys])
        base = io.started
        view = mgr.fetch(keys[0], "host").wait()
        assert float(view.sum()) == refs[keys[0]]
        assert io.wait_for(base + 2, timeout=PATIENCE_S), (
            f"no read-ahead while shard 0 is held: {io.started - base} read(s) started")
        mgr.release(keys[0])
        for key in keys[1:]:  # the consumer goes on; every value is right
            view = mgr.fetch(key, "host").wait()
            assert float(view.sum()) == refs[key]
            mgr.release(key)
        rep = mgr.memory_report()
        mgr.set_order([])
    assert rep.prefetches >= SHARDS - 1
    assert rep.pool_peak_in_use <= 6
