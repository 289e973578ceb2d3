"""TierManager behaviour on the CPU stand-in device tier with a real SwapStore."""

from __future__ import annotations

import dataclasses
import errno
import threading
from pathlib import Path

import pytest
import torch
from tiers_util import DelayIO, cpu_settings, data_for, store

from tierzero.offload import (
    TRANSITIONS,
    BudgetError,
    Budgets,
    OffloadError,
    Op,
    Role,
    ShardRecord,
    ShardSpec,
    State,
    TierManager,
    TransferError,
    core,
)
from tierzero.offload.core import CLEAN_AHEAD_WRITES
from tierzero.offload.residency import transition
from tierzero.swap import FileIO, trace

N = 1024  # elements per shard: 4 KiB in fp32
HOMES = {"param": "nvme", "grad": "cpu", "master": "none"}


def specs(n: int = 4) -> list[ShardSpec]:
    return ([ShardSpec(f"p{i}", "param", N, torch.float32) for i in range(n)]
            + [ShardSpec(f"g{i}", "grad", N, torch.float32) for i in range(n)]
            + [ShardSpec("m0", "master", N, torch.float32)])


def make(tmp_path: Path, *, device_caches: int = 2, pool: int = 3, timeout: float = 0.2,
         fileio: FileIO | None = None, n: int = 4) -> tuple[TierManager, dict[str, torch.Tensor]]:
    sp = specs(n)
    s = store(tmp_path, fileio=fileio) if fileio else store(tmp_path)
    settings = cpu_settings(HOMES, device=(1 + device_caches) * 4 * N, host=64 * 4 * N,
                            buffer_count=pool, timeout=timeout, nvme_ahead=2 * 4 * N,
                            device_ahead=4 * N)
    mgr = TierManager(sp, settings, swap=s)
    data = {x.key: data_for(x, i) for i, x in enumerate(sp)}
    for k, v in data.items():
        mgr.place(k, v).wait()
    mgr.synchronize()
    return mgr, data


def test_transition_table_is_data_and_guards_dirty_data() -> None:
    assert (Role.CACHE, State.DIRTY, Op.DROP) not in TRANSITIONS  # dirty data is never dropped
    rec = ShardRecord(ShardSpec("k", "grad", 4, torch.float32), "nvme")
    with pytest.raises(OffloadError, match="cache copy in state absent cannot loaded"):
        transition(rec, "host", Op.LOADED)
    transition(rec, "host", Op.WRITE)
    with pytest.raises(OffloadError, match="dirty cannot drop"):
        transition(rec, "host", Op.DROP)


def test_round_trip_every_home_and_tier(tmp_path: Path) -> None:
    mgr, data = make(tmp_path)
    with mgr:
        assert {mgr.home_of(k) for k in data} == {"device", "host", "nvme"}
        for key, ref in data.items():
            tiers = ["device"] + (["host"] if mgr.home_of(key) != "device" else [])
            for tier in tiers:
                got = mgr.fetch(key, tier).wait()  # type: ignore[arg-type]
                assert torch.equal(got, ref), (key, tier)
                mgr.release(key)
                mgr.audit()
        rep = mgr.memory_report()
        assert rep.peak["device"] <= rep.budget["device"]
        assert rep.moved["nvme_to_host"] >= 4 * 4 * N and rep.moved["host_to_nvme"] == 4 * 4 * N
        for d, nbytes in rep.moved.items():  # the per-class split adds up to the total
            assert sum(rep.moved_by_class[d].values()) == nbytes, d


def test_dirty_cache_is_written_back_and_clean_one_is_not(tmp_path: Path) -> None:
    mgr, data = make(tmp_path)
    with mgr:
        view = mgr.fetch("p0", "device", writable=True).wait()
        view.mul_(2)
        mgr.release("p0")
        before = mgr.memory_report().moved["host_to_nvme"]
        mgr.evict("p0")
        mgr.synchronize()
        rep = mgr.memory_report()
        assert rep.moved["device_to_host"] == 4 * N and rep.moved["host_to_nvme"] == before + 4 * N
        assert rep.moved_by_class["device_to_host"] == {**dict.fromkeys(rep.moved_by_class[
            "device_to_host"], 0), "param": 4 * N}  # counted under p0's class alone
        mgr.fetch("p1", "device").wait()
        mgr.release("p1")
        mgr.evict("p1")  # clean: no write-back at all
        mgr.synchronize()
        assert mgr.memory_report().moved["host_to_nvme"] == before + 4 * N
        # the NVMe copy itself holds the new data
        out = torch.empty(N)
        mgr._mover._store().read("p0", out=out).wait()  # type: ignore[call-arg]
        assert torch.equal(out, data["p0"] * 2)
        mgr.audit()
        assert mgr.memory_report().pool_in_use == 0


def test_prefetch_evict_and_writeback_traced(tmp_path: Path) -> None:
    """The tier manager records its prefetch, evict and writeback events where they
    happen (a training run has them only when timing and cache pressure say so)."""
    mgr, _ = make(tmp_path, device_caches=3, pool=4)
    with mgr, trace.recording(trace.Recorder()) as rec:
        mgr.set_order([(f"p{i}", "device") for i in range(4)])
        mgr.synchronize()
        mgr.fetch("p0", "device", writable=True).wait().mul_(2)
        mgr.release("p0")
        mgr.evict("p0")
        mgr.synchronize()
        marks = {(e["cat"], e["name"]) for e in rec.events}
    assert ("writeback", "p0") in marks and ("evict", "p0") in marks
    assert {("prefetch", f"p{i}") for i in range(2)} <= marks


def test_fetch_below_a_dirty_cache_sees_the_newest_data(tmp_path: Path) -> None:
    mgr, data = make(tmp_path)
    with mgr:
        mgr.fetch("g0", "device", writable=True).wait().add_(1)
        mgr.release("g0")
        host = mgr.fetch("g0", "host").wait()  # host is home: flushed from the device first
        assert torch.equal(host, data["g0"] + 1)
        mgr.release("g0")
        mgr.fetch("g1", "device").wait()
        mgr.release("g1")
        w = mgr.fetch("g1", "host", writable=True).wait()  # drops the stale device cache
        w.zero_()
        mgr.release("g1")
        assert torch.equal(mgr.fetch("g1", "device").wait(), torch.zeros(N))
        mgr.release("g1")
        mgr.audit()


def test_misuse_is_refused_with_the_reason(tmp_path: Path) -> None:
    mgr, _ = make(tmp_path)
    with mgr:
        with pytest.raises(OffloadError, match="unknown shard key 'nope'"):
            mgr.fetch("nope", "device")
        with pytest.raises(OffloadError, match="lives on device"):
            mgr.fetch("m0", "host")
        with pytest.raises(OffloadError, match="not addressable"):
            mgr.fetch("p0", "nvme")  # type: ignore[arg-type]
        with pytest.raises(OffloadError, match="not held"):
            mgr.release("p0")
        with pytest.raises(OffloadError, match="already placed"):
            mgr.place("p0", torch.zeros(N))
        mgr.fetch("p0", "device").wait()
        with pytest.raises(OffloadError, match="held by 1 fetch"):
            mgr.evict("p0")
        with pytest.raises(OffloadError, match="home"):
            mgr.evict("g0", "host")
        mgr.release("p0")


def test_place_checks_shape_and_dtype(tmp_path: Path) -> None:
    sp = [ShardSpec("a", "grad", 8, torch.float32)]
    with TierManager(sp, cpu_settings({"grad": "cpu"}, device=1 << 20, host=1 << 20)) as mgr:
        with pytest.raises(OffloadError, match=r"got 8 x torch.float16"):
            mgr.place("a", torch.zeros(8, dtype=torch.float16))
        with pytest.raises(OffloadError, match="no data yet"):
            mgr.fetch("a", "host")


def test_eviction_picks_the_shard_used_furthest_ahead(tmp_path: Path) -> None:
    mgr, _ = make(tmp_path, device_caches=2)
    with mgr:
        for k in ("g0", "g1"):
            mgr.fetch(k, "device").wait()
            mgr.release(k)
        # g0 is next used soon, g1 never: g1 must make room for g2
        mgr.set_order([("g2", "device"), ("g0", "device")])
        mgr.fetch("g2", "device").wait()
        mgr.release("g2")
        recs = mgr._records
        assert recs["g0"].copies["device"].state is State.CLEAN
        assert recs["g1"].copies["device"].state is State.ABSENT
        mgr.audit()


def test_pinned_and_held_shards_are_never_pressed_out(tmp_path: Path) -> None:
    mgr, _ = make(tmp_path, device_caches=2, timeout=0.05)
    with mgr:
        mgr.pin("g0", "device").wait()
        mgr.fetch("g1", "device").wait()  # held
        with pytest.raises(BudgetError) as err:
            mgr.fetch("g2", "device")
        msg = str(err.value)
        assert "tier device has no room for shard 'g2'" in msg
        assert "held by fetches: ['g1']" in msg and "pinned: ['g0']" in msg
        mgr.release("g1")
        mgr.fetch("g2", "device").wait()  # g1 is evictable now
        assert mgr._records["g0"].copies["device"].state is State.CLEAN
        mgr.release("g2")
        mgr.unpin("g0", "device")
        mgr.evict("g0")
        mgr.audit()


def test_request_larger_than_the_tier_fails_at_once(tmp_path: Path) -> None:
    sp = [ShardSpec("big", "param", 4 * N, torch.float32),
          ShardSpec("small", "param", N, torch.float32)]
    settings = cpu_settings({"param": "cpu"}, device=4 * N * 4, host=1 << 20)
    with TierManager(sp, settings) as mgr:
        mgr.place("big", torch.ones(4 * N)).wait()
        mgr.place("small", torch.ones(N)).wait()
        with pytest.raises(BudgetError, match="larger than the device tier"):
            # shrink the budget after planning to make one request too big
            mgr._acct.budget["device"] = 4 * N
            mgr.fetch("big", "device")


def test_prefetch_runs_ahead_and_a_second_request_joins_the_first(tmp_path: Path) -> None:
    mgr, data = make(tmp_path, device_caches=3, pool=4)
    with mgr:
        order = [(f"p{i}", "device") for i in range(4)]
        mgr.set_order(order)  # type: ignore[arg-type]
        rep0 = mgr.memory_report()
        assert rep0.prefetches >= 2  # started before any fetch
        for key, tier in order:
            got = mgr.fetch(key, tier).wait()  # type: ignore[arg-type]
            assert torch.equal(got, data[key])
            mgr.release(key)
        rep = mgr.memory_report()
        assert rep.hits == 4 and rep.misses == 0
        # every shard was read from NVMe exactly once: in-flight requests were joined
        assert rep.transfers["nvme_to_host"] == 4
        assert rep.order_mismatches == 0
        mgr.audit()


def test_new_order_replaces_the_window(tmp_path: Path) -> None:
    mgr, _ = make(tmp_path, device_caches=3, pool=3, n=6)
    with mgr:
        mgr.set_order([(f"p{i}", "device") for i in range(6)])
        mgr.synchronize()
        first = {k for k in mgr._records if mgr._records[k].copies["host"].state is State.CLEAN
                 and k.startswith("p")}
        assert first == {"p0", "p1"}  # the NVMe window is two shards
        mgr.set_order([("p5", "device"), ("p4", "device")])
        mgr.synchronize()
        host = {k for k in mgr._records if mgr._records[k].copies["host"].state is State.CLEAN
                and k.startswith("p")}
        assert {"p5", "p4"} <= host  # old prefetches made room for the new order
        rep = mgr.memory_report()
        mgr.fetch("p5", "device").wait()
        mgr.release("p5")
        assert mgr.memory_report().hits == rep.hits + 1
        mgr.audit()


class FailingReads(FileIO):
    def __init__(self) -> None:
        self.fail = False

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        if self.fail:
            raise OSError(errno.EIO, "injected read error")
        return super().pread(fd, buf, offset)


def test_a_failed_read_raises_and_frees_the_buffer(tmp_path: Path) -> None:
    io = FailingReads()
    mgr, data = make(tmp_path, fileio=io)
    with mgr:
        io.fail = True
        fut = mgr.fetch("p0", "host")
        with pytest.raises(TransferError, match="nvme_to_host"):
            fut.wait()
        mgr.release("p0")  # raised once, to its waiter: the manager settles it quietly
        mgr.synchronize()
        host = mgr._records["p0"].copies["host"]
        assert host.state is State.ABSENT and host.users == 0
        mgr.audit()
        io.fail = False
        assert torch.equal(mgr.fetch("p0", "host").wait(), data["p0"])
        mgr.release("p0")


def test_prefetch_never_copies_a_copy_being_written(tmp_path: Path) -> None:
    mgr, _ = make(tmp_path)
    with mgr:
        mgr.set_order([("g0", "host"), ("g0", "device")])  # device copy prefetched at once
        view = mgr.fetch("g0", "host", writable=True).wait()  # drops the stale device copy
        assert mgr._records["g0"].copies["device"].state is State.ABSENT  # not re-prefetched
        view.fill_(5.0)
        with pytest.raises(OffloadError, match="held writable"):
            mgr.fetch("g0", "device")
        mgr.release("g0")  # now the device window may load it: from the written data
        got = mgr.fetch("g0", "device").wait()
        assert torch.equal(got, torch.full((N,), 5.0))
        mgr.release("g0")
        mgr.audit()


def test_pressure_evicts_one_dirty_cache_not_all(tmp_path: Path) -> None:
    mgr, data = make(tmp_path, device_caches=3)
    with mgr:
        for k in ("g0", "g1", "g2"):
            mgr.fetch(k, "device", writable=True).wait().add_(1)
            mgr.release(k)
        before = mgr.memory_report()
        assert torch.equal(mgr.fetch("g3", "device").wait(), data["g3"])
        mgr.release("g3")
        rep = mgr.memory_report()
        assert rep.evictions - before.evictions == 1
        assert rep.moved["device_to_host"] - before.moved["device_to_host"] == 4 * N
        on_device = [k for k in ("g0", "g1", "g2")
                     if mgr._records[k].copies["device"].state is State.DIRTY]
        assert len(on_device) == 2
        gone = ({"g0", "g1", "g2"} - set(on_device)).pop()
        assert torch.equal(mgr.fetch(gone, "host").wait(), data[gone] + 1)  # written back
        mgr.release(gone)
        mgr.audit()


def test_nvme_budget_is_detected_at_the_swap_store(tmp_path: Path) -> None:
    sp = [ShardSpec("a", "master", N, torch.float32)]
    settings = dataclasses.replace(cpu_settings({"master": "nvme"}, device=0, host=1 << 20),
                                   budgets=Budgets(device=0, host=1 << 20))  # nvme: detect
    with store(tmp_path) as s, TierManager(sp, settings, swap=s) as mgr:
        assert mgr.memory_report().budget["nvme"] > 0
        mgr.place("a", torch.ones(N)).wait()
        assert torch.equal(mgr.fetch("a", "host").wait(), torch.ones(N))
        mgr.release("a")


def test_order_cursor_counts_skips_not_reuses() -> None:
    """A fetch that jumps ahead of the recorded order is a mismatch and moves the cursor
    there; fetching again a key whose uses are all behind the cursor (the optimizer
    reading a gradient the reduce just wrote) is not, and leaves the cursor alone; a key
    the order never named is a mismatch."""
    from tierzero.offload.prefetch import Prefetcher
    from tierzero.offload.settings import PrefetchSettings
    pf = Prefetcher(PrefetchSettings())
    pf.set_order([("a", "host"), ("b", "host"), ("c", "host"), ("d", "host")])
    pf.consume("a", "host")
    pf.consume("a", "host")  # used again: every use of "a" is behind the cursor
    assert (pf.mismatches, pf.cursor) == (0, 1)
    pf.consume("c", "host")  # skips "b"
    assert (pf.mismatches, pf.cursor) == (1, 3)
    pf.consume("zz", "host")  # never in the order
    assert (pf.mismatches, pf.cursor) == (2, 3)
    pf.consume("d", "host")
    assert (pf.mismatches, pf.cursor, pf.active) == (2, 4, False)


def test_discard_fetch_reads_nothing_and_its_writes_persist(tmp_path: Path) -> None:
    """fetch(discard=True) (a caller that overwrites the whole shard, as a checkpoint load
    does) makes the host cache without reading the swap file; the new data is written down
    like any dirty cache and read back intact."""
    mgr, data = make(tmp_path)
    with mgr:
        mgr.fetch("p0", "device").wait()  # a clean device cache, to be dropped as stale
        mgr.release("p0")
        before = mgr.memory_report().moved["nvme_to_host"]
        view = mgr.fetch("p0", "host", writable=True, discard=True).wait()
        view.copy_(data["p1"])
        mgr.release("p0")
        after = mgr.memory_report().moved
        assert after["nvme_to_host"] == before  # the old bytes were not read
        mgr.evict("p0")
        mgr.synchronize()
        assert mgr.memory_report().moved["nvme_to_host"] == before
        out = mgr.fetch("p0", "device").wait()  # read back from the swap file
        assert torch.equal(out, data["p1"])
        mgr.release("p0")
        with pytest.raises(OffloadError, match="needs writable=True"):
            mgr.fetch("p1", "host", discard=True)
        mgr.audit()
        assert mgr.memory_report().pool_in_use <= 2


def test_order_cursor_reuse_of_an_overwritten_unlisted_key() -> None:
    """A fresh gradient is not in the order (the reduce overwrites it: nothing to read
    ahead); the optimizer reading it right after is a re-use, not a mismatch. A new order
    forgets what was overwritten under the old one."""
    from tierzero.offload.prefetch import Prefetcher
    from tierzero.offload.settings import PrefetchSettings
    pf = Prefetcher(PrefetchSettings())
    pf.set_order([("a", "host"), ("b", "host")])
    pf.consume("a", "host")
    pf.overwritten("g")  # the reduce's overwriting fetch
    pf.consume("g", "host")  # the optimizer reads it
    assert (pf.mismatches, pf.cursor) == (0, 1)
    pf.set_order([("a", "host"), ("b", "host")])
    pf.consume("g", "host")
    assert (pf.mismatches, pf.cursor) == (1, 0)


def test_demand_fetch_wakes_when_a_write_back_lands(tmp_path: Path) -> None:
    """Every pool buffer holds a cache whose write-back is in flight: none is a victim
    until its write lands, and a landing transfer notifies nobody. A demand fetch waits
    for one of those writes, then evicts that copy; it must not sleep until the wait
    timeout (an hour here: the thread below would still be waiting when joined)."""
    mgr, _ = make(tmp_path, pool=3, timeout=3600.0, fileio=DelayIO(write_delay=0.2))
    with mgr:
        for key in ("p0", "p1", "p2"):  # three dirty host caches, written down at once
            mgr.write_from(key, torch.full((N,), 7.0), keep_host=True)
        assert mgr.memory_report().pool_in_use == 3
        got: list[torch.Tensor] = []
        errors: list[BaseException] = []

        def fetch() -> None:
            try:
                got.append(mgr.fetch("p3", "host").wait().clone())
                mgr.release("p3")
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=fetch, daemon=True)
        worker.start()
        worker.join(120.0)  # far beyond the 0.2 s writes, far below the hour's timeout
        assert not worker.is_alive(), "the fetch is still waiting for host room"
        assert not errors, errors
        mgr.synchronize()
        for key in ("p0", "p1", "p2"):
            got_key = mgr.fetch(key, "host").wait()
            assert torch.equal(got_key, torch.full((N,), 7.0)), key
            mgr.release(key)
        mgr.audit()


def test_expected_writes_are_not_read_ahead_and_readers_wait_for_them(tmp_path: Path) -> None:
    """expect_writes: an NVMe shard about to be overwritten (a deferred optimizer update
    writes each param right before its gather) is skipped by prefetch, which reads the
    others of the order; a fetch of it waits until its write is issued and then sees the
    new data; a fetch outside the order (ordered=False) neither counts as a mismatch nor
    moves the cursor; a withdrawn expectation lets readers go on."""
    mgr, data = make(tmp_path, device_caches=3, pool=4, timeout=1.0)
    with mgr:
        mgr.expect_writes(["p0", "p1"])
        mgr.set_order([(f"p{i}", "device") for i in (0, 2, 1, 3)])  # type: ignore[misc]
        mgr.synchronize()
        cached = {k for k in ("p0", "p1", "p2", "p3")
                  if mgr._records[k].copies["host"].state is not State.ABSENT}
        assert cached == {"p2"}  # the window: p0, p2; the old data of p0 is not read
        got: dict[str, torch.Tensor] = {}

        def reader() -> None:
            got["p0"] = mgr.fetch("p0", "device").wait().clone()
            mgr.release("p0", "device")

        t = threading.Thread(target=reader)
        t.start()
        t.join(0.2)
        assert t.is_alive()  # waits for the write
        new = torch.full((N,), 5.0)
        mgr.write_from("p0", new).wait()
        t.join(5)
        assert not t.is_alive() and torch.equal(got["p0"], new)
        mgr.expect_writes(["p1"], False)  # withdrawn: read as it is
        assert torch.equal(mgr.fetch("p1", "device").wait(), data["p1"])
        mgr.release("p1", "device")
        before = mgr.memory_report().order_mismatches
        mgr.fetch("g3", "host", ordered=False).wait()
        mgr.release("g3", "host")
        assert mgr.memory_report().order_mismatches == before
        mgr.expect_writes(["p2"])
        with pytest.raises(OffloadError, match="expected write"):
            mgr.read_into("p2", torch.empty(N))  # nobody writes it: refused after the wait
        mgr.expect_writes(["p2"], False)
        mgr.audit()


def test_the_announced_writer_reads_what_it_replaces(tmp_path: Path) -> None:
    """read_into(replacing=True) is the announced writer's own read (a bf16 master is the
    param its deferred update writes): it does not wait for the expected write, reads the
    current data from NVMe or from a host cache, and is not a use of the prefetch order;
    everyone else still waits for the write."""
    mgr, data = make(tmp_path, device_caches=3, pool=4, timeout=0.5)
    with mgr:
        mgr.expect_writes(["p0", "p1"])
        out = torch.empty(N)
        mgr.read_into("p0", out, replacing=True).wait()  # from its swap file
        assert torch.equal(out, data["p0"])
        mgr.expect_writes(["p1"], False)
        mgr.fetch("p1", "host").wait()  # a host cache, then announced again
        mgr.release("p1", "host")
        mgr.expect_writes(["p1"])
        before = mgr.memory_report()
        mgr.read_into("p1", out, replacing=True).wait()
        after = mgr.memory_report()
        assert torch.equal(out, data["p1"])
        assert after.moved["nvme_to_host"] == before.moved["nvme_to_host"]  # the cache's
        assert after.order_mismatches == before.order_mismatches
        with pytest.raises(OffloadError, match="expected write"):
            mgr.read_into("p0", torch.empty(N))  # not the writer: waits, then refused
        new = torch.full((N,), 7.0)
        mgr.write_from("p0", new).wait()
        mgr.write_from("p1", new).wait()
        mgr.read_into("p0", out).wait()
        assert torch.equal(out, new)
        mgr.audit()


def test_a_full_pool_cleans_one_dirty_cache_ahead(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host caches cleaned ahead]: dirty caches that fit stay dirty (nothing
    written); once a demand has had to write one down, a pool with no room for one more
    starts the write of the dirty cache the next demand would evict (the least recently
    used) and keeps it cached, clean; the next demand drops it without writing anything,
    and every value reads back. One write ahead at a time here, so which caches are
    written does not depend on when a write lands (two: the test after the next one)."""
    monkeypatch.setattr(core, "CLEAN_AHEAD_WRITES", 1)
    sp = [ShardSpec(f"g{i}", "grad", N, torch.float32) for i in range(3)]
    settings = cpu_settings({"grad": "nvme"}, device=1 << 20, host=1 << 20, buffer_count=2)
    with store(tmp_path) as swap, TierManager(sp, settings, swap=swap) as mgr:
        for x in sp:
            mgr.place(x.key, torch.zeros(N)).wait()
        mgr.synchronize()

        def written() -> int:
            return int(mgr.memory_report().moved["host_to_nvme"])

        def host(*keys: str) -> dict[str, State]:
            return {k: mgr._records[k].copies["host"].state for k in keys}

        def fresh(i: int) -> None:
            mgr.fetch(f"g{i}", "host", writable=True, discard=True).wait().fill_(i + 1.0)
            mgr.release(f"g{i}", "host")

        start = written()
        for i in range(2):  # two fresh gradients fill the pool, dirty
            fresh(i)
        mgr.synchronize()
        assert host("g0", "g1") == {"g0": State.DIRTY, "g1": State.DIRTY}
        assert written() == start  # they fit: nothing written
        fresh(2)  # a demand: g0 (least recently used) is written down and dropped
        mgr.synchronize()
        assert written() == start + 2 * 4 * N  # g0, and g1 cleaned ahead
        assert host("g0", "g1", "g2") == {"g0": State.ABSENT, "g1": State.CLEAN,
                                          "g2": State.DIRTY}
        out = torch.empty(N)
        mgr.read_into("g0", out).wait()  # no cache made: nothing evicted
        assert bool((out == 1.0).all())
        mgr.fetch("g0", "host").wait()  # a demand: g1, clean, is dropped unwritten
        mgr.release("g0", "host")
        assert host("g1")["g1"] is State.ABSENT
        mgr.synchronize()
        for i in range(3):
            mgr.read_into(f"g{i}", out).wait()
            assert bool((out == i + 1.0).all()), i
        mgr.audit()


def test_a_prefetch_taking_the_last_room_starts_the_clean_ahead_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: host caches cleaned ahead] in offload/core.py counts the room a read-ahead
    takes: a backward's next param prefetched into the pool's last free buffer starts the
    write of the dirty gradient the next reduction would evict in the same call, not at
    that reduction (which would then wait for the whole write); the values stay exact.
    One write ahead at a time, so the states checked do not depend on when writes land."""
    monkeypatch.setattr(core, "CLEAN_AHEAD_WRITES", 1)
    sp = ([ShardSpec(f"g{i}", "grad", N, torch.float32) for i in range(4)]
          + [ShardSpec("p0", "param", N, torch.float32)])
    settings = cpu_settings({"grad": "nvme", "param": "nvme"}, device=1 << 20, host=1 << 20,
                            buffer_count=3)
    with store(tmp_path) as swap, TierManager(sp, settings, swap=swap) as mgr:
        p0 = data_for(sp[-1], 7)
        for x in sp:
            mgr.place(x.key, p0 if x.key == "p0" else torch.zeros(N)).wait()
        mgr.synchronize()

        def host(key: str) -> State:
            return mgr._records[key].copies["host"].state

        for i in range(4):  # the fourth demand writes g0 down: dirty pressure from now on
            mgr.fetch(f"g{i}", "host", writable=True, discard=True).wait().fill_(i + 1.0)
            mgr.release(f"g{i}", "host")
        mgr.synchronize()
        mgr.evict("g1")  # written ahead, clean: the pool has one free buffer again
        mgr.synchronize()
        assert (host("g1"), host("g2"), host("g3")) == (State.ABSENT, State.DIRTY,
                                                        State.DIRTY)
        mgr.set_order([("p0", "host")])  # the read-ahead takes the free buffer ...
        assert host("p0") in (State.LOADING, State.CLEAN)
        assert host("g2") in (State.STORING, State.CLEAN)  # ... and g2's write starts now
        assert host("g3") is State.DIRTY  # one write ahead at a time
        mgr.synchronize()
        assert torch.equal(mgr.fetch("p0", "host").wait(), p0)
        mgr.release("p0", "host")
        out = torch.empty(N)
        for i in range(4):
            mgr.read_into(f"g{i}", out).wait()
            assert bool((out == i + 1.0).all()), i
        mgr.audit()


def test_a_second_dirty_cache_is_written_ahead_while_the_first_is_in_flight(
        tmp_path: Path) -> None:
    """[Note: host caches cleaned ahead] in offload/core.py keeps up to CLEAN_AHEAD_WRITES
    writes ahead in flight, one started per call: with the first still being written (a
    slow drive), the next call starts the next dirty victim's write rather than leaving
    it for a demand to write whole; no third starts; the values stay exact."""
    assert CLEAN_AHEAD_WRITES == 2
    sp = [ShardSpec(f"g{i}", "grad", N, torch.float32) for i in range(5)]
    settings = cpu_settings({"grad": "nvme"}, device=1 << 20, host=1 << 20, buffer_count=4)
    io = DelayIO()
    with store(tmp_path, fileio=io) as swap, TierManager(sp, settings, swap=swap) as mgr:
        for x in sp:
            mgr.place(x.key, torch.zeros(N)).wait()
        mgr.synchronize()

        def host(key: str) -> State:
            return mgr._records[key].copies["host"].state

        def fresh(i: int) -> None:
            mgr.fetch(f"g{i}", "host", writable=True, discard=True).wait().fill_(i + 1.0)
            mgr.release(f"g{i}", "host")

        for i in range(4):  # four dirty gradients fill the pool: nothing written
            fresh(i)
        mgr.synchronize()
        io.write_delay = 1.0  # every write from here stays in flight for a second
        # a demand writes g0 down and waits for it; then g1's write starts ahead
        mgr.fetch("g4", "host", writable=True, discard=True).wait().fill_(5.0)
        assert host("g0") is State.ABSENT
        assert [host(f"g{i}") for i in (1, 2, 3)] == [State.STORING, State.DIRTY,
                                                       State.DIRTY]
        mgr.release("g4", "host")  # the next call: a second write ahead beside the first
        assert [host(f"g{i}") for i in (1, 2, 3)] == [State.STORING, State.STORING,
                                                       State.DIRTY]
        mgr.set_order([])  # two in flight: no third
        assert host("g3") is State.DIRTY
        io.write_delay = 0.0
        mgr.synchronize()
        out = torch.empty(N)
        for i in range(5):
            mgr.read_into(f"g{i}", out).wait()
            assert bool((out == i + 1.0).all()), i
        mgr.audit()


def test_fetch_ahead_takes_free_room_or_returns_none_holding_nothing(tmp_path: Path) -> None:
    """fetch_ahead (the optimizer reading the next shard while it holds this one): with the
    pool taken by a held cache and a dirty one it returns None at once, writes nothing and
    holds nothing, where a demand fetch would write the dirty one down and wait; with a free
    buffer it fetches like fetch(ordered=False)."""
    sp = [ShardSpec(f"g{i}", "grad", N, torch.float32) for i in range(3)]
    settings = cpu_settings({"grad": "nvme"}, device=1 << 20, host=1 << 20, buffer_count=2)
    with store(tmp_path) as swap, TierManager(sp, settings, swap=swap) as mgr:
        data = {x.key: data_for(x, i) for i, x in enumerate(sp)}
        for k, v in data.items():
            mgr.place(k, v).wait()
        mgr.synchronize()
        mgr.fetch("g0", "host").wait()  # held, as the current shard's gradient
        mgr.fetch("g1", "host", writable=True).wait().add_(1.0)
        mgr.release("g1", "host")  # dirty
        written = mgr.memory_report().moved["host_to_nvme"]
        assert mgr.fetch_ahead("g2", "host") is None
        assert mgr.memory_report().moved["host_to_nvme"] == written
        assert mgr._records["g2"].copies["host"].users == 0
        mgr.release("g0", "host")
        mgr.evict("g0")  # a free buffer now
        t = mgr.fetch_ahead("g2", "host")
        assert t is not None and torch.equal(t.wait(), data["g2"])
        mgr.release("g2", "host")
        mgr.synchronize()
        mgr.audit()
