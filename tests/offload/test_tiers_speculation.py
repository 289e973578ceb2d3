"""TierManager speculations ([Note: speculated shards] in offload/speculation.py): writes of
speculated keys are undone exactly (data, caches, versions) or committed; the swap file
keeps no region afterwards; keys homed off NVMe cannot be speculated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiers_util import cpu_settings, data_for, store

from tierzero.offload import OffloadError, ShardSpec, TierManager
from tierzero.offload.speculation import SpeculationSpaceError
from tierzero.swap import aligned_empty

N = 1024
HOMES = {"param": "nvme", "grad": "cpu", "master": "nvme"}


def _make(tmp_path: Path) -> tuple[TierManager, dict[str, torch.Tensor]]:
    sp = ([ShardSpec(f"p{i}", "param", N, torch.float32) for i in range(3)]
          + [ShardSpec("g0", "grad", N, torch.float32), ShardSpec("m0", "master", N,
                                                                   torch.float32)])
    mgr = TierManager(sp, cpu_settings(HOMES, device=8 * 4 * N, host=64 * 4 * N,
                                       buffer_count=4), swap=store(tmp_path))
    data = {x.key: data_for(x, i) for i, x in enumerate(sp)}
    for k, v in data.items():
        mgr.place(k, v).wait()
    mgr.synchronize()
    return mgr, data


def _read(mgr: TierManager, key: str) -> torch.Tensor:
    out = aligned_empty(N, torch.float32)
    mgr.read_into(key, out).wait()
    return out


def _swap_stats(mgr: TierManager):  # type: ignore[no-untyped-def]
    return mgr._mover.swap.stats()  # type: ignore[union-attr]


def test_undo_restores_every_written_key_and_drops_its_caches(tmp_path: Path) -> None:
    mgr, data = _make(tmp_path)
    try:
        # a dirty host cache from before: written down first, so the undo keeps it
        view = mgr.fetch("p2", "host", writable=True).wait()
        view.fill_(9.0)
        mgr.release("p2", "host")
        data["p2"] = torch.full((N,), 9.0)
        used = _swap_stats(mgr).used_bytes
        mgr.speculate(["p0", "p1", "p2", "m0"])
        assert mgr.speculating
        v0 = mgr.version("p0")
        mgr.write_from("p0", torch.full((N,), 1.0), keep_host=True)  # a host cache after it
        mgr.write_from("p2", torch.full((N,), 2.0))
        mgr.write_from("m0", torch.full((N,), 3.0))
        mgr.write_from("m0", torch.full((N,), 4.0))  # a second write: the first's region is new
        mgr.fetch("p0", "device").wait()  # a device cache of the speculated data
        mgr.release("p0", "device")
        assert torch.equal(_read(mgr, "p0"), torch.full((N,), 1.0))
        assert sorted(mgr.undo_speculation()) == ["m0", "p0", "p2"]
        assert not mgr.speculating and mgr.version("p0") > v0 + 1
        for key in ("p0", "p1", "p2", "m0"):
            assert torch.equal(_read(mgr, key), data[key]), key
            dev = mgr.fetch(key, "device").wait()
            assert torch.equal(dev, data[key]), key
            mgr.release(key, "device")
        mgr.synchronize()
        st = _swap_stats(mgr)
        assert st.kept_regions == 0 and st.used_bytes == used
        mgr.audit()
    finally:
        mgr.close()


def test_commit_keeps_the_writes_and_frees_the_old_regions(tmp_path: Path) -> None:
    mgr, _ = _make(tmp_path)
    try:
        used = _swap_stats(mgr).used_bytes
        mgr.reserve_speculation(["p0", "m0"])
        mgr.speculate(["p0", "m0"])
        mgr.write_from("p0", torch.full((N,), 5.0))
        mgr.write_from("p1", torch.full((N,), 6.0))  # not speculated: kept nothing
        assert _swap_stats(mgr).kept_regions == 1
        assert mgr.commit_speculation() == 1
        mgr.synchronize()
        assert torch.equal(_read(mgr, "p0"), torch.full((N,), 5.0))
        assert torch.equal(_read(mgr, "p1"), torch.full((N,), 6.0))
        st = _swap_stats(mgr)
        assert st.kept_regions == 0 and st.used_bytes == used
        assert mgr.undo_speculation() == [] and mgr.commit_speculation() == 0
    finally:
        mgr.close()


def test_only_nvme_homes_one_at_a_time_and_held_caches_refuse_the_undo(tmp_path: Path
                                                                        ) -> None:
    mgr, data = _make(tmp_path)
    try:
        with pytest.raises(OffloadError, match="not homed on NVMe"):
            mgr.speculate(["p0", "g0"])
        mgr.speculate(["p0"])
        with pytest.raises(OffloadError, match="open already"):
            mgr.speculate(["p1"])
        mgr.write_from("p0", torch.full((N,), 1.0))
        mgr.fetch("p0", "host").wait()  # held across the undo: refused, nothing left kept
        with pytest.raises(OffloadError, match="held or pinned"):
            mgr.undo_speculation()
        mgr.release("p0", "host")
        assert not mgr.speculating and _swap_stats(mgr).kept_regions == 0
        del data
    finally:
        mgr.close()


def test_reserve_refuses_past_the_nvme_budget(tmp_path: Path) -> None:
    """The kept regions must fit the nvme budget beside the swap file's own growth."""
    sp = [ShardSpec(f"p{i}", "param", N, torch.float32) for i in range(3)]
    mgr = TierManager(sp, cpu_settings(HOMES, device=8 * 4 * N, host=64 * 4 * N,
                                       buffer_count=4), swap=store(tmp_path))
    try:
        one, grown = mgr.speculation_bytes(["p0"]), mgr.plan.swap_file_bytes()
        mgr.reserve_speculation(["p0", "p1", "p2"])
    finally:
        mgr.close()
    (tmp_path / "b").mkdir()
    mgr = TierManager(sp, cpu_settings(HOMES, device=8 * 4 * N, host=64 * 4 * N,
                                       buffer_count=4, nvme=grown + one),
                      swap=store(tmp_path / "b"))
    try:
        mgr.reserve_speculation(["p0"])
        with pytest.raises(SpeculationSpaceError, match="past the nvme budget"):
            mgr.reserve_speculation(["p0", "p1"])
    finally:
        mgr.close()


def test_undo_after_a_failed_write_restores_the_rest_and_keeps_nothing(tmp_path: Path
                                                                        ) -> None:
    """The update's write of one key fails (EIO) and nobody waited for it: the undo logs
    the failure instead of stopping halfway, every written key holds its old data again
    (the failed one never left it) and no region stays kept."""
    from swap_helpers import FaultyIO

    sp = [ShardSpec(f"p{i}", "param", N, torch.float32) for i in range(3)]
    io = FaultyIO()
    mgr = TierManager(sp, cpu_settings(HOMES, device=8 * 4 * N, host=64 * 4 * N,
                                       buffer_count=4), swap=store(tmp_path, fileio=io))
    try:
        data = {x.key: data_for(x, i) for i, x in enumerate(sp)}
        for k, v in data.items():
            mgr.place(k, v).wait()
        mgr.synchronize()
        mgr.speculate(["p0", "p1", "p2"])
        mgr.write_from("p0", torch.full((N,), 1.0)).wait()
        io.arm("pwrite", 5)  # the next block written fails
        failed = mgr.write_from("p1", torch.full((N,), 2.0))
        with pytest.raises(Exception, match="EIO"):
            failed.wait()
        assert sorted(mgr.undo_speculation()) == ["p0", "p1"]
        for key in ("p0", "p1", "p2"):
            assert torch.equal(_read(mgr, key), data[key]), key
        assert _swap_stats(mgr).kept_regions == 0
    finally:
        mgr.close()
