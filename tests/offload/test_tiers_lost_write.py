"""A lost write ([Note: a lost write] in offload/core.py): a write_from to an NVMe home that
fails leaves the key at its old region. Whoever settles the failure first gets it raised;
from then on every read of the key (read_into, fetch, a snapshot) raises, naming the key
and the failure, until the key is written whole again, discarded, or an undone speculation
points it back at its kept region. A failed write-down of a dirty cache loses nothing (the
cache keeps the data): its reads go on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swap_helpers import FaultyIO
from tiers_util import cpu_settings, data_for, store

from tierzero.offload import OffloadError, ShardSpec, TierManager
from tierzero.swap import aligned_empty

N = 1024
HOMES = {"param": "nvme", "grad": "cpu", "master": "nvme"}


def _make(tmp_path: Path) -> tuple[TierManager, FaultyIO, dict[str, torch.Tensor]]:
    sp = [ShardSpec(f"p{i}", "param", N, torch.float32) for i in range(3)]
    io = FaultyIO()
    mgr = TierManager(sp, cpu_settings(HOMES, device=8 * 4 * N, host=64 * 4 * N,
                                       buffer_count=4), swap=store(tmp_path, fileio=io))
    data = {x.key: data_for(x, i) for i, x in enumerate(sp)}
    for k, v in data.items():
        mgr.place(k, v).wait()
    mgr.synchronize()
    return mgr, io, data


def _read(mgr: TierManager, key: str) -> torch.Tensor:
    out = aligned_empty(N, torch.float32)
    mgr.read_into(key, out).wait()
    return out


def _lose(mgr: TierManager, io: FaultyIO, key: str) -> None:
    """A write_from of `key` fails; its failure is settled by a manager call on another
    key (as a read-ahead thread would), so the writer never waits for it."""
    io.arm("pwrite", 5)
    failed = mgr.write_from(key, torch.full((N,), 7.0))
    while not failed.done():
        pass
    with pytest.raises(OffloadError, match="EIO"):
        mgr.synchronize()  # settles every transfer: the failure is raised here, once


def test_every_read_of_a_lost_write_raises_naming_the_key(tmp_path: Path) -> None:
    mgr, io, data = _make(tmp_path)
    try:
        _lose(mgr, io, "p1")
        for read in (lambda: _read(mgr, "p1"),
                     lambda: mgr.fetch("p1", "host").wait(),
                     lambda: mgr.fetch("p1", "device").wait()):
            with pytest.raises(OffloadError, match=r"'p1'.*last write of this shard failed"
                                                   r".*EIO"):
                read()
        with pytest.raises(OffloadError, match=r"snapshot\('p1'\)"):
            mgr.snapshot(["p0", "p1"], copy_limit=0)
        snap = mgr.snapshot(["p0", "p2"], copy_limit=0)  # the other keys are whole
        mgr.snapshot_close(snap)
        assert torch.equal(_read(mgr, "p0"), data["p0"])
        mgr.audit()
    finally:
        mgr.close()


@pytest.mark.parametrize("how", ["write", "write_through", "discard", "overwrite"])
def test_writing_the_key_whole_again_ends_a_lost_write(tmp_path: Path, how: str) -> None:
    mgr, io, _ = _make(tmp_path)
    try:
        _lose(mgr, io, "p1")
        new = torch.full((N,), 3.0)
        if how == "discard":  # the caller declares the data void and overwrites it
            assert mgr.discard("p1")
            view = mgr.fetch("p1", "host", writable=True, discard=True).wait()
            view.copy_(new)
            mgr.release("p1", "host")
        elif how == "overwrite":  # a fetch that overwrites it whole (a checkpoint's load)
            for tier in ("host", "device"):
                view = mgr.fetch("p1", tier, writable=True, discard=True).wait()
                view.copy_(new)
                mgr.release("p1", tier)
                assert torch.equal(_read(mgr, "p1"), new)  # its cache's, not yet written
        else:
            mgr.write_from("p1", new, keep_host=how == "write_through").wait()
        mgr.synchronize()
        assert torch.equal(_read(mgr, "p1"), new)
    finally:
        mgr.close()


def test_a_failed_write_down_of_a_dirty_cache_loses_nothing(tmp_path: Path) -> None:
    """write_from(keep_host=True) stages the data in a host cache: its failed write-down
    leaves the cache dirty, so reads see the new data and the next write-down lands it."""
    mgr, io, _ = _make(tmp_path)
    try:
        io.arm("pwrite", 5)
        new = torch.full((N,), 5.0)
        t = mgr.write_from("p1", new, keep_host=True)
        with pytest.raises(Exception, match="EIO"):
            t.wait()  # raised to its waiter: not again by the manager call that settles it
        mgr.synchronize()
        assert torch.equal(_read(mgr, "p1"), new)  # the dirty cache's
        mgr.evict("p1")  # written down again
        mgr.synchronize()
        assert torch.equal(_read(mgr, "p1"), new)  # from the swap file
    finally:
        mgr.close()


def test_an_undone_speculation_ends_a_lost_write(tmp_path: Path) -> None:
    mgr, io, data = _make(tmp_path)
    try:
        mgr.speculate(["p0", "p1"])
        mgr.write_from("p0", torch.full((N,), 1.0)).wait()
        _lose(mgr, io, "p1")
        assert sorted(mgr.undo_speculation()) == ["p0", "p1"]
        for key in ("p0", "p1"):
            assert torch.equal(_read(mgr, key), data[key]), key
    finally:
        mgr.close()
