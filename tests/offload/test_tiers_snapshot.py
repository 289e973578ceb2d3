"""TierManager snapshots ([Note: shard snapshots] in offload/snapshot.py): the data at the
call is what snapshot_take returns, whatever the shards became meanwhile, on every home
tier; copies of host/device homes stay under copy_limit (writers wait instead); nothing
is left kept or counted once the snapshot is taken or closed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from tiers_util import DelayIO, cpu_settings, data_for, store

from tierzero.offload import OffloadError, ShardSpec, TierManager
from tierzero.offload.errors import TransferError
from tierzero.offload.snapshot import SNAPSHOT_PURPOSE
from tierzero.offload.transfer import TierTransfer
from tierzero.swap import aligned_empty

N = 1024
HOMES = {"param": "nvme", "grad": "cpu", "master": "none"}  # nvme, host, device homes


def _make(tmp_path: Path, write_delay: float = 0.0
          ) -> tuple[TierManager, dict[str, torch.Tensor]]:
    sp = ([ShardSpec(f"p{i}", "param", N, torch.float32) for i in range(3)]
          + [ShardSpec(f"g{i}", "grad", N, torch.float32) for i in range(3)]
          + [ShardSpec("m0", "master", N, torch.float32)])
    mgr = TierManager(sp, cpu_settings(HOMES, device=8 * 4 * N, host=64 * 4 * N,
                                       buffer_count=4),
                      swap=store(tmp_path, fileio=DelayIO(write_delay=write_delay)))
    data = {x.key: data_for(x, i) for i, x in enumerate(sp)}
    for k, v in data.items():
        mgr.place(k, v).wait()
    mgr.synchronize()
    return mgr, data


def _modify(mgr: TierManager, key: str, tier: str, value: float) -> None:
    view = mgr.fetch(key, tier, writable=True).wait()  # type: ignore[arg-type]
    view.fill_(value)
    mgr.release(key, tier)  # type: ignore[arg-type]


def test_snapshot_holds_the_data_at_the_call_on_every_home(tmp_path: Path) -> None:
    mgr, data = _make(tmp_path)
    try:
        _modify(mgr, "p1", "host", 7.0)  # a dirty host cache: written down by snapshot()
        data["p1"] = torch.full((N,), 7.0)
        keys = sorted(data)
        snap = mgr.snapshot(keys, copy_limit=1 << 20)
        assert set(snap.kept) == {"p0", "p1", "p2"} and snap.pending == {"g0", "g1", "g2", "m0"}
        mgr.write_from("p0", torch.full((N,), 1.0)).wait()  # NVMe: copy-on-write in swap
        _modify(mgr, "p1", "host", 2.0)
        mgr.evict("p1")
        _modify(mgr, "g0", "host", 3.0)  # host home: copied before the change
        _modify(mgr, "m0", "device", 4.0)  # device home
        mgr.synchronize()
        assert mgr.memory_report().outside[SNAPSHOT_PURPOSE] == 2 * 4 * N
        for key in keys:
            out = aligned_empty(N, torch.float32)
            mgr.snapshot_take(snap, key, out)
            assert torch.equal(out, data[key]), key
        with pytest.raises(OffloadError, match="taken already"):
            mgr.snapshot_take(snap, "p0", aligned_empty(N, torch.float32))
        mgr.snapshot_close(snap)
        assert mgr.memory_report().outside[SNAPSHOT_PURPOSE] == 0
        st = mgr._mover.swap.stats()  # type: ignore[union-attr]
        assert st.kept_regions == 0 and st.kept_retired_bytes == 0
        got = torch.empty(N)
        mgr.read_into("p0", got).wait()
        assert float(got[0]) == 1.0  # the training's data moved on
    finally:
        mgr.close()


def test_writers_wait_for_the_reader_past_copy_limit(tmp_path: Path) -> None:
    """copy_limit one shard: the first changed host shard is copied, the second writer
    waits until the reader has taken a shard (freeing the copy), then copies its own."""
    mgr, data = _make(tmp_path)
    try:
        snap = mgr.snapshot(["g0", "g1", "g2"], copy_limit=4 * N)
        _modify(mgr, "g0", "host", 1.0)
        done = threading.Event()

        def writer() -> None:
            _modify(mgr, "g1", "host", 2.0)
            done.set()

        t = threading.Thread(target=writer)
        t.start()
        assert not done.wait(0.3)  # blocked: no room for a second copy
        out = aligned_empty(N, torch.float32)
        mgr.snapshot_take(snap, "g0", out)  # frees g0's copy
        t.join(10)
        assert done.is_set()
        assert torch.equal(out, data["g0"])
        for key in ("g1", "g2"):
            mgr.snapshot_take(snap, key, out)
            assert torch.equal(out, data[key]), key
        assert snap.copies_made == 2 and snap.copy_waits >= 1
        mgr.snapshot_close(snap)
    finally:
        mgr.close()


def test_close_releases_what_was_not_taken(tmp_path: Path) -> None:
    mgr, _ = _make(tmp_path)
    try:
        snap = mgr.snapshot(["p0", "g0"], copy_limit=1 << 20)
        mgr.write_from("p0", torch.zeros(N)).wait()
        _modify(mgr, "g0", "host", 5.0)
        mgr.snapshot_close(snap)
        mgr.snapshot_close(snap)  # idempotent
        assert mgr.memory_report().outside[SNAPSHOT_PURPOSE] == 0
        assert mgr._mover.swap.stats().kept_regions == 0  # type: ignore[union-attr]
        mgr.snapshot(["p0"], copy_limit=0)  # a new one may open
    finally:
        mgr.close()


def test_awaiting_keys_are_recorded_when_their_update_lands(tmp_path: Path) -> None:
    """Keys recorded as awaiting ([Note: shard snapshots]): they may be held writable when
    the snapshot opens; the update's writes before snapshot_landed are not preserved (the
    snapshot is what the update leaves); a take waits for the landing; a write after it is
    preserved as for any host/device home; a failed update makes the take fail. (NVMe
    homes: test_awaiting_nvme_keys_keep_the_region_their_update_left.)"""
    mgr, data = _make(tmp_path)
    try:
        held = mgr.fetch("g0", "host", writable=True).wait()  # the update in progress
        snap = mgr.snapshot(["g0", "g1", "g2", "m0"], copy_limit=1 << 20,
                            awaiting=["g0", "g1", "m0"])
        held.fill_(1.0)
        mgr.release("g0", "host")
        _modify(mgr, "m0", "device", 2.0)
        assert snap.copies_made == 0  # the awaited update's own writes
        got: dict[str, torch.Tensor] = {}

        def reader() -> None:
            out = aligned_empty(N, torch.float32)
            mgr.snapshot_take(snap, "g0", out)
            got["g0"] = out

        t = threading.Thread(target=reader)
        t.start()
        t.join(0.3)
        assert t.is_alive()  # waits for the landing
        mgr.snapshot_landed(snap, ["g0", "m0"], None)
        t.join(10)
        assert not t.is_alive() and torch.equal(got["g0"], torch.full((N,), 1.0))
        _modify(mgr, "m0", "device", 3.0)  # the next change: the landed bytes copied first
        assert snap.copies_made == 1
        out = aligned_empty(N, torch.float32)
        mgr.snapshot_take(snap, "m0", out)
        assert torch.equal(out, torch.full((N,), 2.0))
        mgr.snapshot_take(snap, "g2", out)  # not awaiting: the data at the call
        assert torch.equal(out, data["g2"])
        mgr.snapshot_landed(snap, ["g1"], "injected failure")
        with pytest.raises(OffloadError, match="injected failure"):
            mgr.snapshot_take(snap, "g1", out)
        mgr.snapshot_close(snap)
        assert mgr.memory_report().outside[SNAPSHOT_PURPOSE] == 0
    finally:
        mgr.close()


def test_awaiting_nvme_keys_keep_the_region_their_update_left(tmp_path: Path) -> None:
    """NVMe homes may await ([Note: shard snapshots]): the update reports its end once its
    write is issued, before it lands (a slow disk: 50 ms a block); snapshot_landed does
    not wait for the disk. The region is kept once the write has landed: by the take,
    which waits for it, or by the next write of the key, which keeps it before replacing
    it; never one from before the update, nor one mid-write. A write of the update that
    failed makes the take fail, and every read of the key until it is written again. The
    swap room the later writes need is reserved at the call."""
    mgr, data = _make(tmp_path, write_delay=0.05)
    swap = mgr._mover.swap
    try:
        free0 = swap.stats().file_bytes  # type: ignore[union-attr]
        snap = mgr.snapshot(["p0", "p1", "p2"], copy_limit=0, awaiting=["p0", "p1", "p2"])
        assert snap.kept_total >= 3 * 4 * N and not snap.kept
        assert swap.stats().file_bytes >= free0  # type: ignore[union-attr]
        ones = torch.full((N,), 1.0)
        updated = [mgr.write_from(k, ones) for k in ("p0", "p1")]  # the update's writes
        start = time.perf_counter()
        mgr.snapshot_landed(snap, ["p0", "p1"], None)
        assert time.perf_counter() - start < 0.04  # did not wait for the 50 ms write
        assert set(snap.landing) == {"p0", "p1"} and not snap.kept
        mgr.write_from("p0", torch.full((N,), 2.0)).wait()  # the next write: kept first
        assert "p0" in snap.kept and "p0" not in snap.landing
        for key in ("p0", "p1"):  # p1: the take waits for its write to land
            out = aligned_empty(N, torch.float32)
            mgr.snapshot_take(snap, key, out)
            assert torch.equal(out, ones), key
        for t in updated:
            t.wait()

        def failed_write(key: str, src: torch.Tensor) -> TierTransfer:
            def fail() -> object:
                raise TransferError(f"injected write failure of {key}")
            return TierTransfer(src, src.numel() * 4, "host_to_nvme", fail, lambda: True)

        real = mgr._mover.write
        mgr._mover.write = failed_write  # type: ignore[method-assign]
        mgr.write_from("p2", ones)
        mgr._mover.write = real  # type: ignore[method-assign]
        mgr.snapshot_landed(snap, ["p2"], None)
        with pytest.raises(TransferError, match="injected write failure"):
            mgr.snapshot_take(snap, "p2", aligned_empty(N, torch.float32))
        mgr.snapshot_close(snap)
        assert swap.stats().kept_regions == 0  # type: ignore[union-attr]
        mgr.synchronize()  # raised once, to the take that waited for it: not again here
        out = aligned_empty(N, torch.float32)
        with pytest.raises(OffloadError, match=r"'p2'.*last write of this shard failed"):
            mgr.read_into("p2", out).wait()  # [Note: a lost write]: older data, not read
        mgr.write_from("p2", data["p2"]).wait()  # written whole again: read as written
        mgr.read_into("p2", out).wait()
        assert torch.equal(out, data["p2"])
    finally:
        mgr.close()
