"""Concurrency and ordering of SwapStore requests; space reuse; stats."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
from swap_helpers import SlowIO

from tierzero.swap import SwapStore, aligned_empty


def test_many_keys_from_several_threads(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with SwapStore(tmp_path, verify=True, block_size=1 << 16, threads=4, queue_depth=4) as s:

        def client(cid: int) -> None:
            try:
                rng = random.Random(cid)
                mine: dict[str, torch.Tensor] = {}
                for step in range(30):
                    key = f"c{cid}/k{rng.randrange(6)}"
                    if rng.random() < 0.6 or key not in mine:
                        t = torch.full((rng.randrange(1, 50_000),), float(cid * 1000 + step))
                        s.write(key, t)  # not waited: the next read must see it
                        mine[key] = t
                    else:
                        got = s.read(key).wait()
                        assert torch.equal(got, mine[key]), key
                for key, t in mine.items():
                    assert torch.equal(s.read(key).wait(), t), key
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        st = s.stats()
        assert st.write.failed == 0 and st.read.failed == 0
        assert st.keys == len(s.keys()) <= 30


def test_same_key_writes_apply_in_order_and_reads_see_the_latest(tmp_path: Path) -> None:
    # Slow writes widen the window: without ordering, a later small write could land
    # before an earlier big one, and a read could see old bytes.
    with SwapStore(tmp_path, fileio=SlowIO(write_delay=0.002), block_size=1 << 16,
                   threads=4, verify=True) as s:
        versions = [torch.full((n,), float(v)) for v, n in enumerate([300_000, 10, 70_000, 5])]
        futures = [s.write("k", t) for t in versions]
        read_future = s.read("k")
        got = read_future.wait()
        assert all(f.done() for f in futures)
        assert torch.equal(got, versions[-1])
        # read, then overwrite without waiting: the read still sees the old value
        r1 = s.read("k")
        w = s.write("k", torch.full((5,), 99.0))
        assert torch.equal(r1.wait(), versions[-1])
        w.wait()
        assert torch.equal(s.read("k").wait(), torch.full((5,), 99.0))


class _StartLog(SlowIO):
    """SlowIO that records each pwrite/pread as it starts, in one ordered log."""

    def __init__(self, write_delay: float) -> None:
        super().__init__(write_delay=write_delay)
        self.lock = threading.Lock()
        self.log: list[str] = []

    def mark(self, what: str) -> None:
        with self.lock:
            self.log.append(what)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self.mark("w")
        return super().pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        self.mark("r")
        return super().pread(fd, buf, offset)


def test_different_keys_interleave_small_read_not_stuck_behind_big_write(tmp_path: Path) -> None:
    # 2 threads, each block of the big write takes >= 5 ms (64 blocks). A small read
    # submitted meanwhile goes first: once it is queued, no I/O thread picks another
    # write block before it, so at most one block per thread (picked before the read
    # was queued) starts ahead of it. Asserted on the order of operations, not on time,
    # so a busy machine cannot fail it.
    threads = 2
    io = _StartLog(write_delay=0.005)
    with SwapStore(tmp_path, fileio=io, block_size=1 << 16, threads=threads,
                   queue_depth=4) as s:
        s.write("small", torch.ones(100)).wait()
        big = s.write("big", aligned_empty(64 << 16, torch.uint8).zero_())
        small_f = s.read("small")
        io.mark("queued")
        small = small_f.wait()
        big.wait()
    assert torch.equal(small, torch.ones(100))
    log = io.log[io.log.index("queued"):]
    if "r" in log:  # else the read started before the mark: ahead of every later block
        assert log[:log.index("r")].count("w") <= threads, log[:10]


def test_same_direction_requests_finish_in_submission_order(tmp_path: Path) -> None:
    # Oldest request's blocks go first: the engine's prefetch order is its need order.
    finished: list[str] = []
    with SwapStore(tmp_path, fileio=SlowIO(read_delay=0.002), block_size=1 << 16,
                   threads=3, queue_depth=8) as s:
        data = aligned_empty(16 << 16, torch.uint8).zero_()
        for i in range(4):
            s.write(f"k{i}", data).wait()
        futs = [s.read(f"k{i}", out=aligned_empty(16 << 16, torch.uint8)) for i in range(4)]
        for f in futs:
            f.add_done_callback(lambda f: finished.append(f.key))  # type: ignore[attr-defined]
        for f in futs:
            f.wait()
    assert finished == ["k0", "k1", "k2", "k3"]


def test_background_reads_yield_to_later_reads(tmp_path: Path) -> None:
    # Read-ahead (background) queued first, filling every service slot; a read wanted now,
    # submitted after it, still finishes first: it does not wait for a slot or a block.
    finished: list[str] = []
    with SwapStore(tmp_path, fileio=SlowIO(read_delay=0.002), block_size=1 << 16,
                   threads=2, queue_depth=2) as s:
        data = aligned_empty(16 << 16, torch.uint8).zero_()
        for key in ("bg0", "bg1", "bg2", "now"):
            s.write(key, data).wait()
        futs = [s.read(f"bg{i}", out=aligned_empty(16 << 16, torch.uint8), background=True)
                for i in range(3)]
        futs.append(s.read("now", out=aligned_empty(16 << 16, torch.uint8)))
        for f in futs:
            f.add_done_callback(lambda f: finished.append(f.key))  # type: ignore[attr-defined]
        for f in futs:
            assert torch.equal(f.wait(), data)
    assert finished[0] == "now", finished
    assert finished[1:] == ["bg0", "bg1", "bg2"]  # in submission order among themselves


def test_background_read_sees_the_write_before_it(tmp_path: Path) -> None:
    # Same ordering against writes of the key as any read: the write issued before it
    # lands first, the one issued after it waits for it.
    with SwapStore(tmp_path, fileio=SlowIO(write_delay=0.002), block_size=1 << 16,
                   threads=2) as s:
        s.write("k", torch.zeros(1 << 16))
        first = s.write("k", torch.ones(1 << 16))
        got = s.read("k", background=True)
        s.write("k", torch.full((1 << 16,), 2.0))
        assert torch.equal(got.wait(), torch.ones(1 << 16))
        assert first.done()
        assert torch.equal(s.read("k").wait(), torch.full((1 << 16,), 2.0))


def test_writes_are_not_starved_by_reads(tmp_path: Path) -> None:
    # Reads have priority, but a write still gets every 4th block slot.
    with SwapStore(tmp_path, fileio=SlowIO(read_delay=0.003, write_delay=0.003),
                   block_size=1 << 16, threads=2, queue_depth=8) as s:
        s.write("r", aligned_empty(32 << 16, torch.uint8).zero_()).wait()
        reads = [s.read("r", out=aligned_empty(32 << 16, torch.uint8)) for _ in range(6)]
        write = s.write("w", aligned_empty(8 << 16, torch.uint8).zero_())
        write.wait()
        assert not reads[-1].done()  # the write finished while reads were still queued
        for r in reads:
            r.wait()


def test_delete_frees_space_for_reuse(tmp_path: Path) -> None:
    with SwapStore(tmp_path, verify=True) as s:
        for i in range(4):
            s.write(f"k{i}", torch.zeros(1 << 20)).wait()
        full = s.stats()
        assert full.used_bytes == 4 * (4096 + (4 << 20))
        s.delete("k1")
        s.delete("k2")
        assert "k1" not in s and "k0" in s
        assert s.stats().used_bytes == 2 * (4096 + (4 << 20))
        # the freed (coalesced) hole takes a key twice as big without growing the file
        s.write("big", torch.ones(2 << 20)).wait()
        after = s.stats()
        assert after.file_bytes == full.file_bytes
        assert torch.equal(s.read("big").wait(), torch.ones(2 << 20))
        # overwriting a key reuses space too: copy-on-write then free of the old region
        for _ in range(5):
            s.write("k0", torch.zeros(1 << 20)).wait()
        assert s.stats().file_bytes <= full.file_bytes + 4096 + (4 << 20)


def test_delete_waits_for_pending_io(tmp_path: Path) -> None:
    with SwapStore(tmp_path, fileio=SlowIO(write_delay=0.01), block_size=1 << 16) as s:
        fut = s.write("k", torch.zeros(1 << 18))
        s.delete("k")
        assert fut.done() and fut.exception() is None
        assert "k" not in s and s.stats().used_bytes == 0


def test_stats_count_bytes_and_time(tmp_path: Path) -> None:
    with SwapStore(tmp_path) as s:
        s.write("a", torch.zeros(1000, dtype=torch.float64)).wait()
        s.read("a").wait()
        s.read("a").wait()
        st = s.stats()
    assert (st.write.requests, st.write.bytes) == (1, 8000)
    assert (st.read.requests, st.read.bytes) == (2, 16000)
    assert st.write.busy_seconds > 0 and st.read.busy_seconds > 0
    assert st.read.gbps > 0


def test_closed_store_refuses_work_and_close_is_idempotent(tmp_path: Path) -> None:
    s = SwapStore(tmp_path)
    pending = s.write("k", torch.zeros(1 << 20))
    s.close()
    assert pending.done()  # close finished pending I/O first
    s.close()
    with pytest.raises(Exception, match="closed"):
        s.write("k", torch.zeros(1))
